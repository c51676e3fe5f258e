from tokenfleet.services.decode.main import main

raise SystemExit(main(default_role="prefill"))
