"""Shared by the sequence-parallel tests: small float64 transformers models built from configs, a
padded token batch, the plain-torch reference step, and one sp run of fnzero."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers

import _worlds as W
import fnzero
from fnzero.sharding import make_mesh
from fnzero.testing import seeded, simulated_world

V, S = 51, 16  # vocabulary; tokens per sample (divisible by 2 and 4)


def hf_model(kind: str, kv: int = 2, checkpointing: bool = False, heads: int = 4):
    """Llama, Qwen2, Mistral (sliding window 5 < S), Gemma or GPT-NeoX: `heads` heads of 4 (NeoX: MHA),
    `kv` kv heads."""
    common = dict(vocab_size=V, hidden_size=4 * heads, intermediate_size=22, num_hidden_layers=2,
                  num_attention_heads=heads, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    configs = {
        "llama": lambda: transformers.LlamaConfig(**common, num_key_value_heads=kv),
        "qwen2": lambda: transformers.Qwen2Config(**common, num_key_value_heads=kv),
        "mistral": lambda: transformers.MistralConfig(**common, num_key_value_heads=kv, sliding_window=5),
        "gemma": lambda: transformers.GemmaConfig(**common, num_key_value_heads=kv, head_dim=4),
        "neox": lambda: transformers.GPTNeoXConfig(**common),
        "mixtral": lambda: transformers.MixtralConfig(**common, num_key_value_heads=kv, num_local_experts=4,
                                                      num_experts_per_tok=2),
    }
    with W._INIT_LOCK, seeded(0):  # simulated ranks are threads: one builds at a time
        model = transformers.AutoModelForCausalLM.from_config(configs[kind](), attn_implementation="sdpa").double()
        if kind == "mixtral":
            model.set_experts_implementation("eager")
            for name, m in model.named_modules():
                if name.endswith("mlp.gate"):
                    m.weight.data.normal_(0.0, 1.0)  # routers wide enough that tokens pick different experts
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model


def token_batches(steps: int, k: int, rows: int, padding: str = "right", length: int = S):
    """Per step (ids, mask, labels), each (k, rows, length): row 0 padded on `padding`'s side by 3."""
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        ids = torch.randint(1, V, (k, rows, length), generator=g)
        mask = torch.ones(k, rows, length, dtype=torch.long)
        if padding == "right":
            mask[:, 0, -3:] = 0
        elif padding == "left":
            mask[:, 0, :3] = 0
        out.append((ids, mask, ids.masked_fill(mask == 0, -100)))
    return out


def causal_lm_loss(logits, labels):
    """Mean cross-entropy of the next tokens, computed here in the logits' dtype (transformers' own
    `labels=` loss casts to float32)."""
    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
    return F.cross_entropy(logits.flatten(0, 1), shifted.flatten(), ignore_index=-100)


def reference(kind, steps, k, dp, rows, kv=2, padding="right", heads=4, length=S):
    """Plain torch AdamW on the whole sequence (clip 0.5); the loss is the mean of each dp rank's mean."""
    model = hf_model(kind, kv, heads=heads)
    opt = torch.optim.AdamW(model.parameters(), lr=W.LR, betas=W.BETAS, eps=W.EPS, weight_decay=W.WD)
    losses = []
    for ids, mask, labels in token_batches(steps, k, dp * rows, padding, length):
        opt.zero_grad()
        total = 0.0
        for i in range(k):
            logits = model(input_ids=ids[i], attention_mask=mask[i]).logits
            loss = sum(causal_lm_loss(logits[d * rows:(d + 1) * rows], labels[i, d * rows:(d + 1) * rows])
                       for d in range(dp)) / dp
            (loss / k).backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        losses.append(total / k)
    return {n: p.detach() for n, p in model.named_parameters()}, losses


# With sp > 1 DeepSpeed reduces gradients in seq_parallel_communication_data_type, fp32 by default;
# null keeps the gradients' own dtype, float64 here.
SP_WIRE = {"seq_parallel_communication_data_type": None}


def sp_config(stage, world, sp, k=2, rows=2, extra=None):
    return W.config(stage, k=k, micro=rows, world=world, clip=0.5,
                    extra={"sequence_parallel_size": sp, **SP_WIRE, **(extra or {})})


def run_hf(kind, world, sp, stage, steps=2, k=2, kv=2, rows=2, padding="right", checkpointing=False, extra=None,
           heads=4, length=S):
    """fnzero at sp x dp: each rank's gathered parameters and losses."""
    return simulated_world(world).run(_HFRank(kind, world, sp, stage, steps, k, kv, rows, padding, checkpointing, extra,
                                              heads, length))


class _HFRank:  # a class, not a closure, so that spawned (real gloo) worlds can pickle it
    def __init__(self, *args):
        self.args = args

    def __call__(self, comm):
        kind, world, sp, stage, steps, k, kv, rows, padding, checkpointing, extra, heads, length = self.args
        cfg = sp_config(stage, world, sp, k, rows, extra)
        sm = fnzero.shard(hf_model(kind, kv, checkpointing, heads), config=cfg, comm=comm)
        state = sm.init_state()
        step = fnzero.train_step(lambda p, b: sm.apply(p, **b).loss, cfg)
        tp = cfg.tensor_parallel.size  # the ranks of a tensor-parallel group share their tokens
        d, losses = comm.rank // (tp * sp), []
        for ids, mask, labels in token_batches(steps, k, world // (tp * sp) * rows, padding, length):
            mine = slice(d * rows, (d + 1) * rows)
            micro = [fnzero.shard_sequence({"input_ids": ids[i, mine], "attention_mask": mask[i, mine],
                                            "labels": labels[i, mine]}, sm.sp) for i in range(k)]
            state, m = step(state, micro)
            losses.append(m["loss"])
        return sm.gather(state), losses


def run_gpt(world, sp, stage, steps=2, k=2, extra=None, mesh=False, dtype=torch.float64):
    """fnzero's GPT (4 heads) at sp x dp on the tests' GPT batches; each rank's parameters and losses."""
    return simulated_world(world).run(lambda comm: _gpt_rank(comm, world, sp, stage, None, steps, k, extra, mesh, dtype))


def spawned_sp_cases():
    """World function for 4 real gloo ranks: each rank's results of the Llama at sp 2 x dp 2, ZeRO-3,
    of fnzero's GPT at sp 2 x dp 2, ZeRO-2, with compiled units (aot_eager), and of its 3-head
    variant (a ring of 2) at ZeRO-1."""
    from fnzero.sharding.comm._collectives import ProcessGroupCollectives

    comm = ProcessGroupCollectives()
    llama = _HFRank("llama", 4, 2, 3, 2, 2, 2, 2, "right", False, None, 4, S)(comm)
    jitted = _gpt_rank(comm, 4, 2, 2, {"backend": "aot_eager", "scope": "units"})
    return llama, jitted, _gpt_rank(comm, 4, 2, 1, kind="gpt")


def _gpt_rank(comm, world, sp, stage, jit=None, steps=2, k=2, extra=None, mesh=False, dtype=torch.float64,
              kind="gpt_tp"):
    """One rank of `run_gpt` (fnzero's GPT of tests/_worlds.py: "gpt_tp" 4 heads, "gpt" 3): its gathered
    parameters and losses."""
    dp = world // sp
    cfg = W.config(stage, k=k, micro=2, world=world, clip=0.5,
                   extra={**({} if mesh else {"sequence_parallel_size": sp, **SP_WIRE}), **(extra or {})})
    sm = fnzero.shard(W.make_model(kind, dtype), config=cfg, comm=comm, mesh=make_mesh(comm, sp=sp) if mesh else None)
    state = sm.init_state()

    def loss_fn(params, b):
        x, y, pos = b
        logits = sm.apply(params, x, position_ids=pos)
        total = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
        return sm.sp.loss_share(total, y.numel()) if sm.sp is not None else total / y.numel()

    step = fnzero.train_step(loss_fn, cfg)
    if jit is not None:
        step = fnzero.jit(step, **jit)
    d, losses = comm.rank // sp, []
    for s in range(steps):
        x, y = W.global_batch(kind, s, dp, k, 2, torch.float64)
        state, m = step(state, [fnzero.shard_sequence((x[i, d], y[i, d]), sm.sp) for i in range(k)])
        losses.append(m["loss"])
    return sm.gather(state), losses
