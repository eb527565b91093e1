"""The collective watchdog: a rank that does not reach a collective is named, and the job ends,
before the process group's timeout would fail a rank that did nothing wrong (`specs/collectives.md`
§Watchdog). It never issues a collective: one store round trip per rank per `poll_s`."""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any, Callable

from ._failure import (LINGER_S, VERDICT_PREFIX as _PREFIX, leave_record, linger, peers_at_fault, process_alive,
                       record_exception, uncaught, write_error_file)

__all__ = ["Watchdog", "start_watchdog", "process_watchdog"]

# Per torchrun restart attempt, as torch's own worker keys: a restarted job starts with no verdict.
_KEY = f"fnzero/watchdog/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
_HOST = socket.gethostname()


def _machine() -> str:
    """This host, boot and pid namespace: two processes with the same value can see each other's
    pids (containers sharing a hostname cannot)."""
    parts = [_HOST]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
        parts.append(str(os.stat("/proc/self/ns/pid").st_ino))
    except OSError:
        parts.append("?")
    return "/".join(parts)


_MACHINE = _machine()


class Watchdog:
    """The per-process state the collectives update (cheap: attribute writes) and the thread that
    publishes and judges it; told the config's timeout (`set_timeout`) and the step (`at_step`)."""

    def __init__(self, store, rank: int, world_size: int, timeout_s: float, poll_s: float = 1.0,
                 exit_fn: Callable[[int], Any] = os._exit, limit_s: float = math.inf,
                 kill_fn: Callable[[int], Any] = lambda pid: os.kill(pid, signal.SIGKILL)):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.poll_s, self._exit, self._kill = float(poll_s), exit_fn, kill_fn
        self.limit_s = float(limit_s)  # half the process group's timeout: judge before the backend fails a rank
        self.timeout_s = min(float(timeout_s), self.limit_s)
        self.issued = 0  # collectives issued so far; the last one is #issued
        self.last: tuple[str, str] = ("", "")  # (kind, unit) of the last issued
        self.blocked: tuple[int, str, str, float] | None = None  # (seq, kind, unit, since) while waiting
        self.step: int | None = None
        self.failed: str | None = None  # this rank's own error, said at exit
        self._announced = False
        self._seen: dict[int, tuple[float, float]] = {}  # rank -> (its beat's time, when seen here)
        self._ahead: dict[int, tuple[int, float]] = {}  # rank -> (my count, since): that rank has issued more
        self._behind: dict[int, tuple[int, float]] = {}  # rank -> (its count, since): that rank has issued less
        self._main = threading.main_thread()
        self._stop = threading.Event()
        self._deadline: float | None = None  # set when this rank ended the stuck: it ends by then
        self._thread = threading.Thread(target=self._run, name="fnzero-watchdog", daemon=True)

    # -- what shard and the step call ------------------------------------------------------------
    def set_timeout(self, seconds: float) -> None:
        """The config's `watchdog.timeout_seconds` (0 = off), held within `limit_s`."""
        self.timeout_s = min(float(seconds), self.limit_s)

    def at_step(self, step: int) -> None:
        """The step now running, for the verdicts."""
        self.step = int(step)

    # -- what the collectives call (the main thread) ---------------------------------------------
    def issue(self, kind: str, unit: str = "") -> int:
        self.issued += 1
        self.last = (kind, unit)
        return self.issued

    def waiting(self, seq: int, kind: str, unit: str):
        """Context for a blocking wait on collective #seq."""
        return _Waiting(self, seq, kind, unit)

    def describe(self, seq: int, kind: str, unit: str, step: int | None = None) -> str:
        """Collective #seq, named; at `step` (default: this rank's; a stuck rank names the one
        the waiting ranks are in, as it may be stuck between steps)."""
        where = f" of unit {unit!r}" if unit else ""
        step = self.step if step is None else step
        at = f" at step {step}" if step is not None else ""
        return f"collective #{seq} ({kind}{where}){at}"

    # -- the thread --------------------------------------------------------------------------------
    def start(self) -> "Watchdog":
        self._publish()
        self._thread.start()
        atexit.register(self._at_exit)
        return self

    def finish(self, error: BaseException | None = None) -> None:
        """At exit: say so (with this rank's own `error`), so the others do not take this end for a
        death; then let go of the store in the main thread, the thread stopped (a store client torn
        down by interpreter shutdown mid-call aborts: "terminate called without an active exception")."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.poll_s + 10)
        if error is not None and not peers_at_fault(error, self.rank):
            self.failed = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
        try:
            self._publish(done=True)
        except Exception:
            pass
        self.store = None

    def _at_exit(self) -> None:
        """A rank that an uncaught error ends leaves its records (`_failure.py`); one that failed
        because of peers on this machine then lingers until the launcher, which has seen them
        end, stops it: torchrun blames the peers, never this rank."""
        error = uncaught()
        peers = peers_at_fault(error, self.rank)
        if error is not None:  # first: the launcher may stop this rank any moment now (its 1 s ticks)
            record_exception(self.rank, error, peers)
        try:  # a peer that ended cleanly (done, not failed) is no culprit the launcher will stop us for
            beats = self.beats()
            near = peers and all(self._beside(r, beats) and (beats[r].get("failed") or not beats[r].get("done"))
                                 for r in peers)
        except Exception:
            near = False
        self.finish(error)
        if near:
            linger()

    def _beside(self, r: int, beats: dict[int, dict]) -> bool:
        return r in beats and beats[r].get("host") == _MACHINE

    def _publish(self, done: bool = False) -> None:
        b = self.blocked
        beat = {"t": time.time(), "issued": self.issued, "last": list(self.last), "step": self.step,
                "blocked": None if b is None else [b[0], b[1], b[2], b[3]], "pid": os.getpid(), "host": _MACHINE,
                "done": done, "failed": self.failed}
        self.store.set(f"{_KEY}/beat/{self.rank}", json.dumps(beat))

    def beats(self) -> dict[int, dict]:
        keys = [f"{_KEY}/beat/{r}" for r in range(self.world_size)]
        out, now = {}, time.time()
        for r, k in enumerate(keys):
            if self.store.check([k]):
                out[r] = json.loads(self.store.get(k))
                if r not in self._seen or self._seen[r][0] != out[r]["t"]:
                    self._seen[r] = (out[r]["t"], now)
        return out

    def verdict(self) -> str | None:
        """The verdict in force, if any rank has judged."""
        return self.verdict_ranks()[0]

    def verdict_ranks(self) -> tuple[str | None, list[int]]:
        """(the verdict in force or None, the ranks it names as stuck)."""
        k = f"{_KEY}/verdict"
        v = self.store.get(k).decode() if self.store.check([k]) else ""
        if not v:
            return None, []
        record = json.loads(v)
        return record["message"], [int(r) for r in record["ranks"]]

    def _run(self) -> None:
        failures = 0
        while not self._stop.wait(self.poll_s):
            if self._deadline is not None and time.monotonic() > self._deadline:
                self._exit(1)
                return
            try:
                self._publish()
                beats = self.beats()
                verdict = self.verdict()
                self._announce(verdict)
                if verdict is None:  # once judged, the rank named ends (or is ended): judge no more
                    self._judge(beats)
                self._bury(beats)
                failures = 0
            except Exception:  # a store hiccup: try again; gone for good (the job is ending): stop
                failures += 1
                if failures * self.poll_s > 60:
                    return

    def _announce(self, verdict: str | None) -> None:
        """Print a verdict once, as this rank's error: torchrun may stop this process before its
        main thread's collective fails and raises it."""
        if verdict and not self._announced:
            self._announced = True
            print(f"[rank {self.rank}] fnzero.DistributedError: {verdict[len(_PREFIX):]}", file=sys.stderr, flush=True)

    def dead(self, beats: dict[int, dict], stale_after: float | None = None) -> list[int]:
        """Ranks that are gone: a process on this host that no longer runs, or a heartbeat older than
        `stale_after` (default three periods, for right after a backend error; the watchdog itself
        waits the whole timeout: a main thread holding the GIL in C also silences a live rank)."""
        now = time.time()
        stale_after = 3 * self.poll_s + 1.0 if stale_after is None else stale_after
        return sorted(r for r, b in beats.items() if r != self.rank and not b.get("done") and (
            (b.get("host") == _MACHINE and not process_alive(b.get("pid"))) or self._age(r, now) > stale_after))

    def _age(self, r: int, now: float) -> float:
        """Seconds, on this host's clock, since rank r's heartbeat last changed (clocks of other
        hosts are never compared with this one's)."""
        seen = self._seen.get(r)
        return 0.0 if seen is None else now - seen[1]

    def _bury(self, beats: dict[int, dict]) -> None:
        """Blocked in a collective with a peer gone: gloo fails such a collective at once, but
        NCCL would wait for its timeout, so end the job now, naming the dead."""
        b = self.blocked
        dead = self.dead(beats, max(3 * self.poll_s + 1.0, self.timeout_s)) if b is not None and self.timeout_s > 0 else []
        if dead:
            now = time.time()
            last = "; ".join(f"rank {r} last at collective #{beats[r]['issued']} step {beats[r]['step']}, "
                             f"{now - beats[r]['t']:.0f}s ago" for r in dead)
            self._end(f"rank(s) {dead} stopped (killed, out of memory, or crashed) while rank {self.rank} waited in "
                      f"{self.describe(*b[:3])}: {last}", stuck=dead, beats=beats)

    def _since(self, table: dict[int, tuple[int, float]], r: int, key: int, now: float, holds: bool) -> float:
        """How long `holds` has been true for rank r with nothing changed (`key`), in seconds."""
        if not holds:
            table.pop(r, None)
            return 0.0
        if r not in table or table[r][0] != key:
            table[r] = (key, now)
        return now - table[r][1]

    def _judge(self, beats: dict[int, dict]) -> None:
        """Compare the ranks' counts of issued collectives. A count that stays below another's
        for the timeout is a stuck rank. (Counts, not only blocked waits: an NCCL wait does not
        block the host, so a waiting rank may never look blocked.)"""
        # Long: the two sides of one verdict (the stuck rank's own, and the others' after a grace),
        # each with the message it leaves; split, the rule that makes them agree would be in two places.
        if self.timeout_s <= 0:  # off (a config's watchdog.timeout_seconds: 0)
            return
        now, me = time.time(), self.issued
        others = {r: b for r, b in beats.items() if r != self.rank}
        ahead = {r: self._since(self._ahead, r, me, now, b["issued"] > me) for r, b in others.items()}
        behind = {r: self._since(self._behind, r, b["issued"], now, b["issued"] < me) for r, b in others.items()}
        # Am I the one the others wait for? (They issued collective #me+1 long ago; I have not.)
        late = sorted(r for r, t in ahead.items() if t > self.timeout_s)
        if late:
            seq = me + 1
            blocked = [b for b in others.values() if b.get("blocked") and b["blocked"][0] == seq]
            kind, unit, step = ((blocked[0]["blocked"][1], blocked[0]["blocked"][2], blocked[0]["step"]) if blocked
                                else ("a collective", "", None))
            self._end(
                f"rank {self.rank} did not reach {self.describe(seq, kind, unit, step)} within {self.timeout_s:g}s: "
                f"rank(s) {late} reached it. This rank's last collective was #{me} "
                f"({' of unit '.join(x for x in self.last if x) or 'none'}){f' at step {self.step}' if self.step else ''}."
                f"\nWhere this rank is:\n{self._main_stack()}",
                stuck=[self.rank], beats=beats,
            )
            return
        # The stuck rank had its chance to speak for itself (and two heartbeats to be heard).
        grace = self.timeout_s + 2 * self.poll_s + min(2.0, self.timeout_s)
        absent = {r: self._since(self._behind, r, -1, now, True) for r in set(range(self.world_size)) - set(beats)}
        missing = sorted(r for r, t in {**behind, **absent}.items() if t > grace)
        b = self.blocked
        if missing:
            seen = "; ".join(f"rank {r} last at collective #{beats[r]['issued']} ({beats[r]['last'][0] or 'none'}) "
                             f"step {beats[r]['step']}, {now - beats[r]['t']:.0f}s ago"
                             f"{' (it finished and exited)' if beats[r].get('done') else ''}" for r in missing if r in beats)
            where = self.describe(*b[:3]) if b is not None else self.describe(me, *self.last)
            self._end(f"rank(s) {missing} did not reach {where} within {self.timeout_s:g}s (rank {self.rank} is "
                      f"there). {seen}", stuck=missing, beats=beats)
        elif b is not None and now - b[3] > grace and all(x["issued"] >= b[0] for x in beats.values()):
            self._end(f"{self.describe(*b[:3])} did not complete within {self.timeout_s:g}s although every rank "
                      "reached it: the backend or a device is not answering", stuck=[], beats=beats)

    def _main_stack(self) -> str:
        frame = sys._current_frames().get(self._main.ident)
        return "".join(traceback.format_stack(frame)[-12:]) if frame is not None else "  (unknown)\n"

    def _record(self, message: str, stuck: list[int]) -> tuple[str, list[int]]:
        """Leave the verdict where the other ranks and the launcher find it and print it; the
        first verdict written wins. A stuck rank's verdict is also its error in torchrun's
        summary. Returns the verdict in force and the ranks it names."""
        full = _PREFIX + message
        try:
            self.store.compare_set(f"{_KEY}/verdict", "", json.dumps({"message": full, "ranks": stuck}))
            in_force = self.verdict_ranks()
            full, stuck = (in_force[0], in_force[1]) if in_force[0] else (full, stuck)
        except Exception:
            pass
        leave_record(self.rank, stuck, full, "verdict")
        if self.rank in stuck:  # read as a traceback: where it is, then what it did not do
            first = full.splitlines()[0]
            write_error_file(first, f"{self._main_stack()}{first}\n")
        self._announce(full)
        return full, stuck

    def _end(self, message: str, stuck: list[int], beats: dict[int, dict]) -> None:
        """Record the verdict, give the other watchdogs two heartbeats to print it, then end the
        stuck: this process if it is one, else theirs when all run here and none finished, this rank
        lingering until stopped, else itself (`specs/collectives.md` §Watchdog)."""
        _, stuck = self._record(message, stuck)
        time.sleep(2 * self.poll_s)
        if self.rank in stuck or not stuck or not all(self._beside(r, beats) and not beats[r].get("done") for r in stuck):
            self._exit(1)
            return
        for pid in [beats[r].get("pid") for r in stuck if process_alive(beats[r].get("pid"))]:
            with contextlib.suppress(OSError, TypeError):
                self._kill(pid)
        if self._deadline is None:
            self._deadline = time.monotonic() + LINGER_S + 5.0


class _Waiting:
    __slots__ = ("wd", "entry")

    def __init__(self, wd: Watchdog, seq: int, kind: str, unit: str):
        self.wd, self.entry = wd, (seq, kind, unit, time.time())

    def __enter__(self):
        self.wd.blocked = self.entry

    def __exit__(self, *exc):
        self.wd.blocked = None


# The watchdog of this process's default group, written only by `start_watchdog` (`specs/architecture.md`).
_PROCESS: list[Watchdog] = []


def process_watchdog() -> Watchdog | None:
    return _PROCESS[0] if _PROCESS else None


def start_watchdog(rank: int, world_size: int, timeout_s: float, group_timeout_s: float) -> Watchdog | None:
    """Start this process's watchdog on its own connection to the job's store (MASTER_ADDR and
    MASTER_PORT); None without one, or with `timeout_s` <= 0 (off). It judges within half of
    `group_timeout_s` whatever `timeout_s` asks. A second call sets the running one's timeout."""
    import datetime

    import torch.distributed as dist

    if _PROCESS:
        _PROCESS[0].limit_s = group_timeout_s / 2
        _PROCESS[0].set_timeout(timeout_s)
        return _PROCESS[0]
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if world_size < 2 or not addr or not port or timeout_s <= 0:
        return None
    store = dist.TCPStore(addr, int(port), world_size, is_master=False, timeout=datetime.timedelta(seconds=10))
    _PROCESS.append(Watchdog(store, rank, world_size, timeout_s, limit_s=group_timeout_s / 2).start())
    return _PROCESS[0]
