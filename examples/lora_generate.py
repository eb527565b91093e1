"""LoRA on a frozen base at ZeRO-3, sampling as it trains, adapters out in PEFT's format.

A small Llama is written by `save_pretrained` (random weights, nothing downloaded), built again on
the meta device, wrapped with PEFT's LoRA (r=16 on every linear layer; the LM head, which a random
base cannot do without, trained as PEFT's `modules_to_save`), and sharded at ZeRO-3: the frozen
base is sharded like the adapters (each rank holds its part of every layer), and only the adapters
have optimizer state. It trains on Python's own documentation with the model's gradient
checkpointing, prints a seeded sample from the sharded model every --sample-every steps, exports
the adapters as `adapter_model.safetensors` + `adapter_config.json`, and shows that
`PeftModel.from_pretrained` + transformers' `generate` give the same tokens as `fnzero.generate`,
greedy and seeded sampling.

Run (from the repository root, after the README's setup):

    fnzero launch --nproc-per-node 2 examples/lora_generate.py
"""

from __future__ import annotations

import argparse
import contextlib
import os
import warnings

import peft
import torch
import torch.nn.functional as F
import transformers

import fnzero
from fnzero.testing import token_batches

p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
p.add_argument("--config", default="examples/configs/lora_zero3.json")
p.add_argument("--out", default="runs/lora_generate")
p.add_argument("--steps", type=int, default=60)
p.add_argument("--sample-every", type=int, default=20)
p.add_argument("--new-tokens", type=int, default=24)
p.add_argument("--seq-len", type=int, default=64)
p.add_argument("--rank", type=int, default=16, help="LoRA rank")
p.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
               help="the linear layers that get adapters (comma-separated)")
args = p.parse_args()
transformers.logging.disable_progress_bar()

dist = fnzero.init_distributed()
base_dir = os.path.join(args.out, "base")
if dist.rank == 0 and not os.path.exists(os.path.join(base_dir, "config.json")):
    small = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                     tie_word_embeddings=False, pad_token_id=0, eos_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(small).save_pretrained(base_dir)
if dist.world_size > 1:
    torch.distributed.barrier()

# -- the base on the meta device, LoRA on its linear layers, ZeRO-3, the base's weights read per rank -
cfg = fnzero.load_config(args.config, world_size=dist.world_size)
with torch.device("meta"):
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(base_dir))
model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
lora = peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=args.targets.split(","), lora_dropout=0.0,
                       task_type="CAUSAL_LM", modules_to_save=["lm_head"])


@contextlib.contextmanager
def peft_quirk():
    """PeftModel's constructor (peft 0.21.2, its newest release) reads transformers' deprecated
    `is_gradient_checkpointing`: that one FutureWarning, peft's to fix, is left out."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        yield


with peft_quirk():
    model = peft.get_peft_model(model, lora)
sm = fnzero.shard(model, config=cfg, device=dist.device)
state = sm.init_state(pretrained=base_dir)  # the adapters keep PEFT's initialisation (lora_B = 0)
held = fnzero.memory.model_state_bytes(state)
print(f"rank {dist.rank}: model state {held.total / 2**20:.2f} MiB, of which its part of the frozen base "
      f"{held.frozen / 2**20:.2f} MiB (the whole base: {sm.plan.num_frozen * 4 / 2**20:.2f} MiB); adapters "
      f"{sm.plan.num_params} parameters", flush=True)


def loss_fn(params, batch):
    # No KV cache while training (the model's checkpointing would turn it off, with a warning).
    logits = sm.apply(params, input_ids=batch["x"], use_cache=False).logits
    return F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten())


# Two prompts of different lengths, left-padded as decoder-only generation wants them.
prompts = [b"The Python ", b"A list is a "]
width = max(map(len, prompts))
input_ids = torch.tensor([[0] * (width - len(t)) + list(t) for t in prompts], device=dist.device)
attention_mask = (torch.arange(width, device=dist.device) >= torch.tensor(
    [width - len(t) for t in prompts], device=dist.device)[:, None]).long()


def sample(**how) -> torch.Tensor:
    # Every rank calls it (stage 3 gathers one layer at a time); all get the same tokens.
    return fnzero.generate(sm, state.params, input_ids, attention_mask, max_new_tokens=args.new_tokens,
                           pad_token_id=0, **how)


# Seeded sampling, drawn as transformers' generate() draws (temperature, then top-k, then softmax).
SAMPLING = {"do_sample": True, "temperature": 0.8, "top_k": 20}


def show(tokens: torch.Tensor) -> str:
    return " | ".join(repr(bytes(row[width:].tolist()).decode("utf-8", "replace")) for row in tokens)


step = fnzero.train_step(loss_fn, cfg)
batches = token_batches(cfg.train_micro_batch_size_per_gpu, args.seq_len, seed=1000 + dist.rank)
for i in range(1, args.steps + 1):
    state, m = step(state, {k: v.to(dist.device) for k, v in next(batches).items()})
    if i % args.sample_every == 0 or i == args.steps:
        tokens = sample(**SAMPLING, generator=torch.Generator(dist.device).manual_seed(i))
        if dist.rank == 0:
            print(f"step {i}: loss {m['loss']:.4f}; sampled: {show(tokens)}", flush=True)

# -- adapters out in PEFT's format, and transformers' generate from them ----------------------------
adapter_dir = os.path.join(args.out, "adapter")
fnzero.checkpoint.export_adapters(sm, state, adapter_dir)
greedy, sampled = sample(do_sample=False), sample(**SAMPLING, generator=torch.Generator(dist.device).manual_seed(0))
if dist.rank == 0:
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
    with peft_quirk():
        tuned = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
    prompt = {"input_ids": input_ids.cpu(), "attention_mask": attention_mask.cpu(), "pad_token_id": 0,
              "max_new_tokens": args.new_tokens}
    with torch.no_grad():
        hf_greedy = tuned.generate(**prompt, do_sample=False)
        torch.manual_seed(0)  # transformers draws from torch's global generator
        hf_sampled = tuned.generate(**prompt, **SAMPLING)
    print(f"exported {adapter_dir}: {sorted(os.listdir(adapter_dir))}")
    print(f"greedy: {show(greedy)}")
    print(f"PeftModel.from_pretrained + transformers' generate give fnzero.generate's tokens: greedy "
          f"{torch.equal(hf_greedy, greedy.cpu())}, seeded sampling {torch.equal(hf_sampled, sampled.cpu())}")
