"""`ExpertGroup`: a module holding a layer's experts, which expert parallelism splits over the `ep`
ranks, a ZeRO unit of its own (`specs/mesh.md §Expert parallelism`); until split it runs every expert."""

from __future__ import annotations

from torch import nn

from ..._errors import ConfigError

__all__ = ["ExpertGroup", "expert_range", "check_expert_split"]


def expert_range(num_experts: int, ep_size: int, ep_rank: int) -> tuple[int, int]:
    """The global ids `[lo, hi)` of the experts ep rank `ep_rank` holds: consecutive blocks of
    `num_experts / ep_size`, in rank order (DeepSpeed's)."""
    per = num_experts // ep_size
    return ep_rank * per, (ep_rank + 1) * per


def check_expert_split(num_experts: int, ep_size: int, where: str) -> None:
    """ConfigError naming the numbers unless `ep_size` ranks can hold equal shares of the experts."""
    if ep_size < 1 or num_experts % ep_size:
        raise ConfigError(f"{where}: {num_experts} experts do not divide over {ep_size} expert-parallel ranks "
                          f"(num_experts must be a multiple of the expert-parallel size)")


class ExpertGroup(nn.Module):
    """Base of the modules that hold a layer's experts and can be split over expert-parallel ranks.
    Subclasses define `num_experts` (global) and `_keep_experts(lo, hi)` (drop the others, keeping the
    whole layer's parameter names), and run their forward through `self.ep_comm` when set."""

    num_experts: int

    def __init__(self) -> None:
        # nn.Module's own, not the next class in the MRO: an `HFExpertGroup` is made as a class
        # that is also its source experts class (`_hf_experts.py`), whose constructor takes the
        # model's config; the group takes its state from the source module instead.
        nn.Module.__init__(self)
        self.ep_comm = None  # the expert-parallel ranks' Collectives once split; None: all experts here
        self.expert_lo, self.expert_hi = 0, None  # this rank's global expert ids (hi None: all)

    @property
    def ep_size(self) -> int:
        return 1 if self.ep_comm is None else self.ep_comm.world_size

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep_size

    def split_experts(self, comm, where: str = "") -> None:
        """Keep the experts of `comm.rank` of `comm.world_size` expert-parallel ranks, and route
        tokens through `comm`."""
        if self.ep_comm is not None:
            raise ConfigError(f"{where or type(self).__name__}: its experts are split over expert-parallel ranks already")
        check_expert_split(self.num_experts, comm.world_size, where or type(self).__name__)
        lo, hi = expert_range(self.num_experts, comm.world_size, comm.rank)
        if comm.world_size > 1:
            self._keep_experts(lo, hi)
        self.ep_comm, self.expert_lo, self.expert_hi = comm, lo, hi

    def _keep_experts(self, lo: int, hi: int) -> None:
        raise NotImplementedError

    def name_on(self, name: str, ep_rank: int) -> tuple[str, bool]:
        """(name on ep rank `ep_rank` of this rank's parameter `name`, whether the whole layer's tensor
        is the ep ranks' pieces concatenated along dim 0); by default stacked experts, as Hugging Face's."""
        return name, True
