"""The data-parallel world size a config is resolved against when the caller gives none."""

from __future__ import annotations

import sys

__all__ = ["default_world_size"]


def default_world_size() -> int:
    """torch.distributed's world size when a process group is up, else 1 (as DeepSpeed does).
    Inside a `fnzero.testing` simulated world, that world's size."""
    sim = sys.modules.get("fnzero.testing._context")
    if sim is not None and sim.current_comm() is not None:
        return int(sim.current_comm().world_size)
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_world_size())
    except (ImportError, RuntimeError):
        pass
    return 1
