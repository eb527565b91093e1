"""`python -m fnzero.cli`: the `fnzero` command."""

from ._main import main

raise SystemExit(main())
