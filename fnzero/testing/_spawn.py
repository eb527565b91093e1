"""Real multi-process worlds on loopback for tests: a free port, a hard timeout, and a clear error
naming the rank that failed, never a hang."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue as queue_mod
import time
import traceback
from typing import Any, Callable

import optree
import torch

from .._errors import DistributedError
from ..sharding import free_port
from ._threads import World, wants_comm

__all__ = ["run_world", "free_port", "WorldError", "SpawnedWorld", "spawned_world"]


class WorldError(DistributedError):
    """A rank of a spawned world raised, died, or did not finish before the timeout."""


# Results cross the process boundary as plain bytes: tensors of any dtype (bf16 included) survive.
def _encode(obj: Any) -> Any:
    def enc(x):
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            return ("__tensor__", str(t.dtype).removeprefix("torch."), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return x

    return optree.tree_map(enc, obj, is_leaf=lambda x: isinstance(x, torch.Tensor), none_is_leaf=True)


def _decode(obj: Any) -> Any:
    def is_enc(x):
        return isinstance(x, tuple) and len(x) == 4 and x[0] == "__tensor__"

    def dec(x):
        if is_enc(x):
            _, dtype, shape, raw = x
            dt = getattr(torch, dtype)
            if not raw:
                return torch.empty(shape, dtype=dt)
            return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dt).reshape(shape)
        return x

    return optree.tree_map(dec, obj, is_leaf=is_enc, none_is_leaf=True)


def _child(fn, rank, world_size, port, backend, timeout_s, env, q, args, kwargs):
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    try:
        import torch.distributed as dist

        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
        try:
            result = fn(*args, **kwargs)
        finally:
            dist.destroy_process_group()
        q.put(("ok", rank, _encode(result)))
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        q.put(("err", rank, traceback.format_exc()))
        q.close()
        q.join_thread()  # the queue's feeder thread must deliver before the hard exit
        os._exit(1)


# Ranks fork from a server that imported torch and fnzero once (`specs/testing.md` §Worlds); a
# world needing another environment than the server's, kept here, is spawned fresh.
_PRELOAD = ["torch", "torch.distributed", "fnzero", "fnzero.testing", "pytest"]
_SERVER_ENV: dict[str, str] | None = None
# Set per test by pytest and read by nothing at import: a change of it keeps the fork server.
_IMPORT_IRRELEVANT = frozenset({"PYTEST_CURRENT_TEST"})


def _rank_context(env: dict[str, str] | None) -> tuple[Any, dict[str, str]]:
    """The multiprocessing context for a world's ranks, and the environment to apply in each rank
    on top of the one it starts with (`env`, plus what changed since the fork server started)."""
    global _SERVER_ENV
    env = dict(env or {})
    if env or os.environ.get("FNZERO_SPAWN_RANKS") == "1" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn"), env
    ctx = mp.get_context("forkserver")
    if _SERVER_ENV is None:
        ctx.set_forkserver_preload(_PRELOAD)
        _SERVER_ENV = dict(os.environ)
    changed = {k for k in set(os.environ) | set(_SERVER_ENV) if os.environ.get(k) != _SERVER_ENV.get(k)}
    if changed - _IMPORT_IRRELEVANT:
        return mp.get_context("spawn"), env
    return ctx, {k: os.environ[k] for k in changed if k in os.environ}


def run_world(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 180.0,
    backend: str = "gloo",
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run `fn(*args, **kwargs)` (importable) on `world_size` spawned ranks with torch.distributed
    initialised (gloo on 127.0.0.1) and return each rank's result, in rank order. A rank that raises
    or dies, or a world past `timeout` seconds, stops every rank with a WorldError naming them."""
    ctx, env = _rank_context(env)
    q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, r, world_size, port, backend, max(5.0, timeout), dict(env or {}), q, args, kwargs),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    ranks = _Ranks(procs, q, world_size)
    deadline = time.monotonic() + timeout
    try:
        ranks.collect(deadline, timeout)
    finally:
        ranks.stop()
    if ranks.failure is not None:
        raise WorldError(ranks.failure)
    return [ranks.results[r] for r in range(world_size)]


class _Ranks:
    """The processes of one `run_world`, the queue their messages arrive on, and what arrived: each
    rank's result, or the first failure (`failure`), after which the others are stopped."""

    def __init__(self, procs: list, q, world_size: int):
        self.procs, self.q, self.world_size = procs, q, world_size
        self.results: dict[int, Any] = {}
        self.failure: str | None = None

    def collect(self, deadline: float, timeout: float) -> None:
        """Every rank's result, until one raises or dies or `deadline` passes."""
        while len(self.results) < self.world_size and self.failure is None:
            message = self._next(deadline, timeout)
            if message is None:
                continue
            status, rank, payload = message
            if status == "ok":
                self.results[rank] = _decode(payload)
            else:
                self.failure = f"rank {rank} raised:\n{payload}"
                self.failure += self._then_raised()

    def _next(self, deadline: float, timeout: float):
        """The next message, or None: none yet, or (with `failure` set) a rank died without one or
        the world is late."""
        try:
            return self.q.get(timeout=0.2)
        except queue_mod.Empty:
            pass
        dead = [r for r, p in enumerate(self.procs) if p.exitcode not in (None, 0) and r not in self.results]
        if dead:
            # Give its message a moment to arrive before reporting a silent death.
            try:
                return self.q.get(timeout=2.0)
            except queue_mod.Empty:
                self.failure = f"rank {dead[0]} died with exit code {self.procs[dead[0]].exitcode} and no message"
        elif time.monotonic() > deadline:
            late = [r for r in range(self.world_size) if r not in self.results]
            self.failure = f"world of {self.world_size} did not finish within {timeout:.0f}s; ranks still running: {late}"
        return None

    def _then_raised(self) -> str:
        # Other ranks usually fail as a consequence (a broken connection); collect them
        # briefly so the report shows the first failure and what followed.
        out = ""
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            try:
                st2, r2, p2 = self.q.get(timeout=0.2)
            except queue_mod.Empty:
                continue
            if st2 == "err":
                out += f"\n(then rank {r2} raised:)\n{p2}"
        return out

    def stop(self) -> None:
        """After a failure the ranks still running are killed; every rank is joined (killed if it
        lingers), and the queue closed."""
        if self.failure is not None:
            for p in self.procs:
                if p.is_alive():
                    p.kill()
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        self.q.close()


def _call_in_rank(fn: Callable[..., Any]) -> Any:
    # Runs in the spawned rank: give `fn` the process group's collectives when it takes one
    # argument, exactly as SimulatedWorld.run does with its thread collectives.
    from ..sharding import ProcessGroupCollectives

    return fn(ProcessGroupCollectives()) if wants_comm(fn) else fn()


class SpawnedWorld(World):
    """n real gloo processes on loopback behind the SimulatedWorld interface (`specs/testing.md`
    §Worlds); `fn` must be importable. A run costs seconds: `simulated_world` suits most tests."""

    backend = "gloo"

    def __init__(self, n: int, timeout: float = 180.0, backend: str = "gloo", env: dict[str, str] | None = None):
        super().__init__(n, timeout)
        self.backend, self.env = backend, env

    def run(self, fn: Callable[..., Any]) -> list[Any]:
        return run_world(_call_in_rank, self.n, fn, timeout=self.timeout, backend=self.backend, env=self.env)


def spawned_world(n: int, timeout: float = 180.0, backend: str = "gloo", env: dict[str, str] | None = None) -> SpawnedWorld:
    """A SpawnedWorld of n real processes (usable as a context manager)."""
    return SpawnedWorld(n, timeout, backend, env)
