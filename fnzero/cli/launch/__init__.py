"""`fnzero launch`: DeepSpeed's runner on torchrun (`specs/cli.md` §fnzero launch; its modules:
§How a launch runs)."""

from ._binding import rank_program
from ._checks import launch_options, scan_launch_args, too_few_ranks
from ._flags import add_launch_parser, add_rank_flags
from ._hosts import DEFAULT_HOSTFILE, HostfileError, LaunchError, read_hostfile, select
from ._launch import EXECUTORS, launch_main, plan_launch
from ._node import machine_slots
from ._plan import LaunchPlan
from ._rank_front import rank_log_folder
from ._ssh import pump, ssh_command
from ._torchrun import run_torchrun


# What fnzero's other packages use of this one, beyond the documented surface above: they import
# it from here, not from the private modules (`specs/architecture.md` §Package faces).
from ._rank_front import main

__all__ = ["DEFAULT_HOSTFILE", "EXECUTORS", "HostfileError", "LaunchError", "LaunchPlan", "add_launch_parser",
           "add_rank_flags", "launch_main", "launch_options", "machine_slots", "plan_launch", "pump", "rank_log_folder",
           "rank_program", "read_hostfile", "run_torchrun", "scan_launch_args", "select", "ssh_command",
           "too_few_ranks"]
