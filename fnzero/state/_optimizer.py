"""The optimizer a state runs: a given one or the config's, placed where the config puts its
state (`optimizer_or_config`), and the one refusal of an optimizer that exchanges its own
gradients where it cannot run. `init_state` builds the first optimizer state with it and
`fnzero.train_step` steps with the same one (`specs/optim.md`)."""

from __future__ import annotations

from .. import optim as _optim
from .._errors import ShardingError
from ..offload._nvme_optimizer import nvme_optimizer, store_options_from_config
from ..optim._config import ConfigOptimizer, needs_model
from ..optim._transform import not_elementwise
from ..sharding.zero._policy import offload_device

__all__ = ["optimizer_or_config", "built_per_model", "exchanging_optimizer_refused"]


def optimizer_or_config(optimizer, config, rank: int = 0, model: ConfigOptimizer | None = None) -> "_optim.Optimizer":
    """The optimizer implementation a step or an initial state runs: a given one (a chain is run
    through `as_optimizer`), else the config's `optimizer` block, on the parameters' device
    (torch's fused kernels) or, with `offload_optimizer`, on the host (fnzero's C kernels for the
    config's type). Either runs where its state is placed: with `offload_optimizer: cpu` on host
    tensors, with `nvme` streamed through files (`rank` names this process's), a sub-group at a
    time. Both cut the state into flat shards, so an optimizer that is not elementwise is refused
    there, naming the transform that reads whole tensors. `model`: the facts of the model the
    config's optimizer reads (`Sharding.optimizer`, resolved by `shard`: per_head_muon's heads),
    carried to `config`'s block."""
    where = offload_device(config)
    if optimizer is None:
        block = model.for_config(config) if model is not None else ConfigOptimizer(config)
        opt = block.implementation(on_host=where is not None)
    else:
        opt = _given_optimizer(optimizer, where)
    if where == "nvme":
        label = config.optimizer.type.lower() if optimizer is None else "optimizer"
        return nvme_optimizer(opt, store_options_from_config(config, rank), label)
    return opt


def built_per_model(optimizer, config) -> bool:
    """Whether the optimizer a step runs is the config's and reads facts of the model (per_head_muon's
    heads): then it is built from each state's `Sharding.optimizer` (`optimizer_or_config(model=)`)."""
    return optimizer is None and needs_model(config)


def _given_optimizer(optimizer, where: str | None) -> "_optim.Optimizer":
    if isinstance(optimizer, _optim.GradientTransformation):
        blocked = not_elementwise(optimizer)
        if where is not None and blocked:
            raise ShardingError(
                f"offload_optimizer ({where}) runs the optimizer on flat shards of the master weights; the "
                f"chain's {', '.join(blocked)} reads whole tensors (it is not elementwise): remove the offload "
                "or that transform"
            )
        return _optim.as_optimizer(optimizer)
    if isinstance(optimizer, _optim.Optimizer):
        if where is not None and not optimizer.elementwise:
            raise ShardingError(f"offload_optimizer ({where}) runs the optimizer on flat shards of the master "
                                "weights; the optimizer= given is not elementwise: remove the offload")
        return optimizer
    raise ShardingError(
        f"optimizer= must be a fnzero.optim.Optimizer or a chain of gradient transformations, got "
        f"{type(optimizer).__name__}"
    )


def exchanging_optimizer_refused(why: str) -> ShardingError:
    """The one refusal of a 1-bit optimizer where it cannot run (`specs/optim.md` §1-bit optimizers)."""
    return ShardingError(f"this optimizer exchanges its momentum through the compressed all-reduce itself and runs at "
                         f"ZeRO stage 0 on whole parameters only (as DeepSpeed's 1-bit optimizers); {why}")
