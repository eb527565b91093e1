"""`MoE`: DeepSpeed's Mixture-of-Experts layer, at expert-parallel size 1 (`specs/moe.md`).

The module tree mirrors DeepSpeed's (`deepspeed_moe.gate.wg`, `deepspeed_moe.experts.deepspeed_experts.{i}`,
`mlp`, `coefficient`), so a state_dict moves between the two layers unchanged.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from .._errors import ConfigError
from ..sharding import ExpertGroup, all_to_all_grad
from ._gating import Routes, top1_routes, top2_routes, uniform_noise

__all__ = ["MoE", "TopKGate", "Experts", "MOELayer"]

_NOISY_GATE_POLICIES = (None, "Jitter", "RSample")
_JITTER_EPSILON = 1e-2  # DeepSpeed's multiplicative_jitter: inputs scaled by U(1 - eps, 1 + eps)


class TopKGate(nn.Module):
    """The router: `wg`, a bias-free Linear(hidden, num_experts) computed in float32 (as DeepSpeed, which
    upcasts bf16/fp16 inputs and, likewise, rounds float64 ones), then top-1 or top-2 routing."""

    def __init__(self, hidden_size: int, num_experts: int, k: int, capacity_factor: float,
                 eval_capacity_factor: float, min_capacity: int, noisy_gate_policy: str | None, drop_tokens: bool,
                 use_rts: bool, top2_2nd_expert_sampling: bool):
        super().__init__()
        self.wg = nn.Linear(hidden_size, num_experts, bias=False)
        self.k, self.min_capacity, self.noisy_gate_policy = k, min_capacity, noisy_gate_policy
        self.capacity_factor, self.eval_capacity_factor = capacity_factor, eval_capacity_factor
        self.drop_tokens, self.use_rts, self.top2_2nd_expert_sampling = drop_tokens, use_rts, top2_2nd_expert_sampling

    def forward(self, tokens: torch.Tensor, generator: torch.Generator,
                used_token: torch.Tensor | None = None) -> Routes:
        x = tokens.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = x * uniform_noise(x.shape, generator, x.device, 1.0 - _JITTER_EPSILON, 1.0 + _JITTER_EPSILON)
        logits = F.linear(x, self.wg.weight.float())
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            return top1_routes(logits, capacity_factor=factor, min_capacity=self.min_capacity,
                               drop_tokens=self.drop_tokens, use_rts=self.use_rts,
                               rsample=self.noisy_gate_policy == "RSample" and self.training,
                               used_token=used_token, generator=generator)
        # DeepSpeed's top-2 ignores used_token and RSample, and samples the second expert in eval too.
        return top2_routes(logits, capacity_factor=factor, min_capacity=self.min_capacity,
                           drop_tokens=self.drop_tokens, second_sampling=self.top2_2nd_expert_sampling,
                           generator=generator)


class Experts(ExpertGroup):
    """`num_experts` deep copies of one expert module (all start with its weights, as DeepSpeed's).

    Split over expert-parallel ranks (`ExpertGroup.split_experts`, which `fnzero.shard` calls) it keeps
    its experts under their global ids, `deepspeed_experts.{i}`, so names read the same at any ep size."""

    def __init__(self, expert: nn.Module, num_experts: int, ep_size: int = 1):
        super().__init__()
        self.num_experts = num_experts
        self.wanted_ep_size = ep_size  # the layer's `ep_size`: the mesh's must match (`fnzero.shard` checks)
        self.deepspeed_experts = nn.ModuleList(copy.deepcopy(expert) for _ in range(num_experts))

    def _keep_experts(self, lo: int, hi: int) -> None:
        kept = {str(i): self.deepspeed_experts[i] for i in range(lo, hi)}
        self.deepspeed_experts = nn.ModuleDict(kept)

    def name_on(self, name: str, ep_rank: int) -> tuple[str, bool]:
        """`deepspeed_experts.{i}.<rest>` here is `deepspeed_experts.{i - lo + lo there}.<rest>` on `ep_rank`."""
        head, index, rest = name.split(".", 2)
        there = int(index) - self.expert_lo + ep_rank * self.num_local_experts
        return f"{head}.{there}.{rest}", False

    def local_experts(self) -> list[nn.Module]:
        """This rank's experts in global id order."""
        experts = self.deepspeed_experts
        return list(experts.values() if isinstance(experts, nn.ModuleDict) else experts)

    def forward(self, buffers: torch.Tensor) -> torch.Tensor:
        """[ep, experts here, capacity, hidden] -> the same shape; expert i sees its [ep, 1, capacity, hidden]
        block, the shape DeepSpeed hands it (a tuple output's first element is taken, as there)."""
        experts = self.local_experts()
        outputs = []
        for block, expert in zip(buffers.chunk(len(experts), dim=1), experts):
            out = expert(block)
            outputs.append(out[0] if isinstance(out, tuple) else out)
        return torch.cat(outputs, dim=1)


@torch.compiler.disable  # a collective of a thread world or process group, read on the host: not traced
def _largest_capacity(comm, capacity: int, device: torch.device) -> int:
    return int(comm.all_gather(torch.tensor([capacity], dtype=torch.int64, device=device)).max())


def _exchange(buffers: torch.Tensor, experts: Experts, same_capacity: bool) -> torch.Tensor:
    """The experts' outputs for this rank's [experts, capacity, hidden] buffers, wherever the experts are.

    Split over ep ranks, the buffers' blocks go to the ranks holding their experts and the outputs come
    back by all-to-all (DeepSpeed's order: rank j receives every rank's block for its experts, as
    [ep, experts here, capacity, hidden]). Without dropping, capacity differs by rank: every rank pads
    its buffers with empty slots to the group's largest (one small all-gather), as DeepSpeed's gate
    all-reduces the capacity; empty slots have weight 0 in the combine."""
    # Output widths are read from the outputs: a capacity of 0 (no-drop routing of a call whose used_token
    # masks every token) leaves -1 nothing to infer from.
    comm = experts.ep_comm
    num_experts, capacity, hidden = buffers.shape
    if comm is None or comm.world_size == 1:
        out = experts(buffers.unsqueeze(0))
        return out.reshape(num_experts, capacity, out.shape[-1])
    most = capacity if same_capacity else _largest_capacity(comm, capacity, buffers.device)
    if most > capacity:
        buffers = torch.cat([buffers, buffers.new_zeros(num_experts, most - capacity, hidden)], dim=1)
    received = all_to_all_grad(buffers.reshape(num_experts * most, hidden), comm, label="moe dispatch")
    out = experts(received.view(comm.world_size, num_experts // comm.world_size, most, hidden))
    width = out.shape[-1]
    back = all_to_all_grad(out.reshape(num_experts * most, width).contiguous(), comm, label="moe combine")
    return back.view(num_experts, most, width)[:, :capacity]


def _dispatch(tokens: torch.Tensor, routes: Routes, num_experts: int) -> torch.Tensor:
    """The [experts, capacity, hidden] buffer: each kept route's token in its slot, zeros elsewhere."""
    num_tokens, hidden = tokens.shape
    flat = routes.experts * routes.capacity + routes.slots  # [k, tokens]; meaningless where dropped
    kept = routes.experts >= 0
    token_ids = torch.arange(num_tokens, device=tokens.device).expand_as(flat)
    # Row num_tokens of the padded input is zeros: the source of every slot no route fills.
    source = torch.full((num_experts * routes.capacity,), num_tokens, dtype=torch.long, device=tokens.device)
    source[flat[kept]] = token_ids[kept]
    padded = torch.cat([tokens, tokens.new_zeros(1, hidden)])
    return padded.index_select(0, source).view(num_experts, routes.capacity, hidden)


def _combine(expert_out: torch.Tensor, routes: Routes, num_tokens: int) -> torch.Tensor:
    """Each token's output: the sum over its kept routes of weight x its slot's expert output, taken in
    the promoted dtype of the two (float32 weights lift bf16 outputs) and returned in the experts' dtype."""
    hidden = expert_out.shape[-1]
    flat_out = torch.cat([expert_out.reshape(-1, hidden), expert_out.new_zeros(1, hidden)])
    scratch = expert_out.shape[0] * expert_out.shape[1]
    flat = torch.where(routes.experts >= 0, routes.experts * routes.capacity + routes.slots,
                       torch.full_like(routes.slots, scratch))
    routed = flat_out.index_select(0, flat.reshape(-1)).view(flat.shape[0], num_tokens, hidden)
    return (routed * routes.weights.unsqueeze(-1)).sum(0).to(expert_out.dtype)


class MOELayer(nn.Module):
    """Gate, dispatch into capacity buffers, experts, combine. Records the last call's `l_aux` and
    `exp_counts` as DeepSpeed's does (`MoE.forward` returns them)."""

    def __init__(self, gate: TopKGate, experts: Experts, num_experts: int):
        super().__init__()
        self.gate, self.experts, self.num_experts = gate, experts, num_experts

    def forward(self, hidden_states: torch.Tensor, generator: torch.Generator,
                used_token: torch.Tensor | None = None) -> torch.Tensor:
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        routes = self.gate(tokens, generator, used_token)
        self.l_aux, self.exp_counts = routes.l_aux, routes.exp_counts
        buffers = _dispatch(tokens, routes, self.num_experts)
        expert_out = _exchange(buffers, self.experts, self.gate.drop_tokens)
        return _combine(expert_out, routes, tokens.shape[0]).reshape(hidden_states.shape)


def _check_arguments(hidden_size, num_experts, ep_size, k, capacity_factor, eval_capacity_factor, min_capacity,
                     noisy_gate_policy, enable_expert_tensor_parallelism) -> None:
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
        raise ConfigError(f"MoE ep_size={ep_size!r} must be a positive integer")
    if num_experts >= 1 and num_experts % ep_size:
        raise ConfigError(f"MoE num_experts={num_experts} is not divisible by ep_size={ep_size}: each of the "
                          f"{ep_size} expert-parallel ranks holds num_experts / ep_size experts")
    if enable_expert_tensor_parallelism:
        raise ConfigError("MoE enable_expert_tensor_parallelism=True: expert tensor parallelism is not built yet")
    if hidden_size < 1 or num_experts < 1:
        raise ConfigError(f"MoE needs hidden_size >= 1 and num_experts >= 1, got {hidden_size} and {num_experts}")
    if k not in (1, 2):
        raise ConfigError(f"MoE k={k}: only top-1 and top-2 gating are built (DeepSpeed's MoE documents k=1 or 2)")
    if k > num_experts:
        raise ConfigError(f"MoE k={k} exceeds num_experts={num_experts}")
    for name, value in (("capacity_factor", capacity_factor), ("eval_capacity_factor", eval_capacity_factor)):
        if not value > 0:
            raise ConfigError(f"MoE {name}={value} must be > 0")
    if min_capacity < 0:
        raise ConfigError(f"MoE min_capacity={min_capacity} must be >= 0")
    if noisy_gate_policy not in _NOISY_GATE_POLICIES:
        raise ConfigError(f"MoE noisy_gate_policy={noisy_gate_policy!r}: one of None, 'None', 'Jitter', 'RSample'")


class MoE(nn.Module):
    """DeepSpeed's `deepspeed.moe.layer.MoE`: same arguments, defaults and results (`specs/moe.md`).

    `generator`: the torch.Generator every random draw of this layer comes from (random token selection,
    Jitter, RSample, the top-2 second-expert sample); torch's global RNG is never read in forward. None
    makes the layer its own CPU generator, seeded at construction from torch's RNG as parameter
    initialisation is. Draws happen on the generator's device and move to the input's.
    `forward(hidden_states, used_token=None) -> (output, l_aux, exp_counts)`.
    """

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: str | None = None, drop_tokens: bool = True,
                 use_rts: bool = True, top2_2nd_expert_sampling: bool = True,
                 enable_expert_tensor_parallelism: bool = False, generator: torch.Generator | None = None):
        super().__init__()
        noisy_gate_policy = None if noisy_gate_policy == "None" else noisy_gate_policy
        _check_arguments(hidden_size, num_experts, ep_size, k, capacity_factor, eval_capacity_factor, min_capacity,
                         noisy_gate_policy, enable_expert_tensor_parallelism)
        self.hidden_size, self.num_experts, self.ep_size, self.k = hidden_size, num_experts, ep_size, k
        self.use_residual = use_residual
        if generator is None:
            seed = int(torch.randint(0, 2**62, (), device="cpu"))
            generator = torch.Generator().manual_seed(seed)
        self.generator = generator
        gate = TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                        noisy_gate_policy, drop_tokens, use_rts, top2_2nd_expert_sampling)
        # Every expert until `fnzero.shard` splits them over the mesh's ep ranks (which must be ep_size).
        self.deepspeed_moe = MOELayer(gate, Experts(expert, num_experts, ep_size), num_experts)
        if use_residual:
            self.mlp = expert  # the module passed in, not a copy, as DeepSpeed's
            self.coefficient = nn.Linear(hidden_size, 2)

    @property
    def num_local_experts(self) -> int:
        """The experts this rank holds: num_experts / ep_size once `fnzero.shard` split them, else all."""
        return self.deepspeed_moe.experts.num_local_experts

    def draws_at_random(self) -> bool:
        """Whether a forward now draws from `generator`: random token selection (top-1) and the noisy
        policies while training, the top-2 second-expert sample in either mode (as DeepSpeed's)."""
        gate = self.deepspeed_moe.gate
        if gate.k == 2:
            return gate.top2_2nd_expert_sampling
        return self.training and (gate.use_rts or gate.noisy_gate_policy is not None)

    def forward(self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None):
        if hidden_states.shape[-1] != self.hidden_size:
            raise ConfigError(f"MoE input's last dimension is {hidden_states.shape[-1]}, "
                              f"hidden_size is {self.hidden_size}")
        if torch._C._current_graph_task_id() != -1 and self.draws_at_random():
            raise ConfigError(
                "MoE layer run again inside backward (activation checkpointing recomputing it) while its routing "
                "draws at random: the recomputed routes would differ from the forward's and the gradients be wrong "
                "(`specs/moe.md` §Randomness). Leave the MoE layer out of the checkpointed region, or turn its "
                "randomness off (use_rts=False, noisy_gate_policy=None, top2_2nd_expert_sampling=False)")
        output = self.deepspeed_moe(hidden_states, self.generator, used_token)
        if self.use_residual:
            dense = self.mlp(hidden_states)
            dense = dense[0] if isinstance(dense, tuple) else dense
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + dense * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts
