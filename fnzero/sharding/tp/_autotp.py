"""AutoTP: split a model's layers over the tensor-parallel ranks by a plan, a list of `TPRule`s: the
config's `partition_config.layer_specs` first, then the built-in `PLANS` (`specs/mesh.md` §AutoTP)."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch
from torch import nn

from ..._errors import ConfigError, ShardingError
from ._layout import ParamSplit, TPLayout
from ._modules import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

__all__ = ["TPRule", "builtin_plan", "parallelize", "rules_from_config"]


@dataclasses.dataclass(frozen=True)
class TPRule:
    """Modules whose name matches `pattern` (re.fullmatch) are split as `style`."""

    pattern: str
    style: str  # column | row | vocab | head | skip
    blocks: int = 1


_H = r"(?:.*\.)?"  # any prefix (a base model inside a *ForCausalLM, or none)
PLANS: dict[str, list[TPRule]] = {
    "fnzero-gpt": [
        TPRule(r"blocks\.\d+\.qkv", "column", 3), TPRule(r"blocks\.\d+\.proj", "row"),
        TPRule(r"blocks\.\d+\.fc", "column"), TPRule(r"blocks\.\d+\.out", "row"),
        TPRule("wte", "vocab"), TPRule("head", "head"),
    ],
    "gpt2": [
        TPRule(_H + r"h\.\d+\.attn\.c_attn", "column", 3), TPRule(_H + r"h\.\d+\.attn\.c_proj", "row"),
        TPRule(_H + r"h\.\d+\.mlp\.c_fc", "column"), TPRule(_H + r"h\.\d+\.mlp\.c_proj", "row"),
        TPRule(_H + "wte", "vocab"), TPRule("lm_head", "head"),
    ],
    "llama": [
        TPRule(_H + r"layers\.\d+\.self_attn\.[qkv]_proj", "column"), TPRule(_H + r"layers\.\d+\.self_attn\.o_proj", "row"),
        TPRule(_H + r"layers\.\d+\.mlp\.(gate|up)_proj", "column"), TPRule(_H + r"layers\.\d+\.mlp\.down_proj", "row"),
        TPRule(_H + "embed_tokens", "vocab"), TPRule("lm_head", "head"),
    ],
}
# Same projections, no per-head weights (Qwen3's q_norm/k_norm would need their gradients summed
# over the ranks: not in the plan, so Qwen3 takes layer_specs or is refused).
ALIASES = {"mistral": "llama", "qwen2": "llama"}


def model_kind(model: nn.Module) -> str | None:
    """The built-in plan's name for `model`, or None."""
    if type(model).__name__ == "GPT" and type(model).__module__.startswith("fnzero."):
        return "fnzero-gpt"
    mt = getattr(getattr(model, "config", None), "model_type", None)
    return ALIASES.get(mt, mt) if ALIASES.get(mt, mt) in PLANS else None


def builtin_plan(model: nn.Module, preset: str | None = None) -> list[TPRule]:
    """The built-in rules for `model` (or for `preset`, DeepSpeed's preset_model), or []."""
    kind = ALIASES.get(preset, preset) if preset is not None else model_kind(model)
    return list(PLANS.get(kind or "", []))


def rules_from_config(tp_cfg: Any, model: nn.Module) -> list[TPRule]:
    """The rules a `tensor_parallel` block gives for `model`: its `partition_config.layer_specs` first,
    then the built-in plan unless `use_default_specs` is false."""
    rules: list[TPRule] = []
    pc = getattr(tp_cfg, "partition_config", None)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if pc is not None:
        for spec in pc.layer_specs:
            if spec.model_types and model_type not in spec.model_types:
                continue
            blocks = 1
            if spec.shape:
                blocks = int(spec.shape[0]) if spec.shape[0] != -1 else 1
            for p in spec.patterns:
                rules.append(TPRule(_module_pattern(p), spec.partition_type, blocks))
    if pc is None or pc.use_default_specs:
        rules += builtin_plan(model, getattr(tp_cfg, "preset_model", None))
    return rules


def _module_pattern(param_pattern: str) -> str:
    """A DeepSpeed layer-spec pattern (over parameter names, searched) as a module-name pattern."""
    p = param_pattern
    for suffix in (r"\.weight$", r"\.weight", ".weight$", ".weight"):
        if p.endswith(suffix):
            p = p[: -len(suffix)]
            break
    p = p[:-1] if p.endswith("$") else p
    return p if p.startswith((".*", "^")) else ".*" + p


def check_heads(model: nn.Module, tp: int, key_name: str = "tensor_parallel.autotp_size") -> None:
    """A ConfigError naming the numbers when `tp` does not divide the attention (or key/value)
    heads or the hidden size of `model`'s config; `key_name`: the config key that asked for `tp`."""
    c = getattr(model, "config", None)
    for key in ("num_attention_heads", "num_key_value_heads", "n_head", "hidden_size", "d_model"):
        n = getattr(c, key, None)
        if isinstance(n, int) and n % tp:
            raise ConfigError(f"{key_name} {tp} does not divide the model's {key} {n}: each rank "
                              f"must hold whole attention heads (choose a size that divides {n})")  # fmt: skip


def parallelize(model: nn.Module, rules: list[TPRule], comm, *, vocab_parallel: bool | None = None) -> TPLayout:
    """Replace, in place, each module a rule matches with its tensor-parallel form holding this rank's
    slices (tied parameters stay tied); returns the layout of every split parameter."""
    tp, rank = comm.world_size, comm.rank
    check_heads(model, tp)
    check_group_agrees(model, comm)
    names = {id(p): [] for p in model.parameters()}
    for n, p in model.named_parameters(remove_duplicate=False):
        names[id(p)].append(n)
    heads = [n for n, _ in model.named_modules() if _match(rules, n) is not None and _match(rules, n).style == "head"]
    vp = _vocab_parallel(model, vocab_parallel, heads)
    splits: dict[str, ParamSplit] = {}
    done: dict[int, nn.Parameter] = {}  # full parameter id -> this rank's slice (ties)
    for name, module in list(model.named_modules()):
        rule = _match(rules, name)
        if rule is None or rule.style == "skip":
            continue
        new = _split_module(name, module, rule, comm, vp, done, splits, names)
        if new is not None:
            _set_submodule(model, name, new)
    head = next((f"{h}.weight" for h in heads if f"{h}.weight" in splits), None) if vp else None
    layout = TPLayout(tp, rank, splits, comm, head)
    if head is not None:
        _use_parallel_loss(model, layout)
    return layout


def check_group_agrees(model: nn.Module, comm) -> None:
    """Refuse, naming them, ranks of a tensor-parallel group whose model copies differ (they would
    train a patchwork): one small all-gather of every parameter's checksum (`specs/mesh.md` §AutoTP)."""
    params = [p for _, p in model.named_parameters() if not p.is_meta]
    if comm.world_size == 1 or not params:
        return
    from ..comm import checksum

    mine = torch.stack([checksum(p.detach().cpu()) for p in params]).reshape(-1)
    every = comm.all_gather(mine).view(comm.world_size, -1)
    bad = [r for r in range(1, comm.world_size) if not torch.equal(every[r], every[0])]
    if bad:
        raise ShardingError(
            f"the ranks of a tensor-parallel group built different models: tp rank(s) {bad} differ from tp rank 0, "
            "and each cuts its slices from its own copy. Build the model under the same seed on every rank "
            "(torch.manual_seed(seed) before constructing it), or on the meta device"
        )


def _match(rules: list[TPRule], name: str) -> TPRule | None:
    for r in rules:
        if re.fullmatch(r.pattern, name):
            return r
    return None


def _vocab_parallel(model: nn.Module, asked: bool | None, heads: list[str]) -> bool:
    """Split the vocabulary when asked; by default where the loss is the model's own (a Hugging
    Face causal LM, whose loss fnzero replaces with the vocabulary-parallel one)."""
    if asked is not None:
        return asked
    return bool(heads) and hasattr(model, "loss_function") and getattr(model, "config", None) is not None


def _check_torch_forward(name: str, module: nn.Module, rule: TPRule) -> None:
    """A split layer computes what torch's Linear or Embedding computes. A subclass with a forward
    of its own would lose what that forward adds (Gemma's embedding multiplies its output by
    sqrt(hidden): split by a Llama plan, its logits were silently wrong), so it is refused."""
    for base in (nn.Embedding, nn.Linear):
        if isinstance(module, base) and type(module).forward is not base.forward:
            raise ConfigError(
                f"AutoTP rule {rule.pattern!r} matched module {name!r}, a {type(module).__name__}: a {base.__name__} "
                f"with a forward of its own, which the split layer would not run (it computes {base.__name__}'s "
                "alone). Leave it whole (no rule for it), or write the model a plan whose rules skip it"
            )


def _split_module(name, module, rule, comm, vp, done, splits, names) -> nn.Module | None:
    tp, rank = comm.world_size, comm.rank
    weight = getattr(module, "weight", None)
    if not isinstance(weight, nn.Parameter):
        raise ConfigError(f"AutoTP rule {rule.pattern!r} matched module {name!r} ({type(module).__name__}), "
                          "which has no weight to split")  # fmt: skip
    bias = getattr(module, "bias", None)
    layout = "in_out" if type(module).__name__ == "Conv1D" else "out_in"
    if isinstance(module, nn.Embedding) or rule.style == "vocab":
        if not vp:
            return None  # replicated
        _check_torch_forward(name, module, rule)
        w = _slice(weight, 0, rule.blocks, comm, done, splits, names)
        return VocabParallelEmbedding(w, ParamSplit(tuple(weight.shape), 0, tp).start(rank), comm,
                                      getattr(module, "padding_idx", None))  # fmt: skip
    if not isinstance(module, nn.Linear) and layout != "in_out":
        raise ConfigError(f"AutoTP can split Linear, Conv1D and Embedding modules; {name!r} is {type(module).__name__}")
    _check_torch_forward(name, module, rule)
    out_dim, in_dim = (0, 1) if layout == "out_in" else (1, 0)
    if rule.style == "head":
        tied = id(weight) in done or len(names[id(weight)]) > 1
        if not vp and tied:
            return None  # tied to a replicated embedding: the whole head on every rank
        w = _slice(weight, out_dim, 1, comm, done, splits, names)
        b = _slice(bias, 0, 1, comm, done, splits, names) if bias is not None else None
        gather = None if vp else ParamSplit(tuple(weight.shape), out_dim, tp).pieces()
        return ColumnParallelLinear(w, b, comm, layout, gather)
    if rule.style == "column":
        w = _slice(weight, out_dim, rule.blocks, comm, done, splits, names)
        b = _slice(bias, 0, rule.blocks, comm, done, splits, names) if bias is not None else None
        return ColumnParallelLinear(w, b, comm, layout)
    if rule.style == "row":
        w = _slice(weight, in_dim, rule.blocks, comm, done, splits, names)
        return RowParallelLinear(w, bias, comm, layout)
    raise ConfigError(f"unknown AutoTP style {rule.style!r} for {name!r}")


def _slice(p: nn.Parameter, dim: int, blocks: int, comm, done, splits, names) -> nn.Parameter:
    if id(p) in done:
        return done[id(p)]
    split = ParamSplit(tuple(p.shape), dim, comm.world_size, blocks)
    local = nn.Parameter(split.local(p.detach(), comm.rank), requires_grad=p.requires_grad)
    done[id(p)] = local
    for n in names[id(p)]:
        splits[n] = split
    return local


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, child)
    setattr(parent, child, new)
    replace = getattr(model, "replace_module", None)
    if replace is not None:  # a pipeline stage: its layers also hold the module (`PipelineStage.replace_module`)
        replace(old, new)
    if type(parent).__name__ == "GPT2Attention" and child == "c_attn":
        # GPT-2 splits its fused q|k|v output by `split_size`, the full width: this rank's is a slice.
        parent.split_size = new.weight.shape[1] // 3
        parent.num_heads = parent.split_size // parent.head_dim


def _use_parallel_loss(model: nn.Module, layout: TPLayout) -> None:
    """A Hugging Face causal LM's loss (`model.loss_function`, its extension point) made the
    vocabulary-parallel one, for a head split over the vocabulary."""
    if not hasattr(model, "loss_function"):
        return
    from ._ops import vocab_parallel_cross_entropy

    start, comm = layout.vocab_start(), layout.comm

    def causal_lm_loss(logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100,
                       shift_labels=None, **kwargs):  # fmt: skip
        if shift_labels is None:
            labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
            shift_labels = labels[..., 1:].contiguous()
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()  # as Hugging Face's own loss
        reduction = "sum" if num_items_in_batch is not None else "mean"
        loss = vocab_parallel_cross_entropy(logits, shift_labels.to(logits.device), start, comm, ignore_index,
                                            reduction)  # fmt: skip
        return loss / num_items_in_batch if num_items_in_batch is not None else loss

    model.loss_function = causal_lm_loss
