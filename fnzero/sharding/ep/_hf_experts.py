"""`HFExpertGroup`: a Hugging Face MoE block's experts module as an `ExpertGroup`, keeping its
parameters and the block's call (`specs/mesh.md` §AutoEP, §Dropless dispatch). Its class also
subclasses the source's, so Hugging Face's `_init_weights` still recognises it."""

from __future__ import annotations

import dataclasses
import inspect

import torch
import torch.nn.functional as F
from torch import nn

from ..._errors import ConfigError
from ._group import ExpertGroup
from ..comm import all_to_all_grad

__all__ = ["ExpertsLayout", "HFExpertGroup", "looks_like_experts", "read_experts_layout"]


@dataclasses.dataclass(frozen=True)
class ExpertsLayout:
    """How one transformers-5 experts module stores and is called with its experts."""

    num_experts: int
    up: str  # "gate_up_proj" (gated: gate and up fused) or "up_proj" (ungated)
    transposed: bool  # weights [E, in, out], applied as x @ W; else [E, out, in], F.linear(x, W)
    bias: bool  # `<up>_bias` [E, out] and `down_proj_bias` [E, H]
    own_gate: bool  # the class's `_apply_gate` gates (transformers' decorator gives every class one)
    post_norm: bool  # a parameter-free `post_expert_norm` after down_proj
    routed: bool  # experts(hidden, top_k_index, top_k_weights); False: experts(expert-major rows)

    @property
    def gated(self) -> bool:
        return self.up == "gate_up_proj"

    @property
    def names(self) -> tuple[str, ...]:
        """The module's parameters, all stacked along dim 0."""
        return (self.up, "down_proj") + ((self.up + "_bias", "down_proj_bias") if self.bias else ())


def _stacked(module: nn.Module) -> bool:
    """A 3-D `down_proj` and a 3-D `gate_up_proj` or `up_proj` of the module's own, with the same
    number of experts along dim 0."""
    own = module._parameters
    down, up = own.get("down_proj"), own.get("gate_up_proj", own.get("up_proj"))
    return (isinstance(down, torch.Tensor) and isinstance(up, torch.Tensor) and down.dim() == 3 and up.dim() == 3
            and down.shape[0] == up.shape[0])


def looks_like_experts(module: nn.Module) -> bool:
    """Whether `module` holds stacked experts as transformers 5 does (`_stacked`) and is called as
    experts are: routed or expert-major (one or three positional arguments). Inkling's shared
    experts, stacked too but called with their own gammas, are not."""
    return _stacked(module) and _positional(type(module)) in (1, 3)


def _positional(cls: type) -> int:
    """How many positional arguments `cls.forward` takes after self (the decorator's wrapper
    reports the wrapped forward's)."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in kinds for p in list(inspect.signature(cls.forward).parameters.values())[1:])


def _orientation(experts: nn.Module, up: torch.Tensor, down: torch.Tensor, factor: int, where: str) -> bool:
    """Whether the weights are stored transposed: the decorator's `is_transposed` when the class
    has one (checked against the shapes), else what the shapes allow (Llama 4 is undecorated)."""
    plain = up.shape[2] == down.shape[1] and up.shape[1] == factor * down.shape[2]  # [E, f*I, H], [E, H, I]
    flipped = up.shape[1] == down.shape[2] and up.shape[2] == factor * down.shape[1]  # [E, H, f*I], [E, I, H]
    said = getattr(experts, "is_transposed", None)
    if said is None and plain != flipped:
        return flipped
    if said is not None and (flipped if said else plain):
        return bool(said)
    raise ConfigError(f"{where}: {type(experts).__name__}'s stacked weights {list(up.shape)} and {list(down.shape)} "
                      f"are not [E, {factor}I, H] and [E, H, I]{' (is_transposed=False)' if said is False else ''}, "
                      f"nor [E, H, {factor}I] and [E, I, H]{' (is_transposed=True)' if said else ''}")


def read_experts_layout(experts: nn.Module, where: str) -> ExpertsLayout:
    """The layout of a transformers-5 experts module, or one ConfigError naming `where` and what
    expert parallelism cannot split or compute."""
    name = type(experts).__name__
    if not _stacked(experts):
        raise ConfigError(f"{where}: {name} has no 3-D gate_up_proj (or up_proj) and down_proj parameters with the "
                          "experts along dim 0 (transformers 5's stacked experts)")
    own = experts._parameters
    up_name = "gate_up_proj" if "gate_up_proj" in own else "up_proj"
    if getattr(experts, "has_gate", up_name == "gate_up_proj") != (up_name == "gate_up_proj"):
        raise ConfigError(f"{where}: {name} says has_gate={experts.has_gate} but holds {up_name}")
    up, down = own[up_name], own["down_proj"]
    factor = 2 if up_name == "gate_up_proj" else 1
    layout = ExpertsLayout(up.shape[0], up_name, _orientation(experts, up, down, factor, where),
                           bool(getattr(experts, "has_bias", "down_proj_bias" in own)),
                           callable(getattr(experts, "_apply_gate", None)),
                           bool(getattr(experts, "has_post_expert_norm", False)), _positional(type(experts)) != 1)
    _check_parts(experts, layout, where)
    return layout


def _check_parts(experts: nn.Module, layout: ExpertsLayout, where: str) -> None:
    """Every parameter stacked per expert, nothing shared by all experts, the call one of the two."""
    name, num = type(experts).__name__, layout.num_experts
    own = {n: p for n, p in experts._parameters.items() if p is not None}
    if set(own) != set(layout.names):
        raise ConfigError(f"{where}: {name} holds {sorted(own)}, not the stacked experts {list(layout.names)} "
                          f"(has_bias={layout.bias})")
    for n in layout.names[2:]:
        if own[n].dim() != 2 or own[n].shape[0] != num:
            raise ConfigError(f"{where}: {name}.{n} {list(own[n].shape)} is not [{num}, ...] (a bias per expert)")
    shared = [f"{c}.{p}" for c, child in experts.named_children() for p, _ in child.named_parameters()]
    shared += [b for b, _ in experts.named_buffers()]
    if shared:
        raise ConfigError(f"{where}: {name} holds {shared}, shared by all its experts; expert parallelism splits the "
                          "experts over ranks, so each rank would train that tensor on its own experts' rows only")
    if _positional(type(experts)) not in (1, 3):
        raise ConfigError(f"{where}: {name}.forward takes {_positional(type(experts))} positional arguments; expert "
                          "parallelism computes experts(hidden_states, top_k_index, top_k_weights) (routed) and "
                          "experts(rows) (every expert on its block of expert-major rows, as Llama 4's)")
    if (not layout.gated or not layout.own_gate) and not callable(getattr(experts, "act_fn", None)):
        raise ConfigError(f"{where}: {name} has no act_fn")
    if layout.post_norm and not callable(getattr(experts, "post_expert_norm", None)):
        raise ConfigError(f"{where}: {name} says has_post_expert_norm but has no post_expert_norm")


class HFExpertGroup(ExpertGroup):
    """A transformers-5 experts module's parameters and forward, splittable over ep ranks; built by
    `HFExpertGroup.replacing(experts, where)` (the same parameter objects)."""

    def __init__(self, weights: dict[str, nn.Parameter], layout: ExpertsLayout, where: str = ""):
        super().__init__()
        self.num_experts = layout.num_experts
        self.layout = layout
        for name in layout.names:
            setattr(self, name, weights[name])
        self.where = where

    @classmethod
    def replacing(cls, experts: nn.Module, where: str) -> "HFExpertGroup":
        """The replacement of `experts` (checked by `read_experts_layout`): its parameters, modules,
        plain attributes (gpt-oss's `alpha`, `limit`) and mode, as an instance of `_subclass_of`."""
        layout = read_experts_layout(experts, where)
        kind = _subclass_of(cls, type(experts))
        group = kind(dict(experts.named_parameters(recurse=False)), layout, where=where)
        for name, child in experts.named_children():
            setattr(group, name, child)
        mine = set(vars(group))
        for name, value in vars(experts).items():
            if (not name.startswith("_") or name == "_is_expert_parallel") and name not in mine \
                    and not hasattr(cls, name):
                setattr(group, name, value)
        group.train(experts.training)
        return group

    def _keep_experts(self, lo: int, hi: int) -> None:
        for name in self.layout.names:
            p = getattr(self, name)
            setattr(self, name, nn.Parameter(p.detach()[lo:hi].clone(), requires_grad=p.requires_grad))

    # Dropless routing sizes every exchange and every expert's batch from the routes' counts, read on
    # the host, and the exchanges are collectives: the experts run eagerly, as the model's eager ones.
    @torch.compiler.disable
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor | None = None,
                top_k_weights: torch.Tensor | None = None) -> torch.Tensor:
        if not self.layout.routed:
            return self._expert_major(hidden_states)
        top_k = top_k_index.shape[-1]
        ids = top_k_index.reshape(-1).long()
        # Ids past the last expert are Hugging Face's "no expert" sentinel: dropped, as eager does.
        counts = torch.bincount(ids, minlength=self.num_experts + 1)[: self.num_experts]
        order = torch.argsort(ids, stable=True)
        counts_list = counts.tolist()
        order = order[: sum(counts_list)]
        token = order // top_k
        out = self._through_experts(hidden_states[token], counts, counts_list)
        weighted = (out * top_k_weights.reshape(-1)[order, None]).to(hidden_states.dtype)
        return torch.zeros_like(hidden_states).index_add(0, token, weighted)

    def _expert_major(self, rows: torch.Tensor) -> torch.Tensor:
        """Llama 4's call: rows `[e·T, (e+1)·T)` for expert e, every expert's T rows (the whole layer's
        E experts, split or not), out in the same order."""
        if rows.shape[0] % self.num_experts:
            raise ValueError(f"{self.where}: {rows.shape[0]} expert-major rows are not {self.num_experts} experts' "
                             "equal blocks")
        per = rows.shape[0] // self.num_experts
        counts = torch.full((self.num_experts,), per, dtype=torch.int64, device=rows.device)
        return self._through_experts(rows, counts, [per] * self.num_experts)

    def _through_experts(self, rows: torch.Tensor, counts: torch.Tensor, counts_list: list[int]) -> torch.Tensor:
        """Rows sorted by global expert id in (`counts[e]` for expert e); their experts' outputs,
        same order, out: here, or through the ep ranks holding them."""
        if self.ep_comm is None or self.ep_comm.world_size == 1:
            return self._run_experts(rows, counts_list)
        return self._exchange_and_run(rows, counts, counts_list)

    def _exchange_and_run(self, rows: torch.Tensor, counts: torch.Tensor, counts_list: list[int]) -> torch.Tensor:
        comm, ep, local = self.ep_comm, self.ep_size, self.num_local_experts
        send = [sum(counts_list[r * local:(r + 1) * local]) for r in range(ep)]
        arriving = comm.all_to_all(counts, label="expert row counts")  # [ep * local]: source-major
        table = arriving.tolist()  # one host copy: the split sizes and the per-expert sizes
        recv = [sum(table[s * local:(s + 1) * local]) for s in range(ep)]
        per_expert = [sum(table[j::local]) for j in range(local)]
        received = all_to_all_grad(rows, comm, send, recv, label="expert dispatch")
        # Group the arrivals by local expert (stable: by source rank within an expert), run, put back.
        expert_of_row = torch.repeat_interleave(torch.arange(local, device=counts.device).repeat(ep), arriving)
        perm = torch.argsort(expert_of_row, stable=True)
        grouped = self._run_experts(received[perm], per_expert)
        back = torch.empty_like(perm)
        back[perm] = torch.arange(perm.numel(), device=perm.device)
        return all_to_all_grad(grouped[back], comm, recv, send, label="expert combine")

    def _run_experts(self, rows: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Rows grouped by local expert (`sizes[j]` rows for expert j), each through its expert as
        transformers computes it; every expert runs, an empty one too, so each holds a gradient."""
        layout = self.layout
        tensors = [getattr(self, n).unbind(0) for n in layout.names]
        outs = []
        for x, *weights in zip(rows.split(sizes), *tensors):
            up_b, down_b = (weights[2], weights[3]) if layout.bias else (None, None)
            h = self._project(x, weights[0], up_b)
            if not layout.gated:
                h = self.act_fn(h)
            elif layout.own_gate:
                h = self._apply_gate(h)
            else:  # an undecorated class (Llama 4): transformers' default gate
                gate, up = h.chunk(2, dim=-1)
                h = self.act_fn(gate) * up
            h = self._project(h, weights[1], down_b)
            outs.append(self.post_expert_norm(h) if layout.post_norm else h)
        return torch.cat(outs)

    def _project(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        if self.layout.transposed:  # [in, out], as the eager transposed experts (gpt-oss) compute it
            return x @ w if b is None else x @ w + b
        return F.linear(x, w, b)

    def extra_repr(self) -> str:
        held = f"{self.expert_lo}..{self.expert_hi}" if self.ep_comm is not None else "all"
        return f"num_experts={self.num_experts}, experts here={held}"


_SUBCLASSES: dict[tuple[type, type], type] = {}  # one class per (replacement, source) pair


def _subclass_of(cls: type, source: type) -> type:
    """`cls` made a subclass of `source` as well (forward and all else from `cls`)."""
    if issubclass(source, cls):
        return source
    key = (cls, source)
    if key not in _SUBCLASSES:  # setdefault: ranks on threads replacing at once keep the first class made
        _SUBCLASSES.setdefault(key, type(f"ExpertParallel{source.__name__}", (cls, source),
                                         {"__module__": cls.__module__}))
    return _SUBCLASSES[key]
