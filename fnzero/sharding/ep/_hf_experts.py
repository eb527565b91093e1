"""`HFExpertGroup`: a Hugging Face MoE block's experts module as an `ExpertGroup`, so expert
parallelism can split it over the `ep` ranks (`specs/mesh.md §Expert parallelism`).

Transformers 5 stores a layer's experts as two 3-D parameters, `gate_up_proj` [E, 2I, H] and
`down_proj` [E, H, I], and the MoE block calls `experts(hidden_states, top_k_index,
top_k_weights)` after its own router (Mixtral, Qwen2/3-MoE, Qwen3.5-MoE, OLMoE, DeepSeek-V2/V3
alike). The replacement keeps those parameters (the same objects, names and dtypes) and that call,
and computes what the eager experts compute: for each (token, chosen expert) row,
`down[e] @ (act(gate) * up)` with `gate, up = chunk(gate_up[e] @ x, 2)`, times the router's
weight, summed per token. Router, shared experts and aux loss stay the block's own.

Split over ep ranks, each rank keeps experts `[lo, hi)` (dim 0 of both tensors, names unchanged)
and exchanges rows: [Note: dispatch]
  1. the rank's rows are sorted by expert id (stable), so rows for ep rank r are one block;
  2. one all-to-all of the per-expert row counts (E int64 per rank) tells each rank how many rows
     every rank sends to each of its experts: the variable split sizes both ways, and the layout
     of what arrives (source-major, expert-minor). An all-to-all rather than an all-gather of
     the counts: each rank needs only its own experts' column, E numbers instead of ep * E;
  3. the token rows go by `all_to_all_grad` (dropless: every row travels, nothing is capped);
  4. the received rows are grouped by local expert, each expert runs on its rows, the results
     are put back in arrival order and return by the reverse all-to-all;
  5. each row's result times its router weight is added to its token, as the eager code does.
The backward runs the two all-to-alls in reverse, so an expert's gradient sums every rank's
tokens routed to it; the router weights' and the tokens' gradients stay on the rank that owns them.

A model's code that asks `isinstance(m, MixtralExperts)` (Hugging Face's `_init_weights`, which
fnzero's meta construction calls per module) still finds the experts: the replacement's class is
made a subclass of the source's class too, as `torch.nn.utils.parametrize` does for its modules.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..._errors import ConfigError
from ._group import ExpertGroup
from ._ops import all_to_all_grad

__all__ = ["HFExpertGroup", "check_hf_experts"]

# Hugging Face's experts attributes (set by `use_experts_implementation`) and the values of the
# one layout this module computes; any other is refused by name instead of computed wrong.
_LAYOUT = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
           "has_post_expert_norm": False}
# Plain attributes of the source kept on the replacement (code that treats it as the source reads them).
_KEPT_ATTRIBUTES = ("hidden_dim", "intermediate_dim", "config", "_is_expert_parallel", *_LAYOUT)


def check_hf_experts(experts: nn.Module, where: str) -> tuple[int, int, int]:
    """(E, H, I) of a transformers-5 experts module in the layout `HFExpertGroup` computes, or one
    ConfigError naming `where` and what differs."""
    for flag, want in _LAYOUT.items():
        if getattr(experts, flag, want) != want:
            raise ConfigError(f"{where}: experts with {flag}={getattr(experts, flag)!r} are not supported by expert "
                              f"parallelism (it computes the fused gate_up_proj/down_proj layout with {flag}={want})")
    custom_gate = getattr(type(experts), "_apply_gate", None)
    if custom_gate is not None and custom_gate.__name__ != "_default_apply_gate":
        raise ConfigError(f"{where}: {type(experts).__name__} gates its experts its own way (_apply_gate); "
                          f"expert parallelism computes act(gate) * up only")
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor) or gate_up.dim() != 3 \
            or down.dim() != 3:
        raise ConfigError(f"{where}: {type(experts).__name__} has no 3-D gate_up_proj and down_proj parameters "
                          f"(transformers 5's expert layout)")
    num_experts, two_inter, hidden = gate_up.shape
    if two_inter % 2 or tuple(down.shape) != (num_experts, hidden, two_inter // 2):
        raise ConfigError(f"{where}: gate_up_proj {list(gate_up.shape)} and down_proj {list(down.shape)} are not "
                          f"[E, 2I, H] and [E, H, I]")
    if not callable(getattr(experts, "act_fn", None)):
        raise ConfigError(f"{where}: {type(experts).__name__} has no act_fn")
    return num_experts, hidden, two_inter // 2


class HFExpertGroup(ExpertGroup):
    """A transformers-5 experts module's parameters and forward, splittable over ep ranks.

    `HFExpertGroup.replacing(experts, where)` builds it from the model's experts module (the
    same parameter objects). Unsplit it equals the eager experts; split (`split_experts(comm)`)
    it holds `gate_up_proj[lo:hi]` and `down_proj[lo:hi]` and sends each row to its expert."""

    def __init__(self, gate_up_proj: nn.Parameter, down_proj: nn.Parameter, act_fn, where: str = ""):
        super().__init__()
        self.num_experts = gate_up_proj.shape[0]
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj
        self.act_fn = act_fn
        self.where = where

    @classmethod
    def replacing(cls, experts: nn.Module, where: str) -> "HFExpertGroup":
        """The replacement of `experts` (checked by `check_hf_experts`): its parameters, its act_fn
        and its training mode, and a class that is also `type(experts)`."""
        check_hf_experts(experts, where)
        group = cls(experts.gate_up_proj, experts.down_proj, experts.act_fn, where)
        for name in _KEPT_ATTRIBUTES:
            if name in vars(experts):
                setattr(group, name, vars(experts)[name])
        group.train(experts.training)
        group.__class__ = _subclass_of(cls, type(experts))
        return group

    def _keep_experts(self, lo: int, hi: int) -> None:
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(self, name)
            setattr(self, name, nn.Parameter(p.detach()[lo:hi].clone(), requires_grad=p.requires_grad))

    # Dropless routing sizes every exchange and every expert's batch from the routes' counts, read on
    # the host, and the exchanges are collectives: the experts run eagerly, as the model's eager ones.
    @torch.compiler.disable
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        top_k = top_k_index.shape[-1]
        ids = top_k_index.reshape(-1).long()
        # Ids past the last expert are Hugging Face's "no expert" sentinel: dropped, as eager does.
        counts = torch.bincount(ids, minlength=self.num_experts + 1)[: self.num_experts]
        order = torch.argsort(ids, stable=True)
        counts_list = counts.tolist()
        order = order[: sum(counts_list)]
        token = order // top_k
        rows = hidden_states[token]
        if self.ep_comm is None or self.ep_comm.world_size == 1:
            out = self._run_experts(rows, counts_list)
        else:
            out = self._exchange_and_run(rows, counts, counts_list)
        weighted = (out * top_k_weights.reshape(-1)[order, None]).to(hidden_states.dtype)
        return torch.zeros_like(hidden_states).index_add(0, token, weighted)

    def _exchange_and_run(self, rows: torch.Tensor, counts: torch.Tensor, counts_list: list[int]) -> torch.Tensor:
        """Rows sorted by global expert id in (`counts[e]` for expert e); their experts' outputs,
        same order, out."""
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
        """Rows grouped by local expert (`sizes[j]` rows for expert j), each through its expert.
        Every expert runs, an empty one too, so each holds a gradient (zeros) after backward."""
        outs = []
        for x, w_gate_up, w_down in zip(rows.split(sizes), self.gate_up_proj.unbind(0), self.down_proj.unbind(0)):
            gate, up = F.linear(x, w_gate_up).chunk(2, dim=-1)
            outs.append(F.linear(self.act_fn(gate) * up, w_down))
        return torch.cat(outs)

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
