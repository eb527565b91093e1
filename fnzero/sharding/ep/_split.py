"""Finding a model's experts, the expert-parallel size it asks for, and splitting them over the
mesh's ep ranks (`specs/mesh.md §Expert parallelism`)."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..._errors import ConfigError
from ._autoep import autoep_replace
from ._group import ExpertGroup
from ._layout import EPLayout

__all__ = ["expert_groups", "wanted_ep_size", "split_for_ep", "replace_for_autoep"]


def expert_groups(model: nn.Module) -> list[tuple[str, ExpertGroup]]:
    """(path, module) of every `ExpertGroup` in `model`, outermost first; nested ones are refused
    (an expert holding experts would be split twice)."""
    found = [(p, m) for p, m in model.named_modules() if isinstance(m, ExpertGroup)]
    for path, _ in found:
        inner = [q for q, _ in found if q.startswith(path + ".")]
        if inner:
            raise ConfigError(f"expert module {path!r} holds other expert modules ({inner[:3]}); experts cannot nest")
    return found


def replace_for_autoep(model: nn.Module, config: Any, mesh_ep: int = 1) -> list[str]:
    """AutoEP (DeepSpeed's `expert_parallel` block): a model without expert modules of its own has
    its Hugging Face MoE blocks' experts replaced by expert groups, found by the block's preset and
    patterns, when the block is enabled or a mesh with ep > 1 is given; the paths replaced."""
    block = getattr(config, "expert_parallel", None) if config is not None else None
    enabled = block is not None and getattr(block, "enabled", False)
    if not (enabled or mesh_ep > 1) or expert_groups(model):
        return []
    keys = ("preset_model", "moe_layer_pattern", "expert_pattern", "router_pattern")
    return autoep_replace(model, **({k: getattr(block, k) for k in keys} if enabled else {}))


def wanted_ep_size(model: nn.Module | None, config: Any) -> int:
    """The expert-parallel size the run asks for: the config's `expert_parallel.autoep_size` when
    the block is enabled, else the `ep_size` its MoE layers were built with (1 when neither says).
    Layers asking for different sizes, or a config disagreeing with them: `ConfigError` naming them."""
    groups = expert_groups(model) if model is not None else []  # None: a pipeline's layers, not built yet
    asked = {p: m.wanted_ep_size for p, m in groups if getattr(m, "wanted_ep_size", 1) > 1}
    block = getattr(config, "expert_parallel", None) if config is not None else None
    from_config = block.size if block is not None and getattr(block, "enabled", False) else None
    sizes = set(asked.values())
    if len(sizes) > 1:
        listed = ", ".join(f"{p}: {s}" for p, s in list(asked.items())[:4])
        raise ConfigError(f"the model's MoE layers ask for different expert-parallel sizes ({listed}); fnzero's mesh "
                          "has one ep axis: build every layer with the same ep_size")
    if from_config is not None and sizes and sizes != {from_config}:
        raise ConfigError(f"expert_parallel.autoep_size is {from_config} but the model's MoE layers were built with "
                          f"ep_size={sizes.pop()}; make them agree")
    return from_config or (sizes.pop() if sizes else 1)


def split_for_ep(model: nn.Module, ep_comm, expert_dp_comm) -> EPLayout | None:
    """Each `ExpertGroup` keeps this rank's experts and routes tokens over `ep_comm`; the layout
    the step and checkpoints read. None when the model has no experts (every parameter dense)."""
    groups = expert_groups(model)
    if not groups:
        return None
    elsewhere, stacked = set(), {}
    for path, group in groups:
        group.split_experts(ep_comm, where=path or type(model).__name__)
        for name, p in group.named_parameters():
            for rank in range(ep_comm.world_size):
                there, is_stacked = group.name_on(name, rank)
                if is_stacked:
                    stacked[f"{path}.{there}"] = (p.shape[0] * ep_comm.world_size, *p.shape[1:])
                elif rank != ep_comm.rank:
                    elsewhere.add(f"{path}.{there}")
    return EPLayout(ep_comm, expert_dp_comm, tuple(p for p, _ in groups), {p: g.num_experts for p, g in groups},
                    {p: g.name_on for p, g in groups}, frozenset(elsewhere), stacked)
