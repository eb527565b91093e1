"""The state layer: what a `TrainState` holds beyond the model's shards, and the first one; above
sharding, offload and checkpoint, below `train` and `inference` (`specs/architecture.md`).

    shard                          `fnzero.shard`: the model laid out, `sm.init_state()` built here
    init_state, initial_params     the first TrainState, and the initial parameters alone
    optimizer_or_config, built_per_model
                                   the optimizer a state runs: a given one or the config's
    owner_layout, owner_tree, owner_update
                                   the whole-tensor partition (`specs/optim.md` §Muon)
    step_policy, StepPolicy, LossScalePolicy, scaler_for
                                   what a step and its state read from a config, once (and the
                                   fp16 scaler a state's placement runs)
    init_loss_scale, update_loss_scale
                                   fp16 dynamic loss scaling (`specs/loss-scaling.md`)
    deepspeed_to_fnzero            a DeepSpeed checkpoint rewritten as fnzero's, without the model
"""

from __future__ import annotations

from ._from_deepspeed import deepspeed_to_fnzero
from ._init import init_state, initial_params
from ._loss_scale import init_loss_scale, update_loss_scale
from ._optimizer import built_per_model, exchanging_optimizer_refused, optimizer_or_config
from ._owner_update import OwnerLayout, owner_layout, owner_tree, owner_update
from ._policy import LossScalePolicy, StepPolicy, scaler_for, step_policy
from ._shard import shard

__all__ = [
    "LossScalePolicy", "OwnerLayout", "deepspeed_to_fnzero", "StepPolicy", "built_per_model", "exchanging_optimizer_refused", "init_loss_scale", "init_state",
    "initial_params", "optimizer_or_config", "owner_layout", "owner_tree", "owner_update", "step_policy", "scaler_for",
    "shard", "update_loss_scale",
]
