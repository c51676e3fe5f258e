from tokenfleet.services.registry.main import main

raise SystemExit(main())
