"""`fnzero bench io` and `fnzero nvme-tune`: the AIO micro-benchmark over fnzero's I/O engine
(`fnzero/_ext/_aio.py`, what NVMe offload uses) and a sweep of the `aio` block that keeps the
fastest values, as DeepSpeed's `ds_io` and `ds_nvme_tune` (`specs/cli.md` §fnzero bench io, which
says what is timed)."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time

from ._common import fail, whole_numbers

__all__ = ["add_io_parser", "register", "measure_io"]


def _size(text: str) -> int:
    """ds_io's `4M`, `128K`, `1G` (one letter: powers of 1024, as its refine_integer_value), else
    fnzero's sizes (`parse_bytes`: KB/MB powers of 1000, KiB/MiB of 1024)."""
    from ..memory import parse_bytes

    if len(text) > 1 and text[-1] in "KMG" and text[:-1].isdigit():
        return int(text[:-1]) * 1024 ** ("KMG".index(text[-1]) + 1)
    return parse_bytes(text)


def _sizes(text: str, what: str) -> list[int]:
    try:
        out = [_size(t.strip()) for t in text.split(",") if t.strip()]
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
    if not out:
        raise ValueError(f"{what}: give at least one size")
    return out


def _ints(text: str, what: str) -> list[int]:
    try:
        return whole_numbers(text, "each value must be at least 1")
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None


def measure_io(folder: str, io_size: int, block_size: int, queue_depth: int, threads: int, loops: int = 1,
               ops: tuple[str, ...] = ("write", "read")) -> dict:
    """GB/s (1e9 bytes per second, the best of `loops`) of writing then reading one file of
    `io_size` bytes in `folder` with an `AioEngine(block_size, queue_depth, threads)`; the file is
    removed after."""
    import torch

    from .._ext import AioHandle, aligned_empty

    size = -(-io_size // 4096) * 4096  # O_DIRECT moves whole 4 KiB pages
    buf = aligned_empty(size, torch.uint8)
    buf.fill_(0x5A)
    path = os.path.join(folder, f"fnzero-bench-io-{os.getpid()}.bin")
    out: dict = {"io_size": size, "block_size": block_size, "queue_depth": queue_depth, "threads": threads}
    try:
        with AioHandle(path, "w", size=size, block_size=block_size, queue_depth=queue_depth,
                       thread_count=threads) as h:
            out["direct"], out["native"] = h.direct, h.engine.native
            for op in ("write", "read"):
                if op not in ops and not (op == "write" and "read" in ops):
                    continue  # a read needs the file written first, timed or not
                best = 0.0
                for _ in range(loops if op in ops else 1):
                    t0 = time.perf_counter()
                    (h.submit_write if op == "write" else h.submit_read)(buf, 0).wait()
                    if op == "write":
                        h.sync()
                    best = max(best, size / (time.perf_counter() - t0) / 1e9)
                if op in ops:
                    out[op] = best
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    return out


def add_io_parser(bench_sub) -> None:
    p = bench_sub.add_parser("io", help="AIO read/write throughput of fnzero's NVMe engine (ds_io)",
                             description="Write, then read, one file through fnzero's AIO engine and print GB/s.")
    p.add_argument("--folder", default=None, help="where the file goes (default: the temporary directory)")
    p.add_argument("--io-size", "--io_size", default="64MiB", help="bytes per transfer (default 64MiB)")
    p.add_argument("--block-size", "--block_size", default="1MiB", help="bytes per I/O request (default 1MiB)")
    p.add_argument("--queue-depth", "--queue_depth", default="8", help="requests in flight per thread (default 8)")
    p.add_argument("--threads", "--intra-op-parallelism", "--io_parallel", default="1",
                   help="I/O threads (the aio block's intra_op_parallelism; default 1)")
    p.add_argument("--loops", type=int, default=3, help="repetitions; the best is reported (default 3)")
    io = p.add_mutually_exclusive_group()
    io.add_argument("--read", action="store_true", help="time reads only (the file is written first, untimed)")
    io.add_argument("--write", action="store_true", help="time writes only")
    p.add_argument("--json", action="store_true", help="the result as JSON")
    p.set_defaults(func=_run_io)


def _folder(path: str | None, prog: str) -> str | None:
    folder = path or tempfile.gettempdir()
    try:  # a file made and removed: os.access says yes to root even where nothing can be made (/proc)
        with tempfile.TemporaryFile(dir=folder, prefix="fnzero-bench-io-probe"):
            pass
    except OSError:
        print(f"fnzero {prog}: {folder} is not a writable directory", file=sys.stderr)
        return None
    return folder


def _run_io(args: argparse.Namespace) -> int:
    folder = _folder(args.folder, "bench io")
    if folder is None:
        return 2
    try:
        (size,), (bs,) = _sizes(args.io_size, "--io-size"), _sizes(args.block_size, "--block-size")
        (qd,), (threads,) = _ints(args.queue_depth, "--queue-depth"), _ints(args.threads, "--threads")
        if args.loops < 1:
            raise ValueError(f"--loops {args.loops}: at least 1")
    except ValueError as e:
        return fail("bench io", str(e))
    ops = ("read",) if args.read else ("write",) if args.write else ("write", "read")
    try:
        r = measure_io(folder, size, bs, qd, threads, args.loops, ops)
    except OSError as e:
        return fail("bench io", f"{folder}: {e}", 1)
    if args.json:
        print(json.dumps(r))
        return 0
    mode = ("O_DIRECT" if r["direct"] else "buffered") + ("" if r["native"] else ", no C extension: synchronous")
    print(f"{folder}: {r['io_size']} bytes, block {bs}, queue depth {qd}, threads {threads} ({mode})")
    for op in ops:
        print(f"E2E {op.capitalize()} Speed = {r[op]:.3f} GB/sec (best of {args.loops})")
    return 0


def register(sub) -> None:
    p = sub.add_parser("nvme-tune", help="sweep the aio block on an NVMe folder and keep the fastest (ds_nvme_tune)",
                       description="Time writes and reads for every combination of the aio block's block_size, "
                       "queue_depth and intra_op_parallelism, print the table and the best block (most read + "
                       "write GB/s) as JSON.")
    p.add_argument("--nvme_dir", "--nvme-dir", required=True, nargs="+", help="a folder on the device to tune")
    p.add_argument("--sweep_config", "--sweep-config", default=None, metavar="FILE",
                   help="ds_nvme_tune's sweep JSON (block_size, queue_depth, io_parallel lists) instead of the flags")
    p.add_argument("--no_read", "--no-read", action="store_true", help="time writes only")
    p.add_argument("--no_write", "--no-write", action="store_true", help="time reads only (the file is still written)")
    p.add_argument("--no_sudo", "--no-sudo", action="store_true",
                   help="accepted: fnzero never flushes the page cache with sudo (it reads with O_DIRECT)")
    p.add_argument("--io_size", "--io-size", default="64MiB", help="bytes per transfer (default 64MiB)")
    p.add_argument("--block_sizes", "--block-sizes", default="128KiB,1MiB,8MiB", help="block sizes to try")
    p.add_argument("--queue_depths", "--queue-depths", default="8,32,128", help="queue depths to try")
    p.add_argument("--intra_op_parallelism", "--threads", default="1,2,4", help="I/O thread counts to try")
    p.add_argument("--loops", type=int, default=1, help="repetitions per combination; the best counts (default 1)")
    p.add_argument("--output", "-o", default=None, metavar="FILE", help='also write {"aio": {...}} to FILE')
    p.set_defaults(func=_run_tune)


# ds_nvme_tune's sweep keys fnzero's engine has no choice for: it always submits a batch and
# overlaps completions (single_submit false, overlap_events true; sequential_requests is their inverse).
_FIXED_SWEEP_KEYS = {"single_submit": False, "sequential_requests": False, "overlap_events": True}


def _sweep_lists(args) -> tuple[str, str, str]:
    """The block sizes, queue depths and thread counts to sweep, as comma-separated text: the
    flags', or `--sweep_config`'s lists (ds_nvme_tune's keys; io_parallel or intra_op_parallelism)."""
    if not args.sweep_config:
        return args.block_sizes, args.queue_depths, args.intra_op_parallelism
    try:
        with open(args.sweep_config) as f:
            sweep = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--sweep_config {args.sweep_config}: {getattr(e, 'strerror', None) or e}") from None
    known = {"block_size", "queue_depth", "io_parallel", "intra_op_parallelism", *_FIXED_SWEEP_KEYS}
    if not isinstance(sweep, dict) or set(sweep) - known:
        raise ValueError(f"--sweep_config {args.sweep_config}: expected an object of lists with keys among "
                         f"{', '.join(sorted(known))}" + (f"; not {sorted(set(sweep) - known)}"
                                                          if isinstance(sweep, dict) else ""))
    for key, fixed in _FIXED_SWEEP_KEYS.items():
        if any(v != fixed for v in (sweep[key] if isinstance(sweep.get(key), list) else [sweep.get(key, fixed)])):
            print(f"fnzero nvme-tune: warning: --sweep_config {key} other than {str(fixed).lower()} has no effect: "
                  "fnzero's engine always submits a batch and overlaps completions", file=sys.stderr)

    def text(key, default):
        values = sweep.get(key, default)
        return ",".join(map(str, values if isinstance(values, list) else [values]))

    threads = text("io_parallel", None) if "io_parallel" in sweep else text("intra_op_parallelism", [1])
    return text("block_size", ["1M"]), text("queue_depth", [8]), threads


def _run_tune(args: argparse.Namespace) -> int:
    if len(args.nvme_dir) > 1:
        return fail("nvme-tune", "--nvme_dir: give one folder; fnzero's NVMe offload writes to one (its nvme_path), "
                    "not striped over several")
    nvme_dir = args.nvme_dir[0]
    if not os.path.isdir(nvme_dir):
        return fail("nvme-tune", f"--nvme_dir {nvme_dir}: no such directory")
    folder = _folder(nvme_dir, "nvme-tune")
    if folder is None:
        return 2
    try:
        (size,) = _sizes(args.io_size, "--io_size")
        block_sizes, queue_depths, threads = _sweep_lists(args)
        grid = list(itertools.product(_sizes(block_sizes, "block sizes"), _ints(queue_depths, "queue depths"),
                                      _ints(threads, "thread counts")))
        if args.loops < 1:
            raise ValueError(f"--loops {args.loops}: at least 1")
        if args.no_read and args.no_write:
            raise ValueError("--no_read and --no_write leave nothing to time")
    except ValueError as e:
        return fail("nvme-tune", str(e))
    ops = tuple(op for op, off in (("write", args.no_write), ("read", args.no_read)) if not off)
    print(f"Running fnzero AIO tuning on {folder}: {len(grid)} combinations of {size} bytes", flush=True)
    print(f"{'block_size':>12}{'queue_depth':>13}{'threads':>9}{'write GB/s':>12}{'read GB/s':>12}")
    rows = []
    for bs, qd, threads in grid:
        try:
            r = measure_io(folder, size, bs, qd, threads, args.loops, ops)
        except OSError as e:
            return fail("nvme-tune", f"block_size {bs}, queue_depth {qd}, threads {threads}: {e}", 1)
        rows.append(r)
        print(f"{bs:>12}{qd:>13}{threads:>9}" + "".join(f"{r[op]:>12.3f}" if op in r else f"{'-':>12}"
                                                         for op in ("write", "read")), flush=True)
    best = max(rows, key=lambda r: r.get("read", 0.0) + r.get("write", 0.0))
    # single_submit and overlap_events are written as fnzero behaves (batched submission,
    # overlapped completion): they select nothing in its engine, so there is nothing to sweep.
    block = {"aio": {"block_size": best["block_size"], "queue_depth": best["queue_depth"],
                     "intra_op_parallelism": best["threads"], "single_submit": False, "overlap_events": True}}
    print("Best performance (GB/sec): " + ", ".join(f"{op} = {best[op]:5.2f}" for op in ("read", "write") if op in best)
          + ("" if best["direct"] else " (buffered: O_DIRECT is not available here)"))
    text = json.dumps(block, indent=3)
    print(text)
    if args.output:
        try:
            with open(args.output, "w") as f:
                f.write(text + "\n")
        except OSError as e:
            return fail("nvme-tune", f"cannot write {args.output}: {e.strerror}", 1)
    return 0
