"""`fnzero launch`: DeepSpeed's runner on torchrun (`specs/cli.md` §fnzero launch)."""
