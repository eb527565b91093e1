"""The `torchrun` kind of launch plan: this node's ranks under torchrun's agent, run in this
process (`run_here`), and the line naming the rank at fault when the job fails."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import threading

from ._plan import LaunchPlan

__all__ = ["run_here", "run_torchrun"]


def run_here(plan: LaunchPlan) -> int:
    """Run a `torchrun` plan; its exit status."""
    os.environ.update(plan.setenv)  # inherited by every worker torchrun starts
    if plan.exit_with_stdin:
        _exit_with_stdin()
    if plan.pid_file:
        if plan.announce:  # a launcher line, which -q leaves out
            print(plan.announce)
        with open(plan.pid_file, "w") as f:
            f.write(str(os.getpid()))
    try:
        return run_torchrun(list(plan.command))
    finally:
        if plan.pid_file and os.path.exists(plan.pid_file):
            os.remove(plan.pid_file)


def run_torchrun(argv: list[str]) -> int:
    """torchrun's agent on this node; its exit status. When it failed, the last line names the
    rank at fault, from what the ranks left (`sharding/comm/_failure.py`) or else torchrun's own
    root cause."""
    from torch.distributed import run as torchrun

    from ..._ext import allocator_env
    from ...sharding import root_cause

    os.environ.update(allocator_env())  # inherited by every worker torchrun starts
    # Each rank leaves its error, or the watchdog's verdict, here (`sharding/comm/_failure.py`), so
    # the last line can name the rank at fault and say what happened.
    failures = tempfile.mkdtemp(prefix="fnzero-launch-")
    os.environ["FNZERO_FAILURE_DIR"] = failures
    # torchrun copies its root cause's error file to its own: there, not a logged complaint that
    # it has none (each worker is given its own path).
    os.environ.setdefault("TORCHELASTIC_ERROR_FILE", os.path.join(failures, "torchrun.error"))
    # torchrun's agent makes a log directory for every run (empty unless asked to redirect the ranks'
    # output, which fnzero does not): without one given it leaves a `torchelastic_*` in the temp
    # directory per launch. In the failures' folder it goes when the launch ends.
    argv = ["--log-dir", os.path.join(failures, "torchelastic"), *argv]
    exits: dict[int, int] = {}
    try:
        torchrun.main(argv)
        code = 0
    except SystemExit as e:  # torchrun exits with the failing worker's code
        code = int(e.code or 0)
    except Exception as e:  # ChildFailedError: its summary names torchrun's root cause
        print(f"fnzero launch: {type(e).__name__}: {e}", file=sys.stderr)
        code = 1
        exits = {int(r): f.exitcode for r, f in getattr(e, "failures", {}).items()}
        if exits:
            first = e.get_first_failure()[0]
            exits = {first: exits[first], **exits}  # torchrun's root cause first
    finally:
        cause = root_cause(failures)
        shutil.rmtree(failures, ignore_errors=True)
    if code and (cause or exits):
        print(f"fnzero launch: root cause: {_blame(cause, exits)}", file=sys.stderr)
    return code


def _blame(cause: tuple[list[int], str, int | None] | None, exits: dict[int, int]) -> str:
    """One line: the rank(s) at fault, how each ended (torchrun's exit status), what happened."""
    def ended(r: int) -> str:
        code = exits.get(r)
        if code is None:
            return ""
        try:
            return f" (ended by {signal.Signals(-code).name})" if code < 0 else f" (exit status {code})"
        except ValueError:
            return f" (exit status {code})"

    if cause is None:  # no rank said anything: a failure before `init_distributed`, say
        r = next(iter(exits))
        return f"rank {r}{ended(r)}, torchrun's first observed failure: see its output above"
    ranks, message, seen_by = cause
    who = ", ".join(f"rank {r}{ended(r)}" for r in ranks)
    return f"{who}: {message}" if seen_by is None else f"{who}, as rank {seen_by} saw it: {message}"


def _exit_with_stdin() -> None:
    """End this launcher (torchrun's agent stops its workers on SIGTERM) when standard input
    closes: started by `fnzero launch --hostfile` over SSH, it so ends with the channel."""
    def watch():  # raw reads: a daemon thread must not hold sys.stdin's lock at interpreter exit
        try:
            while os.read(0, 65536):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="fnzero-launch-stdin", daemon=True).start()
