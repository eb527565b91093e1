"""fnzero.jit against fnzero's eager step on the same GPT, in one invocation (CPU, inductor).

    python benchmarks/bench_jit.py                          # 27.4M GPT, stages 0 and 3, 2 threads
    python benchmarks/bench_jit.py --stages 0,1,2,3 --model gpt_tiny --steps 3
    python benchmarks/bench_jit.py --stages 0,1,2,3 --scopes loss,units,step  # every scope

For each stage a fresh process with an empty inductor cache builds the model and times the jitted
step's first call (trace + compile + one step, "cold"); then eager and compiled steps alternate,
each on its own copy of the state, `warmup` + `steps` times. A second process with the same cache
directory times the first call again ("warm": what a restarted job pays). Compile time = first call - median compiled step.
Reported: compiled/eager step-time ratio (below 1 is faster), cold and warm compile seconds, the
graph breaks torch.compile reported with their reasons, and the largest loss difference between
the eager and compiled runs (same batches, same initial state).

Baseline, measured first in the same invocation (skip with --no-baseline): plain
`torch.compile(model)` of the same GPT (forward and backward, loss and torch's fused AdamW eager),
cold in its own empty cache, compile time measured the same way. Cold compile times move by 20 %
between days on a shared VM, so each stage's cold compile is also printed as a ratio to it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))

from _common import CpuMonitor, machine, median  # noqa: E402

MODELS = {
    "gpt27m": dict(vocab_size=8192, seq_len=128, d_model=512, n_layer=6, n_head=8),
    "gpt_tiny": dict(vocab_size=512, seq_len=32, d_model=64, n_layer=2, n_head=2),
}


def child(model: str, stage: int, micro: int, steps: int, warmup: int, threads: int, phase: str,
          scope: str = "units") -> dict:
    import time
    import warnings

    import torch
    import torch.nn.functional as F

    import fnzero
    from fnzero.testing import GPT

    torch.set_num_threads(threads)
    warnings.simplefilter("ignore", fnzero.JitWarning)  # breaks are read from .graph_breaks
    kw = MODELS[model]
    torch.manual_seed(0)
    cfg = fnzero.load_config({
        "train_micro_batch_size_per_gpu": micro, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}},
        "zero_optimization": {"stage": stage, "overlap_comm": True},
    })
    sm = fnzero.shard(GPT(**kw), config=cfg)
    state0 = sm.init_state()

    def loss_fn(params, batch):
        logits = sm.apply(params, batch[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, kw["vocab_size"], (micro, kw["seq_len"] + 1), generator=g) for _ in range(4)]
    eager = fnzero.train_step(loss_fn, cfg)
    jitted = fnzero.jit(eager, scope=scope)

    # The compiled step's first call is timed alone (trace + compile + one step); then eager and
    # compiled steps alternate on their own states, so neither profits from running second
    # (allocator and cache warm-up showed up as 30 % swings when they ran one after the other).
    out: dict = {"stage": stage, "phase": phase, "scope": scope}
    se, sj = fnzero.tree_clone(state0), fnzero.tree_clone(state0)
    te, tj, le, lj = [], [], [], []
    with CpuMonitor() as mon:
        t = time.perf_counter()
        sj, m = jitted(sj, batches[0])
        first = time.perf_counter() - t
        lj.append(m["loss"])
        se, m = eager(se, batches[0])
        le.append(m["loss"])
        for i in range(1, 1 + warmup + steps):
            b = batches[i % len(batches)]
            t = time.perf_counter()
            se, m = eager(se, b)
            te.append(time.perf_counter() - t)
            le.append(m["loss"])
            t = time.perf_counter()
            sj, m = jitted(sj, b)
            tj.append(time.perf_counter() - t)
            lj.append(m["loss"])
    out["other_cores"] = mon.other_cores
    out["first_call_s"] = first
    out["eager_step_s"] = median(te[warmup:])
    out["jit_step_s"] = median(tj[warmup:])
    out["compile_s"] = first - out["jit_step_s"]
    out["graph_breaks"] = list(jitted.graph_breaks)
    out["fallback"] = jitted.fallback_reason
    out["max_loss_diff"] = max(abs(a - b) for a, b in zip(le, lj))
    out["tokens_per_step"] = micro * kw["seq_len"]
    return out


def plain_child(model: str, micro: int, steps: int, warmup: int, threads: int) -> dict:
    """Plain torch.compile of the bare model: what a torch user pays, with nothing of fnzero."""
    import time

    import torch
    import torch.nn.functional as F

    from fnzero.testing import GPT

    torch.set_num_threads(threads)
    kw = MODELS[model]
    torch.manual_seed(0)
    net = GPT(**kw)
    compiled = torch.compile(net)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, kw["vocab_size"], (micro, kw["seq_len"] + 1), generator=g) for _ in range(4)]
    times = []
    for i in range(1 + warmup + steps):
        b = batches[i % len(batches)]
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(compiled(b[:, :-1]).flatten(0, 1), b[:, 1:].flatten()).backward()
        opt.step()
        times.append(time.perf_counter() - t)
    step = median(times[1 + warmup:])
    return {"first_call_s": times[0], "step_s": step, "compile_s": times[0] - step}


def _run_child(args, env, *child: str) -> dict:
    cmd = [sys.executable, __file__, "--model", args.model, "--micro", str(args.micro), "--steps",
           str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads), "--scope", args.scope,
           "--child", *child]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode or not line:
        sys.exit(f"{' '.join(child)} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return json.loads(line[0][7:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt27m", choices=sorted(MODELS))
    ap.add_argument("--stages", default="0,3")
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--scopes", default="units", help="fnzero.jit scopes to measure, comma-separated: units, loss, step")
    ap.add_argument("--scope", default="units", help=argparse.SUPPRESS)
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--no-baseline", action="store_true", help="skip plain torch.compile's cold compile")
    ap.add_argument("--child", nargs=2, metavar=("STAGE", "PHASE"), help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child and args.child[0] == "plain":
        print("RESULT " + json.dumps(plain_child(args.model, args.micro, args.steps, args.warmup, args.threads)))
        return
    if args.child:
        res = child(args.model, int(args.child[0]), args.micro, args.steps, args.warmup, args.threads, args.child[1],
                    args.scope)
        print("RESULT " + json.dumps(res))
        return

    import fnzero

    print(machine())
    print(f"fnzero {fnzero.__version__}; model {args.model} {MODELS[args.model]}, 1 process x {args.threads} threads, "
          f"micro-batch {args.micro}, fp32 AdamW, {args.steps} timed steps after {args.warmup} warm-up")
    baseline = None
    if not args.no_baseline:
        with tempfile.TemporaryDirectory(prefix="fnzero-inductor-") as cache:
            baseline = _run_child(args, dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache), "plain", "cold")
        print(f"baseline: plain torch.compile(model), cold: compile {baseline['compile_s']:.1f} s, "
              f"step {baseline['step_s']:.3f} s", flush=True)
    rows = []
    for stage, scope in [(int(s), c) for s in args.stages.split(",") for c in args.scopes.split(",")]:
        if scope == "step" and stage == 3:
            continue  # stage 3 gathers inside the forward: scope="step" compiles the loss only there
        args.scope = scope
        with tempfile.TemporaryDirectory(prefix="fnzero-inductor-") as cache:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
            res = {phase: _run_child(args, env, str(stage), phase) for phase in ("cold", "warm")}
        cold, warm = res["cold"], res["warm"]
        row = {
            "stage": stage, "scope": scope, "eager_step_s": cold["eager_step_s"], "jit_step_s": cold["jit_step_s"],
            "ratio": cold["jit_step_s"] / cold["eager_step_s"], "cold_compile_s": cold["compile_s"],
            "warm_compile_s": warm["compile_s"], "graph_breaks": cold["graph_breaks"], "fallback": cold["fallback"],
            "max_loss_diff": cold["max_loss_diff"], "other_cores": max(cold["other_cores"], warm["other_cores"]),
            "tokens_per_s_eager": cold["tokens_per_step"] / cold["eager_step_s"],
            "tokens_per_s_jit": cold["tokens_per_step"] / cold["jit_step_s"],
            "cold_vs_plain": cold["compile_s"] / baseline["compile_s"] if baseline else None,
        }
        rows.append(row)
        vs_plain = f" ({row['cold_vs_plain']:.2f}x plain torch.compile)" if baseline else ""
        print(f"stage {stage} scope={scope}: eager {row['eager_step_s']:.3f} s/step ({row['tokens_per_s_eager']:.0f} tok/s), "
              f"compiled {row['jit_step_s']:.3f} s/step ({row['tokens_per_s_jit']:.0f} tok/s) = "
              f"{row['ratio']:.3f}x eager; compile cold {row['cold_compile_s']:.1f} s{vs_plain}, warm {row['warm_compile_s']:.1f} s; "
              f"max |loss diff| {row['max_loss_diff']:.2e}; other cores {row['other_cores']:.2f}", flush=True)
        if row["fallback"]:
            print(f"  fell back to eager: {row['fallback']}")
        for b in row["graph_breaks"]:
            print(f"  graph break: {b}")
        if not row["graph_breaks"]:
            print("  no graph break")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "baseline_plain_torch_compile": baseline, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
