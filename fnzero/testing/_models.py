"""Small models for tests, examples and benchmarks: a GPT (dense, or with MoE layers) and an MLP of any size."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..moe import MoE
from ..sharding import CausalAttention, token_positions

__all__ = ["GPT", "GPTConfig", "GPTEmbedding", "GPTHead", "MLP", "gpt_layers"]


class GPTConfig:
    """Sizes of a GPT: vocabulary, context length, width, depth, heads, MLP ratio, tied head.

    `num_experts` > 0 makes every block's MLP an `fnzero.moe.MoE` of that many experts, each the
    dense MLP's shape (so at k=1 a token meets the dense model's parameters); `moe` holds the
    layer's other arguments (k, ep_size, capacity_factor, drop_tokens, ...): one dict for every
    block, or a list of one per block."""

    def __init__(self, vocab_size=256, seq_len=64, d_model=64, n_layer=2, n_head=4, mlp_ratio=4, tied=False, dropout=0.0,
                 num_experts=0, moe=None):
        if d_model % n_head:
            raise ValueError(f"d_model={d_model} must be divisible by n_head={n_head}")
        self.vocab_size, self.seq_len, self.d_model = vocab_size, seq_len, d_model
        self.n_layer, self.n_head, self.mlp_ratio, self.tied, self.dropout = n_layer, n_head, mlp_ratio, tied, dropout
        self.num_experts = num_experts
        moe = moe if moe is not None else {}
        self.moe = list(moe) if isinstance(moe, (list, tuple)) else [dict(moe)] * n_layer
        if len(self.moe) != n_layer:
            raise ValueError(f"moe gives {len(self.moe)} layers' arguments for n_layer={n_layer} blocks")


class _ExpertMLP(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(c.d_model, c.mlp_ratio * c.d_model)
        self.out = nn.Linear(c.mlp_ratio * c.d_model, c.d_model)

    def forward(self, x):
        return self.out(F.gelu(self.fc(x)))


class _Block(nn.Module):
    def __init__(self, c: GPTConfig, index: int = 0):
        super().__init__()
        self.head_dim = c.d_model // c.n_head
        self.ln1 = nn.LayerNorm(c.d_model)
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model)
        self.proj = nn.Linear(c.d_model, c.d_model)
        self.attn = CausalAttention()  # no parameters: what a sequence axis reaches
        self.ln2 = nn.LayerNorm(c.d_model)
        if c.num_experts:
            self.moe = MoE(c.d_model, _ExpertMLP(c), c.num_experts, **c.moe[index])
        else:
            self.fc = nn.Linear(c.d_model, c.mlp_ratio * c.d_model)
            self.out = nn.Linear(c.mlp_ratio * c.d_model, c.d_model)

    def forward(self, x):
        b, t, _ = x.shape
        # Heads counted from the widths (-1), so a tensor-parallel rank's slice of q|k|v runs as is.
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        shape = (b, t, -1, self.head_dim)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = self.attn(q, k, v)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, -1))
        if hasattr(self, "moe"):  # the layer's l_aux stays on it (`deepspeed_moe.l_aux`)
            return x + self.moe(self.ln2(x))[0]
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A decoder-only transformer (pre-LN, SDPA causal attention, GELU MLP)."""

    def __init__(self, config: GPTConfig | None = None, **kwargs):
        super().__init__()
        c = config or GPTConfig(**kwargs)
        self.config = c
        self.wte = nn.Embedding(c.vocab_size, c.d_model)
        self.wpe = nn.Embedding(c.seq_len, c.d_model)
        self.blocks = nn.ModuleList(_Block(c, i) for i in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        if c.tied:
            self.head.weight = self.wte.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m):
        # Named as Hugging Face's hook, so `fnzero.shard` runs it on a GPT built on the meta device.
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx, position_ids=None):
        pos = position_ids if position_ids is not None else torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class GPTEmbedding(nn.Module):
    """A GPT's first pipeline layer: token and position embeddings."""

    def __init__(self, c: GPTConfig, model: "GPT | None" = None):
        super().__init__()
        if model is not None:  # the model's own modules
            self.wte, self.wpe = model.wte, model.wpe
            return
        self.wte = nn.Embedding(c.vocab_size, c.d_model)
        self.wpe = nn.Embedding(c.seq_len, c.d_model)
        self.apply(GPT._init_weights)

    def forward(self, idx):
        # From this rank's run under sequence parallelism (`token_positions`), else 0, 1, ...
        return self.wte(idx) + self.wpe(token_positions(self.wpe, idx))


class GPTHead(nn.Module):
    """A GPT's last pipeline layer: the final norm and the LM head (logits)."""

    def __init__(self, c: GPTConfig, model: "GPT | None" = None):
        super().__init__()
        if model is not None:  # the model's own modules
            self.ln_f, self.head = model.ln_f, model.head
            return
        self.ln_f = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        self.apply(GPT._init_weights)

    def forward(self, x):
        return self.head(self.ln_f(x))


def gpt_layers(config: GPTConfig | None = None, *, model: "GPT | None" = None, **kwargs) -> list[nn.Module]:
    """fnzero's GPT as pipeline layers: embeddings, the blocks, norm and head (untied), newly
    built, or around `model`'s own modules (then give `PipelineModule(..., names_from=model)` so
    the parameters keep the model's names)."""
    if model is not None:
        return [GPTEmbedding(model.config, model), *model.blocks, GPTHead(model.config, model)]
    c = config or GPTConfig(**kwargs)
    blocks = []
    for i in range(c.n_layer):
        block = _Block(c, i)
        block.apply(GPT._init_weights)
        blocks.append(block)
    return [GPTEmbedding(c), *blocks, GPTHead(c)]


class MLP(nn.Module):
    """Linear layers of the given widths with tanh between them."""

    def __init__(self, sizes: list[int], bias: bool = True):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=bias) for a, b in zip(sizes[:-1], sizes[1:]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x
