"""Loss curves and per-rank memory of ZeRO stages 0-3 on the example GPT, as a PNG (needs matplotlib:
`pip install -e '.[plot]'`).

    python benchmarks/plot_stages.py                          # 2 ranks, 150 steps -> benchmarks/figures/stages.png
    python benchmarks/plot_stages.py --world 4 --steps 40 --out /tmp/stages.png

For each stage a fresh set of gloo ranks trains the example GPT (`examples/train_gpt.py`'s model,
byte-level, on Python's own documentation) from the same initial weights on the same batches,
and reports its loss per step, its exact model-state bytes per rank (from the state pytree,
`fnzero.memory.model_state_bytes`), the ZeRO formula for them, and peak RSS. The left panel
shows that the four loss curves coincide (the stages compute the same training); the right one
shows what each stage holds per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from _common import machine  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def worker(stage: int, steps: int, micro: int, seq_len: int, d_model: int, layers: int, heads: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import fnzero
    from fnzero.memory import model_state_bytes, peak_rss_bytes, zero_formula
    from fnzero.testing import GPT, token_batches

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cfg = fnzero.load_config({
        "train_micro_batch_size_per_gpu": micro, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 20}},
        # Every stage-3 unit sharded (DeepSpeed keeps units under 1e5 elements whole by default), so
        # the bars compare with the formula exactly.
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }, world_size=world)
    sm = fnzero.shard(GPT(vocab_size=256, seq_len=seq_len, d_model=d_model, n_layer=layers, n_head=heads), config=cfg)
    state = sm.init_state()

    def loss_fn(params, batch):
        return F.cross_entropy(sm.apply(params, batch["x"]).flatten(0, 1), batch["y"].flatten())

    step = fnzero.train_step(loss_fn, cfg, donate=True)
    batches = token_batches(micro, seq_len, seed=rank)
    losses = []
    for _ in range(steps):
        state, m = step(state, next(batches))
        losses.append(m["loss"])
    msb = model_state_bytes(state)
    return {
        "losses": losses, "model_state": msb.total, "formula": zero_formula(sm.plan.num_params, stage, world, False),
        "peak_rss": peak_rss_bytes(), "num_params": sm.plan.num_params,
    }


def worker_all(stages: tuple[int, ...], *args) -> dict:
    """Every stage in this one set of processes (`--one-world`): one start-up instead of four, and
    peak RSS is then the running peak, not each stage's."""
    return {stage: worker(stage, *args) for stage in stages}


def plot(results: dict, world: int, out: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    stages = sorted(results)
    fig, (ax_loss, ax_mem) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [1.4, 1]})
    styles = ["-", "--", "-.", ":"]
    for i, s in enumerate(stages):
        losses = results[s]["losses"]
        ax_loss.plot(range(1, len(losses) + 1), losses, styles[i % 4], lw=1.6, label=f"ZeRO-{s}")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("training loss (mean over ranks)")
    ax_loss.set_title("loss per step: the same training at every stage")
    ax_loss.text(0.02, 0.02, "fp32: all-reduce (ZeRO-0) and reduce-scatter sum in different orders;\n"
                 "that rounding noise grows slowly over the steps", transform=ax_loss.transAxes, fontsize=7,
                 color="0.35")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)

    mib = 2**20
    xs = range(len(stages))
    w = 0.38
    state = [results[s]["model_state"] / mib for s in stages]
    formula = [results[s]["formula"] / mib for s in stages]
    ax_mem.bar([x - w / 2 for x in xs], state, w, label="model state (measured, exact)")
    ax_mem.bar([x + w / 2 for x in xs], formula, w, label="ZeRO formula", alpha=0.6, hatch="//")
    for x, v in zip(xs, state):
        ax_mem.text(x - w / 2, v, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
    rss = [results[s].get("peak_rss_max", results[s]["peak_rss"]) / mib for s in stages]
    ax_mem.set_xticks(list(xs), [f"ZeRO-{s}\nRSS {r:.0f} MiB" for s, r in zip(stages, rss)], fontsize=8)
    ax_mem.set_ylabel("MiB per rank")
    ax_mem.set_title(f"per-rank model state, {world} ranks")
    ax_mem.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--out", default=os.path.join(HERE, "figures", "stages.png"))
    ap.add_argument("--json", help="also write the numbers here")
    ap.add_argument("--from-json", help="redraw from numbers a previous run wrote with --json (no training)")
    ap.add_argument("--one-world", action="store_true",
                    help="train every stage in one set of processes (faster start; peak RSS is then cumulative)")
    args = ap.parse_args()

    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        plot({int(k): v for k, v in saved["results"].items()}, saved["world"], args.out, saved["title"])
        print(f"wrote {args.out}")
        return

    import fnzero
    from fnzero.testing import run_world

    results = {}
    shape = (args.steps, args.micro, args.seq_len, args.d_model, args.layers, args.heads)
    together = run_world(worker_all, args.world, (0, 1, 2, 3), *shape, timeout=3600) if args.one_world else None
    for stage in (0, 1, 2, 3):
        if together is not None:
            ranks = [r[stage] for r in together]
        else:
            ranks = run_world(worker, args.world, stage, *shape, timeout=3600)
        r0 = ranks[0]
        results[stage] = {**r0, "peak_rss_max": max(r["peak_rss"] for r in ranks)}
        print(f"ZeRO-{stage}: loss {r0['losses'][0]:.3f} -> {r0['losses'][-1]:.3f}; model state "
              f"{r0['model_state'] / 2**20:.2f} MiB/rank (formula {r0['formula'] / 2**20:.2f}); peak RSS "
              f"{results[stage]['peak_rss_max'] / 2**20:.0f} MiB", flush=True)
    psi = results[0]["num_params"]
    title = (f"fnzero {fnzero.__version__}: GPT {psi / 1e6:.2f}M params on pydoc text, fp32 AdamW, {args.world} gloo "
             f"ranks, micro-batch {args.micro}x{args.seq_len} - {machine().split(';')[0]}")
    plot(results, args.world, args.out, title)
    print(f"wrote {args.out}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "world": args.world, "title": title, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
