"""`python -m autopar ...` is the `autopar` command."""

from autopar.cli import main

raise SystemExit(main())
