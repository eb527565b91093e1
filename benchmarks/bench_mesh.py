"""Meshes against plain data parallelism on the same GPT, in one invocation (CPU, gloo).

    python benchmarks/bench_mesh.py                          # 27.4M GPT, 2 ranks: dp 2, tp 2, pp 2 at ZeRO-1
    python benchmarks/bench_mesh.py --configs dp2_z3,tp2_z1,pp2_1f1b --rounds 3

For each configuration a fresh set of rank processes trains `warmup + steps` steps (micro-batch 4,
seq 128, fp32 AdamW) and reports the slower rank's median step time, peak RSS above the pre-model
baseline, the model-state bytes the state holds (exact) beside the formula of specs/mesh.md
§Memory, and the bytes each rank sends per step on each mesh axis (ring-equivalent: all-reduce
2(N-1)/N, all-gather (N-1)/N of the logical bytes). Ratios are against dp 2 ZeRO-1 measured in the
same round, in tokens per second (a tp group shares its batch, so tp 2 on 2 ranks trains half the
tokens of dp 2 per step).

The pp rows run the GPT as pipeline layers (embeddings, blocks, norm + head) in 2 stages over
4 micro-batches per step (GPipe, 1F1B, or interleaved 1F1B with 2 virtual stages per rank), and
measure the bubble: each stage's share of the pipelined passes spent waiting for its neighbour
(wall_clock_breakdown's "comm" against its "forward" + "backward"), beside the theory
(p-1)/(v·m+p-1) for equal stages.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from _common import CpuMonitor, machine, median  # noqa: E402
from bench_zero import MODELS, _current_rss_mib, _rss_mib  # noqa: E402

# name -> (tp, pp, ZeRO stage, micro-batches per step, pipeline schedule, virtual stages per rank)
CONFIGS = {"dp2_z1": (1, 1, 1, 1, None, 1), "dp2_z3": (1, 1, 3, 1, None, 1), "tp2_z1": (2, 1, 1, 1, None, 1),
           "tp2_z0": (2, 1, 0, 1, None, 1), "pp2_gpipe": (1, 2, 1, 4, "gpipe", 1), "pp2_1f1b": (1, 2, 1, 4, "1f1b", 1),
           "pp2_inter": (1, 2, 1, 4, "interleaved", 2)}


def _ring(records, n: int) -> float:
    total = 0.0
    for r in records:
        total += r.bytes * (2 * (n - 1) / n if r.op == "all_reduce" else (n - 1) / n)
    return total


def worker(kind: str, model_kw: dict, micro: int, steps: int, warmup: int):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import fnzero
    from fnzero.testing import GPT, gpt_layers

    torch.set_num_threads(1)
    fnzero.memory.return_freed_memory(4 << 20)
    rank, world = dist.get_rank(), dist.get_world_size()
    tp, pp, stage, k, sched, virtual = CONFIGS[kind]
    pre_model = _current_rss_mib()
    torch.manual_seed(0)
    cfg = fnzero.load_config({
        "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": k,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "overlap_comm": True},
        "tensor_parallel": {"autotp_size": tp}, "pipeline": {"stages": pp},
        "comms_logger": {"enabled": True}, "wall_clock_breakdown": pp > 1,
    }, world_size=world)
    if pp > 1:
        layers = gpt_layers(**model_kw)
        psi = sum(p.numel() for layer in layers for p in layer.parameters())
        sm = fnzero.shard(fnzero.PipelineModule(layers, lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()),
                                                virtual_stages=virtual), config=cfg)
        del layers
        loss_fn = fnzero.pipeline_loss(sm, sched)
    else:
        model = GPT(**model_kw)
        psi = sum(p.numel() for p in model.parameters())
        sm = fnzero.shard(model, config=cfg)
        del model

        def loss_fn(params, b):
            x, y = b
            return F.cross_entropy(sm.apply(params, x).flatten(0, 1), y.flatten())

    state = sm.init_state()
    bytes_state = fnzero.memory.model_state_bytes(state).total
    formula = fnzero.memory.zero_formula(sm.plan.num_padded, stage, cfg.world_size, False)
    dp_rank = rank // tp if pp == 1 else 0
    g = torch.Generator().manual_seed(dp_rank)
    seq, vocab = model_kw["seq_len"], model_kw["vocab_size"]
    batches = [torch.randint(0, vocab, (micro * k, seq + 1), generator=g) for _ in range(4)]
    step = fnzero.train_step(loss_fn, cfg, donate=True)
    times, dp_sent, tp_sent, pp_sent, idle = [], 0.0, 0.0, 0.0, []
    for i in range(warmup + steps):
        sm.comm.reset()
        if sm.tp is not None:
            sm.tp.comm.records.clear()
        if sm.pp is not None:
            sm.pp.comm.reset()
        dist.barrier()
        t = time.perf_counter()
        b = batches[i % 4]
        state, m = step(state, (b[:, :-1], b[:, 1:]))
        times.append(time.perf_counter() - t)
        if pp > 1 and i >= warmup:
            tm = m["timings"]  # this stage's passes vs its waits for the other stage, inside the schedule
            idle.append(tm["comm"] / (tm["comm"] + tm["forward"] + tm["backward"]))
        if i == warmup + steps - 1:
            dp_sent = sm.comm.ring_bytes_sent()
            tp_sent = _ring(sm.tp.comm.records, tp) if sm.tp is not None else 0.0
            pp_sent = sum(r.bytes for r in sm.pp.comm.records if r.op == "send") if sm.pp is not None else 0.0
    return {"step_s": median(times[warmup:]), "tokens": micro * k * seq * cfg.world_size,
            "peak_rss_mib": _rss_mib() - pre_model, "psi": psi,
            "psi_rank": sm.plan.num_params, "state_bytes": bytes_state, "formula": formula, "dp_sent": dp_sent,
            "tp_sent": tp_sent, "pp_sent": pp_sent, "idle": median(idle) if idle else float("nan"),
            "bubble_theory": fnzero.pipeline.bubble_fraction(pp, k, virtual) if pp > 1 else float("nan"),
            "loss": m["loss"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt27m", choices=sorted(MODELS))
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--configs", default="dp2_z1,tp2_z1,pp2_gpipe,pp2_1f1b,pp2_inter,dp2_z3")
    ap.add_argument("--rounds", type=int, default=1, help="alternating rounds; ratios are medians of each round's")
    ap.add_argument("--json", default=None, help="also write the last round's rows to this file")
    args = ap.parse_args()

    from fnzero.testing import run_world

    print(f"machine: {machine()}")
    print(f"model {args.model} {MODELS[args.model]}, 2 ranks x 1 thread, micro-batch {args.micro}, median of "
          f"{args.steps} steps after {args.warmup} warm-up\n")
    kinds = args.configs.split(",")
    rounds = []
    for k in range(args.rounds):
        rows = {}
        for kind in kinds if k % 2 == 0 else kinds[::-1]:
            with CpuMonitor() as mon:
                res = run_world(worker, 2, kind, MODELS[args.model], args.micro, args.steps, args.warmup, timeout=3600)
            slow = max(res, key=lambda r: r["step_s"])
            rows[kind] = dict(slow, peak_rss_mib=max(r["peak_rss_mib"] for r in res), other=mon.other_cores,
                              pp_sent=max(r["pp_sent"] for r in res), idle=[r["idle"] for r in res],
                              state_bytes=max(r["state_bytes"] for r in res), formula=max(r["formula"] for r in res),
                              psi_rank=max(r["psi_rank"] for r in res))
        rounds.append(rows)
    base = kinds[0]
    print(f"{'config':<10} {'step s':>8} {'tok/s':>7} {'vs ' + base:>10} {'params/rank':>12} {'state MiB':>10} {'formula':>9} "
          f"{'RSS MiB':>8} {'dp MB/step':>11} {'tp MB/step':>11} {'pp MB/step':>11} {'idle/stage':>12} {'theory':>7} "
          f"{'loss':>7} {'other cores':>11}")
    for kind in kinds:
        r = rounds[-1][kind]
        tps = median([rd[kind]["tokens"] / rd[kind]["step_s"] for rd in rounds])
        ratio = median([(rd[kind]["tokens"] / rd[kind]["step_s"]) / (rd[base]["tokens"] / rd[base]["step_s"]) for rd in rounds])
        print(f"{kind:<10} {median([rd[kind]['step_s'] for rd in rounds]):>8.3f} {tps:>7.0f} {ratio:>9.2f}x {r['psi_rank']:>12,} "
              f"{r['state_bytes'] / 2**20:>10.1f} {r['formula'] / 2**20:>9.1f} {r['peak_rss_mib']:>8.0f} "
              f"{r['dp_sent'] / 1e6:>11.1f} {r['tp_sent'] / 1e6:>11.1f} {r['pp_sent'] / 1e6:>11.2f} "
              f"{'/'.join(f'{x:.2f}' for x in r['idle']) if r['bubble_theory'] == r['bubble_theory'] else '-':>12} "
              f"{r['bubble_theory']:>7.2f} {r['loss']:>7.3f} {r['other']:>11.2f}")
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(rounds[-1], f, indent=1)
    print("\nvs: tokens/s relative to the first configuration. state: model-state bytes the rank's TrainState holds (parameters, gradients, master, moments); formula: "
          "zero_formula(Ψ_rank padded, stage, dp) (specs/mesh.md §Memory; at stage 3 small units stay whole, "
          "stage3_param_persistence_threshold, so the state is a little above it). dp/tp MB/step: ring-equivalent bytes one "
          "rank sends per step on that axis (pp: the busier stage's sends, activations forward and gradients back). "
          "idle/stage: each stage's share of the pipelined passes spent waiting for the other; theory: (p-1)/(v*m+p-1). "
          "params/rank, state, formula: the rank holding the most.")


if __name__ == "__main__":
    main()
