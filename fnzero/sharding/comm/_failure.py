"""What a failing rank leaves behind, so that the launcher blames the rank at fault
(`specs/collectives.md` §Blame), and `explain_failure`: a collective's backend error as a
`DistributedError`'s message and ranks."""

from __future__ import annotations

import json
import os
import re
import sys
import time
import traceback

from ..._errors import DistributedError

__all__ = ["LINGER_S", "VERDICT_PREFIX", "explain_failure", "uncaught", "peers_at_fault", "leave_record",
           "write_error_file", "record_exception", "process_alive", "linger", "root_cause"]

# How long a rank that failed because of a peer waits for the launcher to stop it. torchrun's
# agent checks its workers every 0.1 s (every 1 s under `fnzero launch`) and stops the rest at
# once, so it comes within a second or two even on a loaded machine; without a launcher that
# stops it (another node's peer, a launcher other than torchrun) the rank ends after this.
LINGER_S = 15.0
VERDICT_PREFIX = "fnzero watchdog: "


def uncaught() -> BaseException | None:
    """The exception that is ending this process, when an atexit handler asks (Python sets
    `sys.last_value` before it runs them); None at a normal exit."""
    exc = sys.last_value if hasattr(sys, "last_value") else None
    return None if isinstance(exc, SystemExit) else exc


def peers_at_fault(exc: BaseException | None, rank: int) -> tuple[int, ...]:
    """The other ranks `exc` names as the cause of this rank's failure; () when its own (or unknown)."""
    if isinstance(exc, DistributedError) and exc.ranks and rank not in exc.ranks:
        return exc.ranks
    return ()


def one_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def leave_record(rank: int, ranks: tuple[int, ...] | list[int], message: str, kind: str) -> None:
    """Leave `message` for `fnzero launch` (FNZERO_FAILURE_DIR): `kind` "error" (this rank's own
    failure), "verdict" (the watchdog's judgement) or "consequence" (failed because of `ranks`).
    The first record of a kind per rank stays; written whole or not at all."""
    folder = os.environ.get("FNZERO_FAILURE_DIR")
    if not folder:
        return
    path = os.path.join(folder, f"rank{rank:05d}.{kind}.json")
    if os.path.exists(path):
        return
    try:
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"rank": rank, "ranks": sorted(ranks), "kind": kind, "t": time.time(), "message": message}, f)
        os.replace(tmp, path)
    except OSError:  # the launcher's folder is gone: it has finished with this job
        pass


def write_error_file(message: str, stack: str) -> None:
    """This rank's own failure in torchrun's error file, as torch's `@record` writes it (kept
    if the script's own `@record` wrote it first)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    data = {"message": {"message": message, "extraInfo": {"py_callstack": stack, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass


def record_exception(rank: int, exc: BaseException, peers: tuple[int, ...]) -> None:
    """The records of a rank that an uncaught `exc` ends: its own error, or a consequence of `peers`."""
    if peers:
        leave_record(rank, peers, str(exc), "consequence")
    else:
        message = f"{type(exc).__name__}: {exc}"
        write_error_file(message, "".join(traceback.format_exception(exc)))
        leave_record(rank, [rank], message, "error")


def process_alive(pid) -> bool:
    """Whether process `pid` of this machine still runs (True when it cannot be known)."""
    if not isinstance(pid, int):
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed child not yet reaped by the launcher is a zombie: gone all the same
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def linger(seconds: float = LINGER_S) -> None:
    """Under torchrun, wait for its agent to stop this process (its SIGTERM ends the wait)."""
    if not os.environ.get("TORCHELASTIC_RUN_ID"):
        return
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.05)


def root_cause(folder: str) -> tuple[list[int], str, int | None] | None:
    """(the ranks at fault, what happened, the rank that saw it or None when a rank at fault said it)
    from the records in `folder`: the first own error or verdict, else the first consequence; None
    without records."""
    records = []
    for name in os.listdir(folder):
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(folder, name)) as f:
                r = json.load(f)
            records.append((r["kind"] == "consequence", float(r["t"]), [int(x) for x in r["ranks"]],
                            str(r["message"]), int(r["rank"])))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    if not records:
        return None
    _, _, ranks, message, writer = min(records, key=lambda r: (r[0], r[1]))
    return ranks, one_line(message), None if writer in ranks else writer


def _backend_words(error: BaseException) -> str:
    """The backend's message, short: gloo's first sentence without its source location
    ("[.../pair.cc:553] Connection closed by peer [127.0.0.1]:6382. This is typically ...")."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h|hpp):\d+\]\s*", "", text)
    return text.split(". ")[0]


def explain_failure(wd, seq: int, kind: str, error: BaseException,
                    label: str = "") -> tuple[str, list[int]]:
    """(message, ranks at fault) of collective #seq's backend error: a stuck rank's verdict, else the
    ranks gone or raised, else the backend's words and no rank; quick, as torchrun stops the rest soon."""
    what = wd.describe(seq, kind, label) if wd is not None else f"a {kind}"
    raw = f"{type(error).__name__}: {_backend_words(error)}"
    unknown = f"{what} failed ({raw}); a peer rank probably died: see its own error above"
    if wd is None:
        return unknown, []
    try:
        deadline = time.time() + wd.poll_s + 0.5
        while True:
            verdict, stuck = wd.verdict_ranks()
            if verdict:
                return f"{what} failed because {verdict[len(VERDICT_PREFIX):]}", stuck
            beats = wd.beats()
            dead = wd.dead(beats)
            if dead:
                return f"{what} failed: rank(s) {dead} stopped (killed, out of memory, or crashed) ({raw})", dead
            failed = {r: b["failed"] for r, b in beats.items() if r != wd.rank and b.get("failed")}
            if failed:
                return f"{what} failed: " + "; ".join(f"rank {r} raised {e}" for r, e in sorted(failed.items())), sorted(failed)
            ended = sorted(r for r, b in beats.items() if r != wd.rank and b.get("done"))
            if ended:
                return f"{what} failed: rank(s) {ended} ended their process before it ({raw})", ended
            if time.time() > deadline:
                break
            time.sleep(0.05)
    except Exception:  # the store went with the job
        pass
    return unknown, []
