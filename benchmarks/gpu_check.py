"""fnzero on CUDA in one command: every check prints one line, PASS, FAIL or SKIP with its figures.

    python benchmarks/gpu_check.py                 # on a CUDA machine: 1 GPU, and 2 when there are 2
    bash benchmarks/gpu_check.sh                   # the same, from any directory
    python benchmarks/gpu_check.py --device cpu    # a dry run of every check on the CPU (gloo, tiny sizes)
    python benchmarks/gpu_check.py --checks zero_equivalence,checkpoint_roundtrip --world 1

The checks (each in a fresh world of real ranks, NCCL on CUDA, rank r on device r;
`_gpu_checks.py` holds what the ranks run):

    zero_equivalence[world=N]  ZeRO-0..3 equal plain PyTorch (AdamW, clip_grad_norm_) on the global
                               batch in float64 to 1e-9, at world sizes 1 and 2
    bf16_step, fp16_step       16-bit steps at stages 0-3 agree with stage 0 and with fp32 PyTorch
                               within the precision's rounding; fp16: an overflow on one rank is
                               skipped by every rank and halves the loss scale
    jit_whole_step             fnzero.jit(step, scope="step", fullgraph=True) equals eager (inductor;
                               aot_eager in a dry run on the CPU, or --jit-backend)
    offload_cpu_pinned         offload_optimizer {device: cpu, pin_memory: true} keeps the optimizer
                               state on the host and equals the on-device step
    checkpoint_roundtrip       save + load: bit-identical state on the same devices, same next step
    bench_zero                 benchmarks/bench_zero.py --device cuda: DDP, FSDP2 and ZeRO-0..3 train
                               the same thing; their step times side by side

Without a CUDA device (and without --device cpu) every check prints SKIP and the script exits 0;
it exits 1 when a check FAILs (its full error goes to stderr). The sizes are chosen for a run of a
few minutes on one or two GPUs (at most 8); `--timeout` bounds each check.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_zero.py")
BENCH_CONFIGS = ("ddp", "fsdp2", "z0", "z1", "z2", "z3")
NAMES = ("zero_equivalence[world=1]", "zero_equivalence[world=2]", "bf16_step", "fp16_step", "jit_whole_step",
         "offload_cpu_pinned", "checkpoint_roundtrip", "bench_zero")


def _g(x: float) -> str:
    return f"{x:.1e}"


def _checks(args, world: int, scratch: str) -> list[tuple[str, int, object, tuple, object]]:
    """(name, world size, rank function, its arguments, rank 0's figures -> text) of each check."""
    import _gpu_checks as R  # imports fnzero: not needed to say that every check skips

    d = args.device
    equiv = lambda f: f"stages 0-3 vs torch AdamW, float64: loss rel diff {_g(f['loss_rel'])}, param abs diff {_g(f['param_abs'])}"  # noqa: E731
    return [
        ("zero_equivalence[world=1]", 1, R.zero_equivalence, (d,), equiv),
        ("zero_equivalence[world=2]", 2, R.zero_equivalence, (d,), equiv),
        ("bf16_step", world, R.sixteen_bit, (d, "bf16"),
         lambda f: f"stages 0-3: loss rel diff vs fp32 torch {_g(f['vs_fp32_rel'])}, vs ZeRO-0 {_g(f['vs_stage0_rel'])}"),
        ("fp16_step", world, R.sixteen_bit, (d, "fp16"),
         lambda f: f"stages 0-3: loss rel diff vs fp32 torch {_g(f['vs_fp32_rel'])}, vs ZeRO-0 {_g(f['vs_stage0_rel'])}; "
                   f"loss scale {f['loss_scale']:g}; overflow on rank 0 skipped everywhere, scales {f['overflow_scales']}"),
        ("jit_whole_step", world, R.whole_step_jit, (d, args.jit_backend),
         lambda f: f"ZeRO-1, k=2, {args.jit_backend}, no graph break: loss rel diff {_g(f['loss_rel'])}, param abs diff "
                   f"{_g(f['param_abs'])}; first step (compile) {f['compile_s']:.1f} s, then {f['jit_s'] * 1e3:.1f} ms/step "
                   f"vs eager {f['eager_s'] * 1e3:.1f}"),
        ("offload_cpu_pinned", world, R.offload_pinned, (d,),
         lambda f: "stages 1,3: optimizer state on the host; vs on-device: " + ", ".join(
             f"{p} loss rel diff {_g(f[p][0])} param abs diff {_g(f[p][1])}" for p in ("fp32", "bf16"))
         + f"; host state pinned: {'yes' if f['pinned'] else 'no (pin_memory has no effect in fnzero)'}"),
        ("checkpoint_roundtrip", world, R.checkpoint_roundtrip, (d, scratch),
         lambda f: "ZeRO-3 bf16 and ZeRO-2 fp16: state bit-identical, next step bit-identical; save+load "
                   + ", ".join(f"{k[:-2]} {v:.2f} s" for k, v in f.items())),
    ]


def _first_error(e: BaseException) -> str:
    """One line for a failure: the rank and the last line of its traceback."""
    text = str(e).split("\n(then rank")[0]
    head = text.split("\n", 1)[0] if text.startswith("rank ") else ""
    lines = [x for x in text.splitlines() if x.strip()]
    last = lines[-1].strip() if lines else type(e).__name__
    return (head.rstrip(":") + ": " if head and head != last else "") + last[:400]


def bench_zero(args, world: int) -> str:
    """bench_zero.py in a short mode: every row trains; the fnzero stages agree with each other,
    FSDP2 with DDP, and fnzero with DDP: within fp32 noise where every row clips alike (a
    bench_zero with `--clip`), else within 2e-2 (fnzero clipped at DeepSpeed's default 1.0 and
    reported the mean loss over ranks, DDP and FSDP2 neither)."""
    with tempfile.TemporaryDirectory() as tmp:
        js = os.path.join(tmp, "zero.json")
        cmd = [sys.executable, BENCH, "--device", args.device, "--model", args.bench_model, "--world", str(world),
               "--steps", str(args.bench_steps), "--warmup", "1", "--configs", ",".join(BENCH_CONFIGS),
               "--nvme-dir", tmp, "--json", js]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        if p.returncode:
            sys.stderr.write(p.stdout[-3000:] + p.stderr[-5000:])
            tail = [x for x in p.stderr.splitlines() if x.strip()]
            raise AssertionError(f"bench_zero.py exited {p.returncode}: {tail[-1] if tail else ''}")
        with open(js) as f:
            out = json.load(f)
    rows, same_training = out["rows"], "clip" in out["args"]
    loss = {k: rows[k]["loss"] for k in BENCH_CONFIGS}
    assert all(math.isfinite(v) for v in loss.values()), f"a final loss is not finite: {loss}"
    for k in ("z1", "z2", "z3"):
        assert abs(loss[k] - loss["z0"]) <= 1e-4 * abs(loss["z0"]), f"{k} final loss {loss[k]} vs ZeRO-0's {loss['z0']}"
    assert abs(loss["fsdp2"] - loss["ddp"]) <= 1e-4 * abs(loss["ddp"]), f"FSDP2 final loss {loss['fsdp2']} vs DDP's {loss['ddp']}"
    tol = 1e-4 if same_training else 2e-2
    assert abs(loss["z0"] - loss["ddp"]) <= tol * abs(loss["ddp"]), f"ZeRO-0 final loss {loss['z0']} vs DDP's {loss['ddp']} (rtol {tol})"
    times = " ".join(f"{k} {rows[k]['step_s'] * 1e3:.1f}" for k in BENCH_CONFIGS)
    vs = " ".join(f"{k} {rows[k]['step_s'] / rows['ddp']['step_s']:.2f}" for k in BENCH_CONFIGS[1:])
    mem = ""
    if args.device != "cpu":
        mem = "; peak device MiB " + " ".join(f"{k} {rows[k]['peak_dev_mib']:.0f}" for k in BENCH_CONFIGS)
    return (f"{args.bench_model}, {world} rank(s): ms/step {times} (x DDP: {vs}); final loss DDP {loss['ddp']:.4f}, "
            f"FSDP2 {loss['fsdp2']:.4f}, ZeRO-0..3 {loss['z0']:.4f}{'' if same_training else ' (rows clip differently)'}{mem}")


def _line(status: str, name: str, text: str, seconds: float | None = None) -> None:
    took = f" ({seconds:.0f} s)" if seconds is not None else ""
    print(f"{status:4s} {name:26s} {text}{took}", flush=True)


def _run_one(name, world, fn, fn_args, fmt, args) -> bool:
    from fnzero.testing import run_world

    t = time.perf_counter()
    try:
        backend = "gloo" if args.device == "cpu" else "nccl"
        text = fmt(run_world(fn, world, *fn_args, timeout=args.timeout, backend=backend)[0])
    except Exception as e:  # noqa: BLE001 - a failed check is reported and the next one runs
        sys.stderr.write(f"--- {name} ---\n{e}\n" if str(e) else traceback.format_exc())
        _line("FAIL", name, _first_error(e), time.perf_counter() - t)
        return False
    _line("PASS", name, text, time.perf_counter() - t)
    return True


def _available(device: str) -> tuple[int, str]:
    """(ranks the device allows, what to say when it allows none)."""
    if device == "cpu":
        return 2, ""
    import torch

    if not torch.cuda.is_available():
        return 0, "no CUDA device (torch.cuda.is_available() is False); --device cpu dry-runs the check on gloo"
    return torch.cuda.device_count(), ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cuda (default; every check SKIPs without one) or cpu: a dry run on gloo with the same checks")
    ap.add_argument("--world", type=int, default=None, help="ranks of the checks after zero_equivalence (default: 2 if "
                    "the device has 2, else 1)")
    ap.add_argument("--checks", default=",".join(NAMES), help="comma-separated names (a prefix selects: zero_equivalence)")
    ap.add_argument("--jit-backend", default=None, help="torch.compile backend of jit_whole_step (default inductor on "
                    "cuda; aot_eager on cpu, where inductor's compile of the step takes minutes on a few cores)")
    ap.add_argument("--bench-model", default=None, help="bench_zero model (default gpt27m on cuda, gpt_tiny on cpu)")
    ap.add_argument("--bench-steps", type=int, default=None, help="bench_zero timed steps (default 6 on cuda, 2 on cpu)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds each check may take")
    args = ap.parse_args(argv)
    wanted = [n for n in NAMES if any(n.startswith(c) for c in args.checks.split(","))]
    ranks, why = _available(args.device)
    if not ranks:
        for name in wanted:
            _line("SKIP", name, why)
        return 0
    args.jit_backend = args.jit_backend or ("aot_eager" if args.device == "cpu" else "inductor")
    args.bench_model = args.bench_model or ("gpt_tiny" if args.device == "cpu" else "gpt27m")
    args.bench_steps = args.bench_steps or (2 if args.device == "cpu" else 6)
    world = min(args.world or 2, ranks)
    # cuBLAS is deterministic only with a fixed workspace; set before any rank starts (the ranks'
    # fork server takes this environment), so checkpoint_roundtrip's two next steps run alike.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    print(f"# fnzero gpu_check: device {args.device} x {ranks}, torch {torch.__version__}, checks at world "
          f"sizes 1-{world}", flush=True)
    start, failed = time.perf_counter(), 0
    with tempfile.TemporaryDirectory() as scratch:
        for name, n, fn, fn_args, fmt in _checks(args, world, scratch):
            if name not in wanted:
                continue
            if n > ranks:
                _line("SKIP", name, f"needs {n} {args.device} devices, this machine has {ranks}")
                continue
            failed += not _run_one(name, n, fn, fn_args, fmt, args)
    if "bench_zero" in wanted:
        t = time.perf_counter()
        try:
            _line("PASS", "bench_zero", bench_zero(args, world), time.perf_counter() - t)
        except Exception as e:  # noqa: BLE001
            sys.stderr.write(traceback.format_exc())
            _line("FAIL", "bench_zero", _first_error(e), time.perf_counter() - t)
            failed += 1
    print(f"# {failed} failed, {time.perf_counter() - start:.0f} s in all", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
