"""The optimizer a state runs: a given one or the config's, placed where the config puts its
state (`optimizer_or_config`), and the one refusal of an optimizer that exchanges its own
gradients where it cannot run. `init_state` builds the first optimizer state with it and
`fnzero.train_step` steps with the same one (`specs/optim.md`)."""

from __future__ import annotations

from ..optim import ConfigOptimizer, Optimizer, implementation
from .._errors import ShardingError
from ..offload import nvme_optimizer, store_options_from_config
from ..optim import needs_model, not_elementwise
from ..sharding import offload_device

__all__ = ["optimizer_or_config", "built_per_model", "exchanging_optimizer_refused"]


def optimizer_or_config(optimizer, config, rank: int = 0, model: ConfigOptimizer | None = None) -> Optimizer:
    """The optimizer implementation a step or an initial state runs: of a given chain or
    `Optimizer`, else of the config's chain, looked up by `fnzero.optim.implementation` and placed
    where the config puts its state (specs/optim.md §Where an optimizer runs; `rank` names this
    process's NVMe files). A given optimizer that is not elementwise is refused with offload.
    `model`: the facts of the model the config's optimizer reads (`Sharding.config_optimizer`)."""
    where = offload_device(config)
    if optimizer is None:
        block = model.for_config(config) if model is not None else ConfigOptimizer(config)
        optimizer, label = block.chain(), config.optimizer.type.lower()
    else:
        _check_given(optimizer, where)
        label = "optimizer"
    opt = implementation(optimizer, on_host=where is not None)
    if where == "nvme":
        return nvme_optimizer(opt, store_options_from_config(config, rank), label)
    return opt


def built_per_model(optimizer, config) -> bool:
    """Whether the optimizer a step runs is the config's and reads facts of the model (per_head_muon's
    heads): then it is built from each state's `Sharding.config_optimizer` (`optimizer_or_config(model=)`)."""
    return optimizer is None and needs_model(config)


def _check_given(optimizer, where: str | None) -> None:
    """With offload (flat shards of the master) a given optimizer must be elementwise; the refusal
    names the transforms that read whole tensors where it has a chain (`not_elementwise`)."""
    if where is None or getattr(optimizer, "elementwise", True):  # (not an optimizer: `implementation` says so)
        return
    blocked = not_elementwise(optimizer)
    why = (f"the chain's {', '.join(blocked)} reads whole tensors (it is not elementwise): remove the offload or "
           "that transform") if blocked else "the optimizer= given is not elementwise: remove the offload"
    raise ShardingError(f"offload_optimizer ({where}) runs the optimizer on flat shards of the master weights; {why}")


def exchanging_optimizer_refused(why: str) -> ShardingError:
    """The one refusal of a 1-bit optimizer where it cannot run (`specs/optim.md` §1-bit optimizers)."""
    return ShardingError(f"this optimizer exchanges its momentum through the compressed all-reduce itself and runs at "
                         f"ZeRO stage 0 on whole parameters only (as DeepSpeed's 1-bit optimizers); {why}")
