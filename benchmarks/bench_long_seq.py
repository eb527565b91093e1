"""Sequence parallelism (Ulysses) against sp 1 in one invocation: for a fixed per-rank activation
budget, the longest sequence that trains at each sp, its step time, and the all-to-all bytes
against their formulas (`specs/mesh.md` §Sequence, §Sequence memory).

    python benchmarks/bench_long_seq.py                          # fnzero's GPT, 32 MiB per rank, sp 1, 2, 4
    python benchmarks/bench_long_seq.py --memory 64MiB --sp 1,2,4,8 --steps 5
    python benchmarks/bench_long_seq.py --quick                  # 8 MiB, 1 step: about a minute on 2 cores

Ranks are threads of one process (`fnzero.testing.simulated_world`): the bytes autograd saves are
counted per thread (torch's saved-tensor hooks are thread-local), so each rank's activation bytes are
its own, and the ranks start in milliseconds where spawned gloo ranks would each import torch on a
small machine. What threads cannot give: per-rank RSS (one process; its peak is printed once, for
all ranks together) and a speed-up (the sp ranks share this machine's cores; the step-time ratio
shows the exchange's overhead and the work per rank, not what sp GPUs would do).

For each sp, a bisection over lengths (multiples of sp) finds the longest sequence whose measured
saved bytes (one micro-batch's forward and loss, the most of any rank; `fnzero.testing.
count_saved_bytes` on the model routed as `fnzero.shard` routes it) fit `--memory`; the formula's
`fnzero.memory.activation_bytes` is printed beside it. At that length (and at sp 1's) fnzero's own
step trains it (`fnzero.shard` with `sequence_parallel_size`, ZeRO-1, fp32 AdamW), timed after a
warm-up step (the slowest rank's median), and one forward and backward counts the bytes each rank
sends by all-to-all against 2 x layers x `fnzero.memory.ulysses_bytes`. The goal: sp x sp 1's
length x 0.9 or more.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from _common import CpuMonitor, machine, median  # noqa: E402

MODEL = dict(vocab_size=256, seq_len=1 << 16, d_model=64, n_layer=2, n_head=4)  # seq_len: the position table


def _model():
    from fnzero.testing import GPT, seeded

    with seeded(0):  # every rank builds the same weights
        return GPT(**MODEL)


def _batch(length: int):
    import torch

    g = torch.Generator().manual_seed(length)
    ids = torch.randint(0, MODEL["vocab_size"], (1, length + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _local(comm, sp: int, length: int):
    """This rank's run of the batch's tokens and their positions."""
    import torch

    x, y = _batch(length)
    lo, hi = comm.rank * length // sp, (comm.rank + 1) * length // sp
    return x[:, lo:hi].clone(), y[:, lo:hi].clone(), torch.arange(lo, hi)


def _saved_and_sent(comm, sp: int, length: int, backward: bool = False) -> tuple[int, int]:
    """(the most saved bytes of any rank for one forward and loss, this rank's all-to-all bytes sent
    in it, and in backward too when asked), on a plain GPT routed over the sp ranks."""
    import torch
    import torch.nn.functional as F

    from fnzero.sharding import RecordingCollectives
    from fnzero.sharding.sp import split_for_sp
    from fnzero.testing import count_saved_bytes

    model, recorder = _model(), RecordingCollectives(comm)
    if sp > 1:
        split_for_sp(model, recorder)
    x, y, pos = _local(comm, sp, length)
    with count_saved_bytes(exclude=model.parameters()) as saved:
        loss = F.cross_entropy(model(x, position_ids=pos).flatten(0, 1), y.flatten(), reduction="sum")
    if backward:
        loss.backward()
    sent = sum(r.bytes for r in recorder.records if r.op == "all_to_all")
    mine = torch.tensor([saved.bytes], dtype=torch.int64)
    most = int(comm.all_gather(mine).max()) if sp > 1 else saved.bytes  # every rank decides alike
    return most, sent


def _longest(comm, sp: int, memory: int) -> int:
    """Bisection over lengths in units of sp tokens: the longest whose measured bytes fit `memory`."""
    lo, hi = 0, 1
    while _saved_and_sent(comm, sp, hi * sp)[0] <= memory:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _saved_and_sent(comm, sp, mid * sp)[0] <= memory else (lo, mid)
    return lo * sp


def _step_times(comm, sp: int, length: int, steps: int, warmup: int) -> list[float]:
    """fnzero's own training step at `length` tokens over the sp ranks: seconds per step."""
    import torch.nn.functional as F

    import fnzero

    cfg = fnzero.load_config({
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1},
        "sequence_parallel_size": sp}, world_size=sp)
    sm = fnzero.shard(_model(), config=cfg, comm=comm)
    state = sm.init_state()

    def loss_fn(params, b):
        x, y, pos = b
        total = F.cross_entropy(sm.apply(params, x, position_ids=pos).flatten(0, 1), y.flatten(), reduction="sum")
        return sm.sp.loss_share(total, y.numel()) if sm.sp is not None else total / y.numel()

    step = fnzero.train_step(loss_fn, cfg)
    x, y = _batch(length)
    batch = [fnzero.shard_sequence((x, y), sm.sp)] if sm.sp is not None else [(x, y, None)]
    times = []
    for i in range(warmup + steps):
        if sp > 1:
            comm.barrier()
        t0 = time.perf_counter()
        state, m = step(state, batch)
        assert m["loss"] == m["loss"], f"sp {sp}, {length} tokens: the loss is not a number"
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def _run_sp(sp: int, memory: int, base_len: int | None, steps: int, warmup: int) -> dict:
    from fnzero.memory import TransformerShape, activation_bytes, ulysses_bytes
    from fnzero.testing import GPTConfig, simulated_world

    shape = TransformerShape.from_config(GPTConfig(**MODEL))

    def rank(comm):
        longest = _longest(comm, sp, memory)
        saved, _ = _saved_and_sent(comm, sp, longest)
        _, sent = _saved_and_sent(comm, sp, longest, backward=True)
        own = _step_times(comm, sp, longest, steps, warmup)
        base = base_len // sp * sp if base_len else longest  # sp 1's length, cut to a multiple of sp
        same = _step_times(comm, sp, base, steps, warmup) if base != longest else own
        return longest, saved, sent, own, same

    results = simulated_world(sp, timeout=600).run(rank)
    longest, saved, sent, _, _ = results[0]
    own = median([max(r[3][i] for r in results) for i in range(steps)])  # the slowest rank, per step
    same = median([max(r[4][i] for r in results) for i in range(steps)])
    formula = activation_bytes(shape, seq_len=longest, sp=sp, dtype="fp32")
    return {"sp": sp, "longest": longest, "saved_bytes": saved, "formula_bytes": formula.saved,
            "all_to_all_bytes": sent,
            "all_to_all_formula": 2 * shape.layers * ulysses_bytes(shape, seq_len=longest, sp=sp, dtype="fp32"),
            "step_s": own, "step_s_at_base_len": same, "tokens_per_s": longest / own}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--memory", default="32MiB", help="per-rank activation budget (plan's SIZE syntax; default 32MiB)")
    p.add_argument("--sp", default="1,2,4", help="sequence-parallel sizes, comma-separated; the first is the baseline")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="8 MiB, 1 timed step")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON")
    args = p.parse_args(argv)
    from fnzero.memory import format_bytes, parse_bytes, peak_rss_bytes

    memory = parse_bytes("8MiB" if args.quick and args.memory == "32MiB" else args.memory)
    steps = 1 if args.quick else args.steps
    sizes = [int(s) for s in args.sp.split(",")]
    print(f"bench_long_seq: fnzero GPT {MODEL}, fp32, micro-batch 1, per-rank activation budget "
          f"{format_bytes(memory)}; ranks are threads (simulated_world)\n  {machine()}")
    rows, base = [], None
    with CpuMonitor() as cpu:
        for sp in sizes:
            row = _run_sp(sp, memory, base["longest"] if base else None, steps, args.warmup)
            base = base or row
            rows.append(row)
    print(f"  {'sp':>3} {'longest':>8} {'x sp1':>6} {'goal':>6} {'saved/rank':>11} {'formula':>11} "
          f"{'a2a/rank':>10} {'formula':>10} {'step':>8} {'x sp1':>6} {'@sp1 len':>9} {'x sp1':>6} {'tok/s':>8}")
    for r in rows:
        ratio = r["longest"] / base["longest"]
        print(f"  {r['sp']:>3} {r['longest']:>8,} {ratio:>6.2f} {0.9 * r['sp']:>6.1f} "
              f"{format_bytes(r['saved_bytes']):>11} {format_bytes(r['formula_bytes']):>11} "
              f"{format_bytes(r['all_to_all_bytes']) if r['sp'] > 1 else '-':>10} "
              f"{format_bytes(r['all_to_all_formula']) if r['sp'] > 1 else '-':>10} "
              f"{r['step_s']:>7.3f}s {r['step_s'] / base['step_s']:>6.2f} {r['step_s_at_base_len']:>8.3f}s "
              f"{r['step_s_at_base_len'] / base['step_s']:>6.2f} {r['tokens_per_s']:>8,.0f}")
        r["goal_met"] = ratio >= 0.9 * r["sp"]
    missed = [r["sp"] for r in rows if not r["goal_met"]]
    print(f"  longest: measured saved bytes (forward + loss) <= budget; goal: >= 0.9 x sp x sp 1's "
          f"({'met' if not missed else 'missed at sp ' + ', '.join(map(str, missed))}). a2a: bytes one rank sends "
          f"by all-to-all in one forward and backward; step: the slowest rank's median at its own longest length, "
          f"'@sp1 len' at sp 1's (down to a multiple of sp). Process peak RSS (all ranks together): {format_bytes(peak_rss_bytes())}; "
          f"other load on this machine during the run: {cpu.other_cores:.2f} cores")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "memory": memory, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
