"""ZeRO-Infinity's optimizer store against the in-memory step: one fp32 Adam update of ~100M
parameters (400 MB master + 800 MB moments), step time and peak RSS, each in a fresh process.

in-memory: the C Adam kernel over the whole shard, state in RAM.
nvme:      fnzero.offload.NvmeOptimizerStore (state in files under --dir, O_DIRECT where the
           file system allows, sub_group_size chunks through buffer_count buffers).

Both hold the gradient (fp32) and a bf16 copy-out of the new parameters, which a training step
has anyway. "peak RSS during the steps" is VmHWM (reset through /proc/self/clear_refs after setup)
minus the process after `import torch`; "state RSS" is that minus the gradient and copy-out.
`create` briefly holds the caller's master as well ("setup peak").
"GB/s through the store" counts what a step moves: master + moments read and written.

Usage: python benchmarks/bench_offload.py [--params 100M] [--sub-group-size 4Mi] [--buffer-count 4]
                                          [--steps 3] [--dir /tmp] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import CpuMonitor, machine, median  # noqa: E402

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def parse_count(s: str) -> int:
    """100M = 100e6; 4Mi = 4 * 2**20 (a sub_group_size multiple of 1024 keeps the I/O O_DIRECT)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMG]i?)?", s.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"bad count {s!r}")
    unit = m.group(2) or ""
    mult = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}[unit]
    return int(float(m.group(1)) * mult)


def status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def child(args) -> dict:
    """One configuration in this (fresh) process; returns the figures as a dict."""
    import torch

    torch.set_num_threads(args.threads)
    from fnzero import _ext
    from fnzero.offload import NvmeOptimizerStore

    base = status("VmRSS")
    n = args.params
    grads = torch.empty(n).uniform_(-1, 1)
    out = torch.empty(n, dtype=torch.bfloat16).zero_()
    held = status("VmRSS") - base  # grads + out: both modes have them
    master = torch.empty(n).uniform_(-1, 1)
    res = {"mode": args.mode, "cext": _ext.available(), "simd": _ext.simd_level()}
    times = []

    def steps_begin() -> None:  # peak RSS of the steps alone: create's transient copy of master is not the step's
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS

    if args.mode == "memory":
        m, v = torch.zeros(n), torch.zeros(n)
        res["create_peak"] = status("VmHWM") - base
        steps_begin()
        for s in range(1, args.steps + 1):
            t0 = time.perf_counter()
            _ext.adam_step_(master, grads, m, v, step=s, out16=out, **HYPER)
            times.append(time.perf_counter() - t0)
    else:
        t0 = time.perf_counter()
        store = NvmeOptimizerStore.create(args.dir, {"shard": master}, sub_group_size=args.sub_group_size,
                                          buffer_count=args.buffer_count)  # fmt: skip
        res["create_s"] = time.perf_counter() - t0
        res["direct"] = store._handles["master"].direct
        del master  # the store holds its own copy: from here on the state is in files
        res["create_peak"] = status("VmHWM") - base
        steps_begin()
        try:
            for s in range(1, args.steps + 1):
                t0 = time.perf_counter()
                store.step({"shard": grads}, step=s, out={"shard": out}, **HYPER)
                times.append(time.perf_counter() - t0)
            res["bytes_on_disk"] = store.bytes_on_disk
        finally:
            store.close()
    peak = status("VmHWM") - base
    res.update(step_s=times, peak_rss=peak, state_rss=peak - held, held=held)  # during the steps
    return res


def run(mode: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--params", str(args.params), "--steps", str(args.steps),
           "--sub-group-size", str(args.sub_group_size), "--buffer-count", str(args.buffer_count),
           "--dir", args.dir, "--threads", str(args.threads)]  # fmt: skip
    with CpuMonitor() as mon:
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{r.stderr}")
    res = json.loads(r.stdout.strip().splitlines()[-1])
    res["other_cores"] = mon.other_cores
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=parse_count, default=100_000_000)
    p.add_argument("--sub-group-size", type=parse_count, default=4 * 2**20)
    p.add_argument("--buffer-count", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--dir", default=tempfile.gettempdir())
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--child", choices=["memory", "nvme"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.mode = args.child
        print(json.dumps(child(args)))
        return
    mib = 2**20
    print(machine())
    print(f"Adam fp32, {args.params / 1e6:.0f}M params ({12 * args.params / 1e6:.0f} MB master + moments), "
          f"sub_group_size {args.sub_group_size}, buffer_count {args.buffer_count}, {args.threads} threads, "
          f"dir {args.dir}; step time = median of steps 2..{args.steps} (step 1 also fills the files)")  # fmt: skip
    if args.sub_group_size % 1024:
        print("  note: sub_group_size is not a multiple of 1024, so chunk I/O goes through the page cache")
    res = {mode: run(mode, args) for mode in ("memory", "nvme")}
    moved = 2 * 12 * args.params  # master + 2 moments, read and written
    for mode, r in res.items():
        st = median(r["step_s"][1:] or r["step_s"])
        extra = f", create {r['create_s']:.2f} s, O_DIRECT {r['direct']}, {moved / st / 1e9:.2f} GB/s through the store" \
            if mode == "nvme" else ""  # fmt: skip
        print(f"  {mode:7s} step {st:.3f} s (all: {', '.join(f'{t:.3f}' for t in r['step_s'])}); peak RSS during "
              f"the steps {r['peak_rss'] / mib:.0f} MiB, state RSS {r['state_rss'] / mib:.0f} MiB (grads + out "
              f"{r['held'] / mib:.0f} MiB), setup peak {r['create_peak'] / mib:.0f} MiB{extra}; "
              f"other load {r['other_cores']:.2f} cores")  # fmt: skip
    m, v = res["memory"], res["nvme"]
    t_m, t_v = median(m["step_s"][1:] or m["step_s"]), median(v["step_s"][1:] or v["step_s"])
    bound = args.buffer_count * min(args.sub_group_size, args.params) * 12
    print(f"  ratios  nvme/memory: step time {t_v / t_m:.1f}x, peak RSS {v['peak_rss'] / m['peak_rss']:.2f}x, "
          f"state RSS {v['state_rss'] / mib:.0f} vs {m['state_rss'] / mib:.0f} MiB "
          f"(buffers {bound / mib:.0f} MiB = buffer_count x sub_group_size x 12 bytes)")  # fmt: skip


if __name__ == "__main__":
    main()
