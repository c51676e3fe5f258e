from tokenfleet.services.router.main import main

raise SystemExit(main())
