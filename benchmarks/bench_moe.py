"""Expert parallelism on a GPT with MoE layers, against the same model at ep 1 and a dense GPT, in one
invocation (CPU: a spawned gloo world of 4, or a simulated one).

    python benchmarks/bench_moe.py                              # GPT, 4 blocks of 8 experts, 4 gloo ranks
    python benchmarks/bench_moe.py --configs ep1,ep4 --stage 2 --steps 10
    python benchmarks/bench_moe.py --simulated --steps 1 --warmup 0 --model tiny   # seconds: threads, no spawn

One world runs every configuration in turn (each its own mesh, model and state): `ep1` (every rank
holds every expert), `ep2`, `ep4` (the experts split over 2 or 4 ranks, `fnzero.make_mesh(comm,
ep=E)`), and `dense`, the GPT with one MLP per block in place of each MoE layer: at top-1 the
same parameters per token (equal active parameters), E times fewer in all. Each trains `warmup +
steps` steps (fp32 AdamW, micro-batch `--micro`, top-1 routing dropping tokens past capacity 1.0)
and reports the slower rank's median step time and tokens/s (every rank's tokens), the bytes one
rank sends per step by all-to-all against `specs/collectives.md` §All-to-all (4 (E-1)/E x experts x
capacity x hidden x 4 bytes per MoE layer per micro-batch), the ring-equivalent bytes it sends on
the dp and the expert-data-parallel (edp) groups, and its model-state bytes (exact, the state's)
against `specs/mesh.md` §Expert parallelism memory, with ratios to ep1 and to dense.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from _common import CpuMonitor, machine, median  # noqa: E402

MODELS = {
    "small": dict(vocab_size=2048, seq_len=64, d_model=128, n_layer=4, n_head=4, num_experts=8),
    "tiny": dict(vocab_size=64, seq_len=8, d_model=16, n_layer=2, n_head=2, num_experts=4),
}
CONFIGS = {"ep1": 1, "ep2": 2, "ep4": 4, "dense": 1}  # name -> expert-parallel size
CAPACITY_FACTOR, MIN_CAPACITY = 1.0, 4


def _model(kind: str, model_kw: dict):
    from fnzero.testing import GPT, seeded

    kw = dict(model_kw)
    experts = kw.pop("num_experts")
    with seeded(0):  # every rank builds the same weights
        if kind == "dense":
            return GPT(**kw)
        moe = dict(k=1, ep_size=CONFIGS[kind], capacity_factor=CAPACITY_FACTOR, min_capacity=MIN_CAPACITY)
        return GPT(**kw, num_experts=experts, moe=moe)


def all_to_all_formula(model_kw: dict, micro: int, ep: int, itemsize: int = 4) -> int:
    """specs/collectives.md §All-to-all: bytes one rank sends per step (one micro-batch per step)."""
    experts, hidden = model_kw["num_experts"], model_kw["d_model"]
    capacity = max(math.ceil(CAPACITY_FACTOR * micro * model_kw["seq_len"] / experts), MIN_CAPACITY)
    return model_kw["n_layer"] * 4 * (ep - 1) * experts * capacity * hidden * itemsize // ep


def _state_formula(plan, stage: int, world: int, ep: int, psi_e: int) -> float:
    """specs/mesh.md §Expert parallelism memory, with the units' padding: at ep 1 the experts sit
    inside the blocks' units and are counted dense (the same formula over the same ranks)."""
    import fnzero

    here = sum(u.padded_numel for u in plan.units if u.is_expert)
    return fnzero.memory.ep_zero_formula(plan.num_padded - here, ep * here, stage, world, ep, False)


def _measure(comm, kind: str, model_kw: dict, micro: int, steps: int, warmup: int, stage: int) -> dict:
    import torch
    import torch.nn.functional as F

    import fnzero

    ep = CONFIGS[kind]
    cfg = fnzero.load_config({
        "train_micro_batch_size_per_gpu": micro, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, "overlap_comm": True}, "comms_logger": {"enabled": True},
    }, world_size=comm.world_size)
    model = _model(kind, model_kw)
    psi = sum(p.numel() for p in model.parameters())
    psi_e = fnzero.memory.expert_param_counts(model)[1]
    sm = fnzero.shard(model, config=cfg, comm=comm, mesh=fnzero.make_mesh(comm, ep=ep))
    del model
    state = sm.init_state()
    state_bytes = fnzero.memory.model_state_bytes(state).total
    layout = state.sharding.ep
    recorders = {"dp": sm.comm, "ep": layout.comm if layout else None, "edp": layout.expert_dp if layout else None}
    seq, vocab = model_kw["seq_len"], model_kw["vocab_size"]
    g = torch.Generator().manual_seed(comm.rank)
    batches = [torch.randint(0, vocab, (micro, seq + 1), generator=g) for _ in range(4)]
    step = fnzero.train_step(
        lambda p, b: F.cross_entropy(sm.apply(p, b[:, :-1]).flatten(0, 1), b[:, 1:].flatten()), cfg, donate=True)
    times, sent = [], {}
    for i in range(warmup + steps):
        for rec in recorders.values():
            if rec is not None:
                rec.reset()
        comm.barrier()
        t = time.perf_counter()
        state, m = step(state, batches[i % 4])
        times.append(time.perf_counter() - t)
    for axis, rec in recorders.items():  # the last step's
        sent[axis] = rec.ring_bytes_sent() if rec is not None and rec.world_size > 1 else 0.0
    a2a = sum(r.bytes for r in recorders["ep"].records if r.op == "all_to_all") if layout else 0
    return {"ep": ep, "step_s": median(times[warmup:]), "tokens": micro * seq * comm.world_size, "psi": psi,
            "psi_e": psi_e, "psi_rank": sm.plan.num_params, "state_bytes": state_bytes,
            "state_formula": _state_formula(sm.plan, stage, comm.world_size, ep, psi_e),
            "a2a_bytes": a2a, "a2a_formula": all_to_all_formula(model_kw, micro, ep) if kind != "dense" else 0,
            "dp_sent": sent["dp"], "edp_sent": sent["edp"], "loss": float(m["loss"])}


def measure_all(comm, kinds: list[str], model_kw: dict, micro: int, steps: int, warmup: int, stage: int) -> dict:
    """Every configuration on this rank, in turn."""
    import torch

    torch.set_num_threads(1)
    return {kind: _measure(comm, kind, model_kw, micro, steps, warmup, stage) for kind in kinds}


def worker(kinds, model_kw, micro, steps, warmup, stage):
    """One spawned rank (torch.distributed initialised by run_world)."""
    from fnzero.sharding import default_collectives

    return measure_all(default_collectives(), kinds, model_kw, micro, steps, warmup, stage)


def _rows(per_rank: list[dict]) -> dict:
    """Across ranks: the slower rank's step, the largest state and traffic (the ranks agree but for padding)."""
    rows = {}
    for kind in per_rank[0]:
        rs = [r[kind] for r in per_rank]
        slow = max(rs, key=lambda r: r["step_s"])
        rows[kind] = dict(slow, **{k: max(r[k] for r in rs) for k in ("state_bytes", "state_formula", "a2a_bytes",
                                                                     "dp_sent", "edp_sent", "psi_rank")},
                          a2a_equal=all(r["a2a_bytes"] == r["a2a_formula"] for r in rs),
                          state_equal=all(r["state_bytes"] == r["state_formula"] for r in rs))
    return rows


def _print(rows: dict, world: int) -> None:
    base, dense = rows.get("ep1"), rows.get("dense")
    print(f"{'config':<6} {'ep':>2} {'edp':>3} {'step s':>7} {'tok/s':>7} {'vs ep1':>7} {'a2a KB/step':>11} "
          f"{'formula':>8} {'params/rank':>11} {'state MiB':>9} {'formula':>8} {'vs ep1':>7} {'vs dense':>8} "
          f"{'dp MB':>7} {'edp MB':>7} {'loss':>6}")
    for kind, r in rows.items():
        tps = r["tokens"] / r["step_s"]
        vs = f"{tps / (base['tokens'] / base['step_s']):.2f}x" if base else "-"
        mem = f"{r['state_bytes'] / base['state_bytes']:.3f}" if base else "-"
        mem_dense = f"{r['state_bytes'] / dense['state_bytes']:.3f}" if dense else "-"
        print(f"{kind:<6} {r['ep']:>2} {world // r['ep']:>3} {r['step_s']:>7.3f} {tps:>7.0f} {vs:>7} "
              f"{r['a2a_bytes'] / 1e3:>11.1f} {r['a2a_formula'] / 1e3:>8.1f} {r['psi_rank']:>11,} "
              f"{r['state_bytes'] / 2**20:>9.3f} {r['state_formula'] / 2**20:>8.3f} {mem:>7} {mem_dense:>8} "
              f"{r['dp_sent'] / 1e6:>7.2f} {r['edp_sent'] / 1e6:>7.2f} {r['loss']:>6.3f}")
    print("\nvs ep1: tokens/s, and model-state bytes, relative to the MoE model with every expert on every rank; "
          "vs dense: state relative to the GPT of one MLP per block (equal active parameters at top-1). a2a: bytes "
          "one rank sends per step by all-to-all (dispatch, combine, and both backward), formula 4 (ep-1)/ep E C "
          "hidden x 4 B per MoE layer (specs/collectives.md §All-to-all). state: the TrainState's model-state bytes "
          "per rank; formula: ep_zero_formula with the units' padding (specs/mesh.md §Expert parallelism memory). "
          "dp/edp MB: ring-equivalent bytes one rank sends per step on the data-parallel and expert-data-parallel "
          "groups.")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="small", choices=sorted(MODELS))
    ap.add_argument("--configs", default="ep1,ep2,ep4,dense")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--stage", type=int, default=1, choices=range(4))
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--simulated", action="store_true", help="ranks as threads of this process (no spawn)")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args(argv)
    kinds = args.configs.split(",")
    bad = [k for k in kinds if k not in CONFIGS or args.world % CONFIGS[k]]
    if bad:
        ap.error(f"configs {bad}: choose from {', '.join(CONFIGS)} with an ep size dividing --world {args.world}")
    model_kw = MODELS[args.model]

    print(f"machine: {machine()}")
    print(f"model {args.model} {model_kw}, top-1, capacity factor {CAPACITY_FACTOR}; {args.world} "
          f"{'simulated' if args.simulated else 'gloo'} ranks x 1 thread, ZeRO-{args.stage}, micro-batch {args.micro}, "
          f"median of {args.steps} steps after {args.warmup} warm-up\n")
    run = (args.world, kinds, model_kw, args.micro, args.steps, args.warmup, args.stage)
    with CpuMonitor() as mon:
        if args.simulated:
            from fnzero.testing import simulated_world

            per_rank = simulated_world(run[0], timeout=600).run(lambda comm: measure_all(comm, *run[1:]))
        else:
            from fnzero.testing import run_world

            per_rank = run_world(worker, *run, timeout=1800)
    rows = _rows(per_rank)
    _print(rows, args.world)
    print(f"other cores busy during the run: {mon.other_cores:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "world": args.world, "stage": args.stage, "model": model_kw,
                       "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
