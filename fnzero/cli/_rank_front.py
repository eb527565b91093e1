"""`python -m fnzero.cli._rank_front [FLAGS] SCRIPT ARGS`: the rank front, under the name every
launched rank's command line carries (`specs/cli.md` §Launcher flags); the front itself is
`launch/_rank_front.py`. Nothing imports this module, so that `-m` runs it fresh."""

import sys

from fnzero.cli.launch import main

if __name__ == "__main__":
    main(sys.argv[1:])
