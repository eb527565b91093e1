"""`python -m fnzero.cli._bind_rank [--bind_core_list=L] [--module | --no_python] SCRIPT ARGS`: what
`fnzero launch --bind_cores_to_rank` runs in front of each rank (`_binding.py`). It reads the rank's
local rank and local size from the launcher's environment (torchrun's, an MPI's, SLURM's), sets
OMP_NUM_THREADS to its share of cores and replaces itself with the bound command.
(Not imported by `fnzero.cli`, so that `python -m` runs it fresh.)"""

from __future__ import annotations

import os
import sys

from ._binding import bind_command, rank_program
from ._hosts import LaunchError


def main(argv: list[str]) -> None:
    """Bind, then become the rank's program."""
    from .._launch_env import launcher_ranks

    core_list = None
    module = no_python = False
    while argv and argv[0].startswith("--"):
        flag = argv.pop(0)
        if flag.startswith("--bind_core_list="):
            core_list = flag.partition("=")[2]
        module |= flag == "--module"
        no_python |= flag == "--no_python"
    _, _, local_rank, local_size = launcher_ranks()
    try:
        per, prefix = bind_command(core_list, local_size or 1, local_rank)
        program = rank_program(sys.executable, argv[0], argv[1:], module, no_python)
    except LaunchError as e:
        print(f"fnzero launch: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    os.environ["OMP_NUM_THREADS"] = str(per)
    os.execvp(prefix[0], prefix + program)


if __name__ == "__main__":
    main(sys.argv[1:])
