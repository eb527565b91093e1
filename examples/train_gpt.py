"""Train a small byte-level GPT on Python's own documentation with fnzero's ZeRO sharding.

Run (from the repository root, after the README's setup):

    # one process
    python examples/train_gpt.py --config examples/configs/zero3.json
    # ZeRO-3 across 2 ranks on CPU (gloo)
    fnzero launch --nproc-per-node 2 examples/train_gpt.py --config examples/configs/zero3.json
    # GPUs (NCCL), one rank per GPU
    fnzero launch --nproc-per-node 8 examples/train_gpt.py --config examples/configs/bf16.json
    # tensor parallelism: each layer split over 2 ranks, ZeRO-1 over the rest (specs/mesh.md)
    fnzero launch --nproc-per-node 4 examples/train_gpt.py --config examples/configs/tp2_zero1.json
    # pipeline parallelism: the layers cut into 2 stages, 1F1B over 4 micro-batches (specs/mesh.md)
    fnzero launch --nproc-per-node 2 examples/train_gpt.py --config examples/configs/pp2_zero1.json
    # sequence parallelism: each pair of ranks shares every sample's tokens (Ulysses; specs/mesh.md)
    fnzero launch --nproc-per-node 2 examples/train_gpt.py --config examples/configs/sp2_zero3.json

The training step is a pure function `step(state, batch) -> (state, metrics)`; logging happens
outside it. At the end the run saves a checkpoint under --checkpoint-dir and exports the weights as
safetensors; run the same command again, or any command above (another world size, stage, the
tensor-parallel or the pipeline config), and it resumes from that checkpoint and trains --steps more.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

import fnzero
from fnzero.memory import model_state_bytes, peak_rss_bytes
from fnzero.monitor import Monitor
from fnzero.sharding import MeshShape
from fnzero.testing import GPT, gpt_layers, token_batches

p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
p.add_argument("--config", default="examples/configs/zero3.json")
p.add_argument("--steps", type=int, default=200)
p.add_argument("--seq-len", type=int, default=64)
p.add_argument("--d-model", type=int, default=128)
p.add_argument("--layers", type=int, default=4)
p.add_argument("--heads", type=int, default=4)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--checkpoint-dir", default="runs/train_gpt",
               help="save a checkpoint here at the end, and resume from it when it exists ('' = neither)")
p.add_argument("--export", default="model.safetensors",
               help="file name, inside --checkpoint-dir, for the exported bf16 weights ('' = no export)")
p.add_argument("--jit", nargs="?", const="units", choices=["units", "loss", "step"],
               help="compile with torch.compile (fnzero.jit; ~30 s the first time): 'units' (the default) each "
                    "block's forward and backward, compiled once for all blocks; 'loss' the whole forward and "
                    "backward as one graph; 'step' the whole step as one graph (stages 0-2)")
p.add_argument("--jit-backend", default="inductor", choices=["inductor", "aot_eager", "eager"],
               help="torch.compile backend for --jit (default inductor; aot_eager traces the same graphs "
                    "without generating code, in seconds)")
args = p.parse_args()

# -- processes, config, model --------------------------------------------------------------------
dist = fnzero.init_distributed()
torch.manual_seed(args.seed)  # same initial weights on every rank
cfg = fnzero.load_config(args.config, world_size=dist.world_size)
sizes = dict(vocab_size=256, seq_len=args.seq_len, d_model=args.d_model, n_layer=args.layers, n_head=args.heads)
stages = cfg.pipeline.size or 1


def lm_loss(logits, y):
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


model = GPT(**sizes)
num_params = sum(p.numel() for p in model.parameters())
if stages > 1:  # the GPT as layers (embeddings, blocks, norm + head), cut into stages; each rank keeps its own.
    # names_from=model: the layers' parameters keep the model's names ('blocks.0.ln1.weight'), so this
    # run's checkpoints and the plain or tensor-parallel runs' load into each other.
    pipe = fnzero.PipelineModule(gpt_layers(model=model), lm_loss, names_from=model)
    sm = fnzero.shard(pipe, config=cfg, device=dist.device)
    loss_fn = fnzero.pipeline_loss(sm, "1f1b")  # micro-batches (gradient_accumulation_steps) flow through the stages
else:
    sm = fnzero.shard(model, config=cfg, device=dist.device)

    def loss_fn(params, batch):
        if sm.sp is None:
            return lm_loss(sm.apply(params, batch[0]), batch[1])
        # sequence parallelism: this rank's run of the tokens (the group reads the same batch), and its
        # share of the group's mean loss (specs/mesh.md §Sequence)
        x, y, positions = fnzero.shard_sequence(batch, sm.sp)
        logits = sm.apply(params, x, position_ids=positions)
        return sm.sp.loss_share(F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum"), y.numel())

state = sm.init_state()
mem0 = peak_rss_bytes()

# donate=True: the old state's buffers are reused by the new one, so the model state exists once.
step = fnzero.train_step(loss_fn, cfg, donate=True)
if args.jit:
    step = fnzero.jit(step, scope=args.jit, backend=args.jit_backend)  # same step; graph breaks, if any, are warned once with their reason

# -- resume: a checkpoint loads into this run's layout, whatever world size or stage saved it -------
start = 0
if args.checkpoint_dir and os.path.exists(os.path.join(args.checkpoint_dir, "latest")):
    try:
        state, client = fnzero.checkpoint.load(args.checkpoint_dir, like=state)
    except fnzero.FnzeroError as e:
        sys.exit(f"cannot resume from {args.checkpoint_dir}: {e}\n(a different model? pass another --checkpoint-dir)")
    start = int(client["step"])
    if dist.rank == 0:
        print(f"resumed from {args.checkpoint_dir} at step {start}")

# -- data: each data-parallel rank reads its own stream of windows (where the previous run stopped);
# the ranks of one tensor-parallel group, of one sequence-parallel group, and the stages of one
# pipeline read the same one --------------------------------------------------------------------
per_rank = cfg.train_micro_batch_size_per_gpu * cfg.gradient_accumulation_steps
sp = cfg.sequence_parallel_size
dp_rank = MeshShape(dp=cfg.world_size * sp, tp=cfg.tensor_parallel.size, pp=stages, sp=sp).coords(dist.rank)["batch_dp"]
batches = token_batches(per_rank, args.seq_len, seed=args.seed * 1000 + dp_rank)
for _ in range(start):
    next(batches)

if dist.rank == 0:
    tp = f" x tensor-parallel {cfg.tensor_parallel.size}" if cfg.tensor_parallel.size > 1 else ""
    tp += f" x {stages} pipeline stages" if stages > 1 else ""
    tp += f" x sequence-parallel {sp}" if sp > 1 else ""
    print(f"fnzero {fnzero.__version__}: GPT {num_params / 1e6:.2f}M params, "
          f"ZeRO stage {sm.plan.stage}, {cfg.precision}, {dist.world_size} rank(s){tp} on {dist.device}, "
          f"{len(sm.plan.units)} units")

tokens_per_step = per_rank * args.seq_len * cfg.world_size  # data-parallel ranks
t0 = time.perf_counter()
first_loss = None
# Logging happens outside the pure step: the Monitor reads steps_per_print, csv_monitor,
# tensorboard, memory_breakdown, flops_profiler and wall_clock_breakdown from the config.
with Monitor.from_config(cfg, rank=dist.rank, world_size=dist.world_size, tokens_per_step=tokens_per_step,
                         total_steps=args.steps) as mon:
    for i in range(start + 1, start + args.steps + 1):
        b = next(batches)
        batch = (b["x"].to(dist.device), b["y"].to(dist.device))  # (inputs, labels)
        if mon.should_profile(i) and stages == 1:  # every rank: the forward gathers shards at stage 3
            mon.profile_flops(loss_fn, state.params, fnzero.split_micro_batches(batch, cfg.gradient_accumulation_steps)[0])
        state, m = step(state, batch)
        first_loss = m["loss"] if first_loss is None else first_loss
        mon.log(i, m, state=state)

elapsed = time.perf_counter() - t0
if args.checkpoint_dir:  # every rank writes its shards; loadable at any world size
    fnzero.checkpoint.save(args.checkpoint_dir, state, client_state={"step": start + args.steps}, config=cfg)
    # Every rank calls either export; one rank writes, and every rank gets the paths (or the error).
    if args.export and stages == 1:
        fnzero.checkpoint.export_live(sm, state, os.path.join(args.checkpoint_dir, args.export), dtype="bf16")
    elif args.export:  # a pipeline's weights are on several ranks: export what they saved
        fnzero.checkpoint.export(args.checkpoint_dir, os.path.join(args.checkpoint_dir, args.export), dtype="bf16")
msb = model_state_bytes(state)
print(f"rank {dist.rank}: model state {msb.total / 2**20:.2f} MiB (params {msb.params / 2**20:.2f}, "
      f"master {msb.master / 2**20:.2f}, optimizer {msb.optimizer / 2**20:.2f}, grads {msb.grads / 2**20:.2f}); "
      f"peak RSS {peak_rss_bytes() / 2**20:.0f} MiB", flush=True)
if dist.rank == 0:
    print(f"done: {args.steps} steps in {elapsed:.1f}s, loss {first_loss:.3f} -> {m['loss']:.3f}")
    if args.checkpoint_dir:
        print(f"saved checkpoint {args.checkpoint_dir} (step {start + args.steps})"
              + (f", weights {os.path.join(args.checkpoint_dir, args.export)}" if args.export else ""))
    if args.jit:
        first = step.compiles[0].first_call_s if step.compiles else float("nan")
        print(f"jit: first step (trace + compile) {first:.1f}s, graph breaks: {len(step.graph_breaks)}"
              + (f", fell back to eager: {step.fallback_reason}" if step.fallback_reason else ""))
