"""The state layer: what a `TrainState` holds beyond the model's shards, and the first one.

    shard                          `fnzero.shard`: the model laid out by sharding, whose
                                   `sm.init_state()` builds its first state here (`_shard.py`)
    init_state, initial_params     the first TrainState of a `ShardedModule` and the initial
                                   parameters alone, which an inference state starts from (`_init.py`)
    optimizer_or_config, built_per_model
                                   the optimizer a state runs: a given one or the config's (with the
                                   model's facts it reads), placed where the config puts its state
                                   (`_optimizer.py`)
    owner_layout, owner_tree, owner_update
                                   a non-elementwise optimizer at ZeRO stages 1-3: the whole-tensor
                                   partition (`_owner_update.py`; `specs/optim.md` §Muon)
    step_policy, StepPolicy, LossScalePolicy
                                   what a step and its state read from a config, once (`_policy.py`)
    init_loss_scale, update_loss_scale
                                   fp16 dynamic loss scaling as a pure state machine (`_loss_scale.py`;
                                   `specs/loss-scaling.md`)

It sits above sharding, offload and checkpoint (a state holds their stores and reads pretrained
files) and below `train` and `inference`, which start from it (`specs/architecture.md`).
"""

from __future__ import annotations

from ._init import init_state, initial_params
from ._loss_scale import init_loss_scale, update_loss_scale
from ._optimizer import built_per_model, exchanging_optimizer_refused, optimizer_or_config
from ._owner_update import OwnerLayout, owner_layout, owner_tree, owner_update
from ._policy import LossScalePolicy, StepPolicy, step_policy
from ._shard import shard

__all__ = [
    "LossScalePolicy", "OwnerLayout", "StepPolicy", "built_per_model", "exchanging_optimizer_refused", "init_loss_scale", "init_state",
    "initial_params", "optimizer_or_config", "owner_layout", "owner_tree", "owner_update", "step_policy",
    "shard", "update_loss_scale",
]
