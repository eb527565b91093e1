"""Checkpoint throughput and export memory.

    python benchmarks/bench_checkpoint.py [--params 100e6] [--export-params 1e9] [--dir DIR]

1. save/load of a ~100M-parameter fp32 state (world of one, stage 0, SGD without momentum: the state
   is the parameters, 400 MB) with fnzero.checkpoint, against torch.save/torch.load of the same
   tensors (both fsynced) and against raw sequential bandwidth measured in the same run: a Python
   write+fsync loop and `dd conv=fdatasync` of the same bytes (the checkpoint's data file) for
   saves, `dd iflag=direct` of the
   checkpoint's data file for loads. The methods alternate within each round; best of --repeats.
   Loads read from the page cache (caches are not dropped: shared machine), so they measure CPU
   cost more than the disk.
2. export peak RSS: a synthetic checkpoint of `--export-params` fp32 parameters (written directly in
   the checkpoint format, no training) exported to bf16 safetensors in a fresh subprocess, whose
   peak RSS is reported next to the RSS of a process that only imports torch and fnzero.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import zlib

import torch

import fnzero
import fnzero.testing
from fnzero.checkpoint import _format as F
from fnzero.checkpoint import load, save
from fnzero.checkpoint._io import tensor_bytes


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def _gbps(nbytes, s):
    return nbytes / s / 1e9


def _state(n_params):
    width = 4096
    layers = max(1, round(n_params / (width * width + width)))
    cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    with torch.device("cpu"):
        model = fnzero.testing.MLP([width] * (layers + 1))
    return fnzero.shard(model, stage=0, config=cfg).init_state()


def raw_write(path, nbytes):
    buf = memoryview(os.urandom(64 << 20))
    with open(path, "wb", buffering=0) as f:
        left = nbytes
        while left > 0:
            left -= f.write(buf[: min(left, len(buf))])
        os.fsync(f.fileno())


def dd_write(path, source):
    """Seconds for `dd conv=fdatasync` to write the bytes of `source` (the checkpoint's own data
    file, read from the page cache: the same bytes, not zeros, which some disks store for free)."""
    if shutil.which("dd") is None or not os.path.exists(source):
        return None
    t, p = _timed(lambda: subprocess.run(["dd", f"if={source}", f"of={path}", "bs=1M", "conv=fdatasync"],
                                         capture_output=True))
    return t if p.returncode == 0 else None


def dd_read(path):
    """Seconds for `dd iflag=direct` to read `path` (bypassing the page cache), or None."""
    if shutil.which("dd") is None or not os.path.exists(path):
        return None
    t, p = _timed(lambda: subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=1M", "iflag=direct"],
                                         capture_output=True))
    return t if p.returncode == 0 else None


def torch_save(path, tensors):
    with open(path, "wb") as f:
        torch.save(tensors, f)
        f.flush()
        os.fsync(f.fileno())


def throughput(d, n_params, repeats):
    """GB/s of each method, best of `repeats` rounds; the methods alternate within each round, so
    a burst of load from elsewhere on a shared machine hits them alike."""
    state = _state(n_params)
    nbytes = sum(t.numel() * t.element_size() for t in state.params.values())
    print(f"state: {sum(t.numel() for t in state.params.values()) / 1e6:.1f}M params, {nbytes / 1e6:.0f} MB")
    save(os.path.join(d, "ck"), state, tag="t")  # what the loads and dd's direct read read
    torch_save(os.path.join(d, "t.pt"), state.params)
    data = os.path.join(d, "ck", "t", F.data_name(0))
    methods = {
        "raw write+fsync": lambda: _timed(lambda: raw_write(os.path.join(d, "raw"), nbytes))[0],
        "dd conv=fdatasync": lambda: dd_write(os.path.join(d, "dd"), data),
        "fnzero save": lambda: _timed(lambda: save(os.path.join(d, "ck"), state, tag="t"))[0],
        "torch.save": lambda: _timed(lambda: torch_save(os.path.join(d, "t.pt"), state.params))[0],
        "dd iflag=direct": lambda: dd_read(data),
        "fnzero load": lambda: _timed(lambda: load(os.path.join(d, "ck"), like=state, tag="t"))[0],
        "torch.load": lambda: _timed(lambda: torch.load(os.path.join(d, "t.pt"), weights_only=True))[0],
    }
    times: dict[str, list[float]] = {k: [] for k in methods}
    for _ in range(repeats):
        for name, fn in methods.items():
            t = fn()
            if t is not None:
                times[name].append(t)
    res = {k: (_gbps(nbytes, min(ts)) if ts else None) for k, ts in times.items()}
    for f in os.listdir(d):
        p = os.path.join(d, f)
        shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
    return res


def synthetic_checkpoint(d, n_params, width=8192):
    """A one-rank, stage-0, fp32 checkpoint of `n_params` parameters in `layers.i.weight` tensors of
    width x width (plus a remainder), written straight into the format."""
    os.makedirs(os.path.join(d, "syn"), exist_ok=True)
    per = width * width
    sizes = [per] * (n_params // per) + ([n_params % per] if n_params % per else [])
    block = torch.randn(8 << 20)  # 32 MiB, one segment; repeated
    units, tensors, off = [], {}, 0
    with open(os.path.join(d, "syn", F.data_name(0)), "wb", buffering=0) as f:
        for i, n in enumerate(sizes):
            shape = [width, width] if n == per else [n]
            units.append({"name": f"layers.{i}", "numel": n,
                          "slots": [{"name": f"layers.{i}.weight", "shape": shape, "offset": 0, "aliases": []}]})
            segs = []
            for lo in range(0, n, block.numel()):
                hi = min(n, lo + block.numel())
                buf = tensor_bytes(block[: hi - lo])
                f.write(buf)
                segs.append([0, off, lo, hi, zlib.crc32(buf)])
                off += len(buf)
                pad = (-off) % F.ALIGN
                f.write(bytes(pad))
                off += pad
            tensors[f"params/layers.{i}"] = {"dtype": "float32", "unit": f"layers.{i}", "segments": segs}
        os.fsync(f.fileno())
    ix = {"format": F.FORMAT, "version": F.VERSION, "tag": "syn", "nonce": 1, "world_size": 1, "stage": 0,
          "param_dtype": "float32", "has_master": False, "optimizer": "SGDState", "step": 0, "config": None,
          "client_state": None, "loss_scale": None, "units": units, "files": [off], "rng": [], "tensors": tensors}
    with open(os.path.join(d, "syn", F.INDEX_NAME), "wb") as f:
        f.write(F.seal(ix))
    return os.path.join(d, "syn"), off


# VmHWM (peak resident set of this address space) rather than ru_maxrss: Linux carries ru_maxrss
# over fork+exec, so a child would report the benchmark parent's peak.
_RSS = "import re; {body}; print(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1))"


def peak_rss_mb(body):
    p = subprocess.run([sys.executable, "-c", _RSS.format(body=body)], capture_output=True, text=True, check=True)
    return int(p.stdout.strip().splitlines()[-1]) / 1024


def export_rss(d, n_params):
    t, (ck, size) = _timed(lambda: synthetic_checkpoint(d, n_params))
    print(f"synthetic checkpoint: {n_params / 1e9:.2f}B fp32 params, {size / 1e9:.2f} GB written in {t:.1f}s")
    base = peak_rss_mb("import torch, fnzero.checkpoint")
    out = os.path.join(d, "export")
    t, rss = _timed(lambda: peak_rss_mb(
        f"import torch, fnzero.checkpoint as c; c.export({ck!r}, {out!r}, dtype='bf16', max_shard_size='5GB', progress=False)"))
    print(f"export to bf16 safetensors: {t:.1f}s ({_gbps(size, t):.2f} GB/s read), peak RSS {rss:.0f} MB "
          f"(import-only baseline {base:.0f} MB; model {size / 1e6:.0f} MB)")
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(ck, ignore_errors=True)
    return rss, base


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=100e6)
    ap.add_argument("--export-params", type=float, default=1e9)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--dir", default=None, help="scratch directory on the disk to measure (default: a temp dir)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    print(f"machine: {platform.platform()}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"python {platform.python_version()}, torch {torch.__version__}")
    d = tempfile.mkdtemp(prefix="fnzero-bench-", dir=a.dir)
    try:
        res = {} if a.skip_throughput else throughput(d, int(a.params), a.repeats)
        raw = res.get("raw write+fsync")
        print(f"{'':22s}  GB/s   vs raw write   vs torch   vs dd" if res else "", end="\n" if res else "")
        rows = [("raw write+fsync", None, None), ("dd conv=fdatasync", None, None),
                ("fnzero save", "torch.save", "dd conv=fdatasync"), ("torch.save", None, "dd conv=fdatasync"),
                ("dd iflag=direct", None, None), ("fnzero load", "torch.load", "dd iflag=direct"),
                ("torch.load", None, "dd iflag=direct")]
        for name, torch_name, dd_name in [] if not res else rows:
            v = res[name]
            if v is None:
                continue
            vs_torch = f"{v / res[torch_name]:.2f}x" if torch_name and res[torch_name] else ""
            vs_dd = f"{v / res[dd_name]:.2f}x" if dd_name and res[dd_name] else ""
            print(f"{name:22s} {v:6.2f}   {v / raw:9.2f}x   {vs_torch:>8s}   {vs_dd:>6s}")
        if res:
            print("(loads read the page cache, as a resume right after a save does; dd iflag=direct reads the disk)")
        export_rss(d, int(a.export_params))
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
