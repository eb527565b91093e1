"""Fine-tune a Hugging Face model with fnzero at ZeRO-3: built on the meta device (no rank ever
holds the whole model), loaded from its safetensors shards (each rank reads only its own bytes),
with the model's own gradient checkpointing and bf16, then checkpointed, exported, and reloaded
with transformers' `from_pretrained`.

Run (from the repository root, after the README's setup):

    # ZeRO-3 across 2 ranks on CPU (gloo)
    fnzero launch --nproc-per-node 2 examples/finetune_hf.py
    # your own model directory (any causal LM written by save_pretrained), GPUs (NCCL)
    fnzero launch --nproc-per-node 8 examples/finetune_hf.py --pretrained path/to/model

Without --pretrained, rank 0 first writes a small Llama-architecture model (random weights) with
`save_pretrained` into --out/pretrained, in several shards with their index, so nothing is
downloaded. The text is Python's own documentation, as bytes (token ids 0-255).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import transformers

import fnzero
from fnzero.testing import token_batches

p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
p.add_argument("--pretrained", help="a save_pretrained directory (default: write a small Llama first)")
p.add_argument("--config", default="examples/configs/finetune_zero3.json")
p.add_argument("--out", default="runs/finetune_hf")
p.add_argument("--steps", type=int, default=40)
p.add_argument("--seq-len", type=int, default=64)
p.add_argument("--reentrant", action="store_true", help="reentrant activation checkpointing (default: non-reentrant)")
args = p.parse_args()

dist = fnzero.init_distributed()


def barrier() -> None:
    if dist.world_size > 1:
        torch.distributed.barrier()


# -- the "pretrained" model: a save_pretrained directory -------------------------------------------
pretrained = args.pretrained or os.path.join(args.out, "pretrained")
if args.pretrained is None and dist.rank == 0 and not os.path.exists(os.path.join(pretrained, "config.json")):
    small = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                     tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(small).save_pretrained(pretrained, max_shard_size="500KB")
barrier()

# -- build on the meta device, shard, load the weights into the shards ----------------------------
cfg = fnzero.load_config(args.config, world_size=dist.world_size)
hf_config = transformers.AutoConfig.from_pretrained(pretrained)
with torch.device("meta"):
    model = transformers.AutoModelForCausalLM.from_config(hf_config)
# The model's own layer checkpointing, inside fnzero's sharded forward (either mode works).
ckpt_kwargs = {"use_reentrant": args.reentrant}
model.activation_checkpointing_enable(activation_checkpointing_kwargs=ckpt_kwargs)
model.train()
sm = fnzero.shard(model, config=cfg, device=dist.device)  # units: the model's _no_split_modules layers
state = sm.init_state(pretrained=pretrained)
report = sm.pretrained_report
print(f"rank {dist.rank}: loaded {len(report.loaded)} tensors from {len(report.files)} file(s), "
      f"read {report.bytes_read / 2**20:.2f} MiB", flush=True)


def loss_fn(params, batch):
    # Keyword inputs in, a ModelOutput out: the model shifts the labels itself. No KV cache while
    # training (the model's checkpointing would turn it off, with a warning).
    return sm.apply(params, input_ids=batch["x"], labels=batch["x"], use_cache=False).loss


step = fnzero.train_step(loss_fn, cfg, donate=True)

# -- fine-tune on Python's documentation -----------------------------------------------------------
per_rank = cfg.train_micro_batch_size_per_gpu * cfg.gradient_accumulation_steps
batches = token_batches(per_rank, args.seq_len, seed=1000 + dist.rank)
if dist.rank == 0:
    print(f"fnzero {fnzero.__version__}: {hf_config.model_type} {sm.plan.num_params / 1e6:.2f}M params, "
          f"ZeRO stage {sm.plan.stage}, {cfg.precision}, {dist.world_size} rank(s), {len(sm.plan.units)} units")
t0 = time.perf_counter()
first = None
for i in range(1, args.steps + 1):
    batch = {k: v.to(dist.device) for k, v in next(batches).items()}
    state, m = step(state, batch)
    first = m["loss"] if first is None else first
    if dist.rank == 0 and (i % 10 == 0 or i == args.steps):
        print(f"step {i}: loss {m['loss']:.4f}, lr {m['lr']:.2e}, grad norm {m['grad_norm']:.3f}", flush=True)
elapsed = time.perf_counter() - t0

# -- checkpoint (resumable at any world size), export, reload with transformers -------------------
fnzero.checkpoint.save(os.path.join(args.out, "checkpoint"), state, client_state={"step": args.steps}, config=cfg)
# Every rank calls it; one writes the weights and, from the sharded model's own config, config.json
# and generation_config.json: the directory is a from_pretrained directory as it is.
tuned = os.path.join(args.out, "tuned")
fnzero.checkpoint.export_live(sm, state, tuned, dtype="bf16", max_shard_size="1MB")
probe = next(token_batches(2, args.seq_len, seed=7, split="val"))["x"].to(dist.device)
with torch.no_grad():
    ours = sm.apply(state.params, input_ids=probe).logits.float()  # every rank: stage 3 gathers
if dist.rank == 0:
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tuned).to(dist.device)  # bf16, as config.json says
    with torch.no_grad():
        theirs = reloaded(input_ids=probe).logits.float()
    print(f"done: {args.steps} steps in {elapsed:.1f}s, loss {first:.3f} -> {m['loss']:.3f}")
    print(f"exported {tuned}; from_pretrained logits vs fnzero's: max abs diff "
          f"{(theirs - ours).abs().max().item():.3g}")
