"""`python -m pdserve.cli ...` is the `pdserve` command."""

from pdserve.cli.main import main

raise SystemExit(main())
