from tokenfleet.services.gateway.main import main

raise SystemExit(main())
