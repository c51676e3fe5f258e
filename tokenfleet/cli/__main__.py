"""`python -m tokenfleet.cli ...`: the `tokenfleet` command (subprocesses and tests run it this way)."""

from tokenfleet.cli.parser import main

raise SystemExit(main())
