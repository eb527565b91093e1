"""Sequential write then read of one file through fnzero's AioHandle, against fio and dd.

Default: 2 GiB at 1 MiB blocks, queue depth 8, one thread, O_DIRECT where the file system
allows it, file preallocated (as offload swap files are). fio (libaio, direct, iodepth 8) runs in
the same invocation when installed, dd (oflag/iflag=direct, bs=1M) always. Reads are O_DIRECT,
so the page cache does not flatter them; buffered fallbacks say so.

A shared virtual disk moves by 2x between runs minutes apart, so fnzero and fio alternate for
`--rounds` rounds (who goes first alternates too); the ratio reported is the median of the
per-round ratios, each from two runs seconds apart, beside every round's figures.

Usage: python benchmarks/bench_aio.py [--size 2G] [--dir /tmp] [--block-size 1M] [--queue-depth 8] [--threads 1] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time


def parse_size(s: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMG]?)i?B?", s.strip(), re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {s!r}")
    return int(float(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2).upper()])


def drop_file(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def fnzero_run(path: str, size: int, bs: int, qd: int, threads: int) -> dict:
    import torch

    from fnzero import _ext

    chunk = 64 << 20  # the offload engine moves buffers of this order; several in flight
    buf = _ext.aligned_empty(chunk, torch.uint8)
    buf.fill_(7)
    out = {"native": _ext.available()}
    drop_file(path)
    with _ext.AioHandle(path, "w", block_size=bs, queue_depth=qd, thread_count=threads, size=size) as h:
        out["direct"] = h.direct
        t0 = time.perf_counter()
        reqs = [h.submit_write(buf[: min(chunk, size - off)], off) for off in range(0, size, chunk)]
        for r in reqs:
            r.wait()
        h.sync()
        out["write"] = size / (time.perf_counter() - t0)
        # Two buffers, the next chunk's read in flight while one completes: how the NVMe store
        # streams its sub-groups, and what keeps the queue full across chunk boundaries.
        bufs = (buf, _ext.aligned_empty(chunk, torch.uint8))
        t0 = time.perf_counter()
        pending = None
        for i, off in enumerate(range(0, size, chunk)):
            req = h.submit_read(bufs[i % 2][: min(chunk, size - off)], off)
            if pending is not None:
                pending.wait()
            pending = req
        pending.wait()
        out["read"] = size / (time.perf_counter() - t0)
    return out


def fio_run(path: str, size: int, bs: int, qd: int) -> dict | None:
    if not shutil.which("fio"):
        return None
    out = {}
    for rw in ("write", "read"):
        cmd = ["fio", "--name=seq", f"--filename={path}", f"--rw={rw}", f"--bs={bs}", f"--size={size}", "--direct=1",
               "--ioengine=libaio", f"--iodepth={qd}", "--numjobs=1", "--end_fsync=1", "--output-format=json"]  # fmt: skip
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            return {"error": r.stderr.strip()[-200:]}
        job = json.loads(r.stdout)["jobs"][0][rw]
        out[rw] = job["bw_bytes"]
    return out


def dd_run(path: str, size: int, bs: int) -> dict:
    out = {}
    count = size // bs
    for rw, args in (("write", ["if=/dev/zero", f"of={path}", "oflag=direct", "conv=fdatasync"]),
                     ("read", [f"if={path}", "of=/dev/null", "iflag=direct"])):  # fmt: skip
        t0 = time.perf_counter()
        r = subprocess.run(["dd", f"bs={bs}", f"count={count}", *args], capture_output=True, text=True)
        dt = time.perf_counter() - t0
        out[rw] = size / dt if r.returncode == 0 else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=parse_size, default=2 << 30)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--block-size", type=parse_size, default=1 << 20)
    ap.add_argument("--queue-depth", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    path = os.path.join(a.dir, f"fnzero-bench-aio-{os.getpid()}.bin")
    gib = 1 << 30
    print(f"file {path}: {a.size / gib:.2f} GiB, block {a.block_size >> 10} KiB, queue depth {a.queue_depth}, "
          f"threads {a.threads}; {os.uname().release}")  # fmt: skip
    rounds: list[dict] = []
    try:
        for k in range(a.rounds):
            res: dict = {}
            order = ("fnzero", "fio") if k % 2 == 0 else ("fio", "fnzero")
            for who in order:
                drop_file(path)
                if who == "fnzero":
                    res["fnzero AioHandle"] = fnzero_run(path, a.size, a.block_size, a.queue_depth, a.threads)
                    continue
                fio = fio_run(path, a.size, a.block_size, a.queue_depth)
                if fio is None:
                    if k == 0:
                        print("fio: not installed (apt-get install fio), skipped")
                elif "error" in fio:
                    print(f"fio: failed: {fio['error']}")
                else:
                    res["fio libaio direct"] = fio
            if k == 0:
                info = res["fnzero AioHandle"]
                print(f"fnzero: {'C pthread pool' if info['native'] else 'python fallback'}, "
                      f"{'O_DIRECT' if info['direct'] else 'buffered (O_DIRECT refused)'}")  # fmt: skip
            rounds.append(res)
        drop_file(path)
        dd = dd_run(path, a.size, a.block_size)
    finally:
        drop_file(path)
    print(f"\n{'round':6s} {'':22s} {'write GiB/s':>12s} {'read GiB/s':>12s}")
    for k, res in enumerate(rounds):
        for name, r in res.items():
            w, rd = r.get("write"), r.get("read")
            print(f"{k:<6d} {name:22s} {w / gib if w else float('nan'):12.2f} {rd / gib if rd else float('nan'):12.2f}")
    print(f"{'':6s} {'dd direct':22s} {(dd['write'] or float('nan')) / gib:12.2f} {(dd['read'] or float('nan')) / gib:12.2f}")
    paired = [r for r in rounds if "fio libaio direct" in r]
    if paired:
        ratios = {rw: [r["fnzero AioHandle"][rw] / r["fio libaio direct"][rw] for r in paired] for rw in ("write", "read")}
        ratio = {rw: statistics.median(xs) for rw, xs in ratios.items()}
        each = {rw: ", ".join(f"{x * 100:.0f}" for x in xs) for rw, xs in ratios.items()}
        print(f"\nfnzero / fio, median of {len(paired)} rounds: write {ratio['write'] * 100:.0f}% ({each['write']}), "
              f"read {ratio['read'] * 100:.0f}% ({each['read']}) (target >= 95%)")


if __name__ == "__main__":
    main()
