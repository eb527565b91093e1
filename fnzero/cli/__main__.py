"""`python -m fnzero.cli`: the `fnzero` command. Also runs as a script (`fnzero launch ...
fnzero/cli/__main__.py bench comm`: torchrun starts a file), hence the absolute import."""

from fnzero.cli._main import main

raise SystemExit(main())
