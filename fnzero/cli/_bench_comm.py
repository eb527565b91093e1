"""`fnzero bench comm`: collective bandwidth per size over the job's backend, as DeepSpeed's
`ds_bench` (`specs/cli.md` §fnzero bench comm). Every rank runs the same loop through fnzero's own
`Collectives` (what training uses: gloo's direct exchanges, NCCL); rank 0 prints."""

from __future__ import annotations

import argparse
import json
import os
import sys

from ._common import fail

__all__ = ["add_parser", "OPS"]

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "pt2pt")
_FORMULA = {"all_reduce": "2(n-1)/n", "all_gather": "(n-1)/n", "reduce_scatter": "(n-1)/n",
            "all_to_all": "(n-1)/n", "broadcast": "1", "pt2pt": "1"}


def add_parser(bench_sub) -> None:
    p = bench_sub.add_parser(
        "comm", help="collective bandwidth per message size (ds_bench)",
        description="Time each collective at each size on every rank of the job (under `fnzero launch` or any "
        "launcher that sets RANK/WORLD_SIZE, or --world N for a local gloo world) and print, on rank 0, the "
        "time per call, algorithmic and bus bandwidth, and the bytes each rank sends by the formula.")
    p.add_argument("--ops", default="all", help=f"comma-separated, or all (default): {','.join(OPS)}")
    for op in ("all_reduce", "all_gather", "all_to_all", "pt2pt", "broadcast"):  # ds_bench's own switches
        p.add_argument(f"--{op.replace('_', '-')}", dest=f"op_{op}", action="store_true",
                       help=f"run {op} (ds_bench's spelling; with any of these, only those given, plus --ops')")
    p.add_argument("--sizes", default=None, metavar="SIZE[,SIZE...]",
                   help="message sizes (the whole buffer: 4KiB, 1MiB, 1e6; default 1MiB)")
    p.add_argument("--scan", action="store_true", help="sizes 2^10 .. 2^MAXSIZE bytes, doubling")
    p.add_argument("--maxsize", type=int, default=24, help="largest size of --scan as a power of 2 (default 24)")
    p.add_argument("--trials", type=int, default=20, help="timed calls per size (default 20)")
    p.add_argument("--warmups", type=int, default=5, help="untimed calls first (default 5)")
    p.add_argument("--dtype", default="float32", help="element type (default float32)")
    p.add_argument("--bw-unit", "--bw_unit", choices=("Gbps", "GBps"), default="Gbps", help="bandwidth unit")
    p.add_argument("--world", type=int, default=None, metavar="N",
                   help="start N local ranks (gloo, torchrun) to run on, when not already under a launcher")
    p.add_argument("--json", action="store_true", help="rank 0 prints the rows as JSON instead")
    p.add_argument("--raw", action="store_true", help="durations in microseconds without the unit (ds_bench's)")
    p.set_defaults(func=_run)


def _choices(args) -> tuple[list[str], list[int], object] | str:
    """The ops, sizes and dtype asked for, or a one-line complaint."""
    import torch

    from ..memory import parse_bytes

    switched = [o for o in OPS if getattr(args, f"op_{o}", False)]
    ops = list(OPS) if args.ops.strip() == "all" else [o.strip() for o in args.ops.split(",") if o.strip()]
    if switched:  # as ds_bench: the ops named by switches, and those --ops names beside them
        ops = switched + ([o for o in ops if o not in switched] if args.ops.strip() != "all" else [])
    bad = [o for o in ops if o not in OPS]
    if bad or not ops:
        return f"--ops: unknown collective {bad[0] if bad else args.ops!r}; choose from {', '.join(OPS)} or all"
    if args.scan and args.sizes:
        return "--scan and --sizes do not mix"
    if args.scan:
        if not 10 <= args.maxsize <= 40:
            return f"--maxsize {args.maxsize}: a power of two between 10 and 40"
        sizes = [1 << p for p in range(10, args.maxsize + 1)]
    else:
        try:
            sizes = [parse_bytes(s.strip()) for s in (args.sizes or "1MiB").split(",") if s.strip()]
        except ValueError as e:
            return f"--sizes: {e}"
    if args.trials < 1 or args.warmups < 0:
        return f"--trials must be at least 1 and --warmups at least 0 (got {args.trials}, {args.warmups})"
    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        return f"--dtype {args.dtype!r} is not a torch dtype (float32, bfloat16, float16, float64, ...)"
    return ops, sizes, dtype


def _run(args: argparse.Namespace) -> int:
    chosen = _choices(args)
    if isinstance(chosen, str):
        return fail("bench comm", chosen)
    under_launcher = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if args.world is not None and not under_launcher:
        if args.world < 1:
            return fail("bench comm", f"--world {args.world}: at least 1 rank")
        return _spawn(args.world, args, chosen)
    return _bench(args, *chosen)


def _spawn(world: int, args, chosen) -> int:
    """This benchmark on `world` local gloo ranks, forked from this process (torch is imported
    once, not once per rank); the first rank to fail ends the others. Without fork (not Linux or
    macOS), torchrun starts them, as `ds_bench` restarts itself under `deepspeed`."""
    import traceback

    import torch

    from ..sharding import free_port

    if not hasattr(os, "fork"):
        return _torchrun(world)
    from .. import sharding  # noqa: F401  (its collectives imported once, before the ranks fork)

    port = str(free_port())
    pids = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:  # a rank: run, and leave without running the parent's exit handlers
            code = 1
            try:
                os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                                  LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
                # One intra-op thread, as torchrun gives its workers; also, an OpenMP pool the parent
                # used does not survive fork (the reason torch's DataLoader workers do the same).
                torch.set_num_threads(1)
                code = _bench(args, *chosen)
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    return _wait_ranks(pids)


def _wait_ranks(pids: list[int]) -> int:
    """Every rank's end; when one fails the others are stopped (a peer of a dead rank would wait in
    its collective until the timeout). The first failure's status."""
    import signal
    import time

    codes: dict[int, int] = {}
    stopping = False
    while len(codes) < len(pids):
        for rank, pid in enumerate(pids):
            if rank not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done == pid:
                    codes[rank] = os.waitstatus_to_exitcode(status)
        if not stopping and any(codes.values()):
            stopping = True
            for rank, pid in enumerate(pids):
                if rank not in codes:
                    os.kill(pid, signal.SIGTERM)
        time.sleep(0.02)
    bad = [(r, c) for r, c in codes.items() if c]
    if bad:
        print(f"fnzero bench comm: rank {bad[0][0]} exited with status {bad[0][1]}", file=sys.stderr)
        return bad[0][1] if bad[0][1] > 0 else 1
    return 0


def _torchrun(world: int) -> int:
    """This same command (less --world) on `world` ranks started by torchrun."""
    from ..sharding import free_port
    from .launch import run_torchrun

    given = sys.argv[1:]
    world_at = {i for i, a in enumerate(given) if a == "--world"}  # argparse took the word after as its value
    argv = [a for i, a in enumerate(given)
            if i not in world_at and i - 1 not in world_at and not a.startswith("--world=")]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return run_torchrun(["--nproc-per-node", str(world), "--nnodes", "1", "--master-addr", "127.0.0.1",
                          "--master-port", str(free_port()), "--monitor-interval", "1", "-m", "fnzero.cli", *argv])


def _bench(args, ops, sizes, dtype) -> int:
    import torch

    import fnzero
    from ..sharding import default_collectives

    info = fnzero.init_distributed()
    comm = default_collectives()
    n, device = comm.world_size, info.device
    if "pt2pt" in ops and n < 2:
        ops = [o for o in ops if o != "pt2pt"]
    rows = []
    for op in ops:
        for size in sizes:
            rows.append(_measure(comm, op, size, dtype, device, args.trials, args.warmups))
    if comm.rank == 0:
        if args.json:
            print(json.dumps(rows, indent=1))
        else:
            _print(rows, n, info.backend or "one process, no backend", dtype, args)
    comm.barrier()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


def _buffers(op: str, size: int, dtype, device, n: int):
    """The input of one call: the whole buffer is about `size` bytes, rounded down to whole
    elements that split evenly over the ranks (and at least one per rank)."""
    import torch

    elem = torch.empty((), dtype=dtype).element_size()
    numel = max(n, size // elem // n * n)
    full = torch.ones(numel, dtype=dtype, device=device)
    return (full[: numel // n].clone() if op == "all_gather" else full), numel, elem


def _call(comm, op: str, t):
    if op == "all_reduce":
        return comm.all_reduce(t)
    if op == "all_gather":
        return comm.all_gather(t)
    if op == "reduce_scatter":
        return comm.reduce_scatter(t)
    if op == "all_to_all":
        return comm.all_to_all(t)
    if op == "broadcast":
        return comm.broadcast(t, 0)
    if comm.rank == 0:  # pt2pt: rank 0 sends to rank 1, as ds_bench's pt2pt
        return comm.send_async(t, 1).wait()
    if comm.rank == 1:
        return comm.recv(t.new_empty(t.shape), 0)
    return None


def _measure(comm, op: str, size: int, dtype, device, trials: int, warmups: int) -> dict:
    """One row: the slowest rank's average seconds per call (a collective ends for all when it
    ends for the last), and the bandwidths of that time."""
    import time

    import torch

    from ..sharding import bus_factor

    t, numel, elem = _buffers(op, size, dtype, device, comm.world_size)
    for _ in range(warmups):
        _call(comm, op, t)
    _sync(device)
    comm.barrier()
    t0 = time.perf_counter()
    for _ in range(trials):
        _call(comm, op, t)
    _sync(device)
    mine = (time.perf_counter() - t0) / trials
    seconds = float(comm.all_reduce(torch.tensor([mine], dtype=torch.float64, device=device), "max").item())
    n = comm.world_size
    # The whole buffer's bus factor; the all-to-all one is (n-1)/n of it (each rank keeps its own chunk).
    factor = (n - 1) / n if op == "all_to_all" else bus_factor(op, n if op != "pt2pt" else 2)
    nbytes = numel * elem
    return {"op": op, "size": nbytes, "numel": numel, "element_size": elem, "seconds": seconds,
            "algbw": nbytes / seconds, "busbw": nbytes * factor / seconds, "bytes_per_rank": nbytes * factor,
            "formula": f"{_FORMULA[op]} x size"}


def _sync(device) -> None:
    import torch

    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _duration(s: float, raw: bool) -> str:
    """ds_bench's: µs below a millisecond, else ms; with --raw always µs, without the unit."""
    return f"{s * 1e6:.3f}" if raw else f"{s * 1e6:.3f} us" if s < 1e-3 else f"{s * 1e3:.3f} ms"


def _print(rows: list[dict], n: int, backend: str, dtype, args) -> None:
    scale = 8e-9 if args.bw_unit == "Gbps" else 1e-9
    op = None
    for r in rows:
        if r["op"] != op:
            op = r["op"]
            ranks = 2 if op == "pt2pt" else n
            print(f"\n---- Performance of {op} on {ranks} ranks ({backend}, {str(dtype).replace('torch.', '')}, "
                  f"{args.trials} trials); bytes sent per rank = {r['formula']} ----")
            print(f"{'Size (Bytes)':<14}{'Description':<20}{'Duration (us)' if args.raw else 'Duration':<14}{'Throughput (' + args.bw_unit + ')':<20}"
                  f"{'BusBW (' + args.bw_unit + ')':<18}{'Bytes/rank':<14}")
        print(f"{r['size']:<14}{str(r['numel']) + 'x' + str(r['element_size']):<20}{_duration(r['seconds'], args.raw):<14}"
              f"{r['algbw'] * scale:<20.3f}{r['busbw'] * scale:<18.3f}{r['bytes_per_rank']:<14.0f}")
