"""Functional optimizers: pure ``init``/``update`` pairs over pytrees of tensors, optax style
(specs/optim.md).

- The protocol, a chain of gradient transformations: `GradientTransformation`, `chain`, `partition`,
  the `scale_by_*` transforms, ...; every DeepSpeed optimizer name is a chain (`adamw_chain`, ...,
  `CHAINS`), the config's is `chain_from_config(cfg)`.
- How a chain runs, an `Optimizer` record: `implementation(optimizer, on_host)` is the one lookup
  (specs/optim.md §Where an optimizer runs); `as_optimizer` runs a chain's own arithmetic; the
  factories `adam`, `adamw`, `sgd`, ... and `host_optimizer` build the fused ones.
- `onebit_adam`, `zero_one_adam`, `onebit_lamb`: DeepSpeed's 1-bit optimizers (§1-bit optimizers).

>>> import torch
>>> from fnzero import optim
>>> opt = optim.implementation(optim.adamw_chain(lr=1e-2, weight_decay=0.1))
>>> params = {"w": torch.zeros(2, 3), "b": torch.zeros(3)}
>>> state = opt.init(params)
>>> grads = {"w": torch.ones(2, 3), "b": -torch.ones(3)}
>>> new_params, state = opt.update(grads, state, params, 1e-2)
>>> new_params["b"].tolist()
[0.009999999776482582, 0.009999999776482582, 0.009999999776482582]
>>> int(state[0].count), params["b"].tolist()  # the inputs are untouched
(1, [0.0, 0.0, 0.0])
"""

from ._adagrad import AdagradState, adagrad
from ._adam import AdamState, adam, adamw
from ._base import Optimizer, OptState, Params
from ._chains import (
    CHAINS, adagrad_chain, adam_chain, adamw_chain, lamb_chain, lion_chain, muon, muon_chain, onebit_adam_chain,
    onebit_lamb_chain, sgd_chain, zero_one_adam_chain,
)
from ._config import ConfigOptimizer, chain_from_config, config_optimizer, from_config, host_from_config
from ._host import host_optimizer
from ._implement import implementation
from ._lamb import LambState, lamb
from ._lion import LionState, lion
from ._onebit_adam import OneBitAdamState, onebit_adam
from ._onebit_lamb import OneBitLambState, onebit_lamb
from ._zero_one_adam import ZeroOneAdamState, zero_one_adam
from ._muon import PartitionState, ScaleByMuonState, partition, scale_by_muon, uses_muon
from ._muon_heads import muon_head_counts
from ._sgd import SGDState, sgd
from ._transform import (
    CountState, GradientTransformation, Implementations, ScaleByAdamState, ScaleByLionState, ScaleByRssState, TraceState, add_decayed_weights,
    apply_updates, as_optimizer, chain, clip_by_global_norm, scale, scale_by_adam, scale_by_bias_correction,
    scale_by_learning_rate, scale_by_lion, scale_by_loss_scale, scale_by_lr_decay, scale_by_rss, scale_by_trust_ratio,
    trace,
)


# What fnzero's other packages use of this package: they import it from here, its face, and
# never from its private modules (`specs/architecture.md` §Package faces).
from ._config import DEFAULT_LR, HAS_BETAS, needs_model, optimizer_kind, params_dict
from ._transform import not_elementwise
from ._validate import momentum_override
from ._whole import routed_by_name, whole_tensor_names

__all__ = [
    "Optimizer", "Params", "OptState",
    "AdamState", "SGDState", "AdagradState", "LambState", "LionState",
    "adam", "adamw", "sgd", "adagrad", "lamb", "lion", "muon",
    "from_config", "chain_from_config", "host_optimizer", "host_from_config",
    "implementation", "ConfigOptimizer", "config_optimizer",
    "GradientTransformation", "Implementations", "chain", "apply_updates", "as_optimizer", "scale", "scale_by_learning_rate",
    "scale_by_adam", "add_decayed_weights", "trace", "scale_by_lion", "scale_by_rss", "scale_by_lr_decay",
    "scale_by_trust_ratio", "scale_by_bias_correction", "clip_by_global_norm", "scale_by_loss_scale",
    "CountState", "ScaleByAdamState", "TraceState", "ScaleByLionState", "ScaleByRssState",
    "CHAINS", "adam_chain", "adamw_chain", "sgd_chain", "adagrad_chain", "lamb_chain", "lion_chain", "muon_chain",
    "scale_by_muon", "partition", "uses_muon", "muon_head_counts", "ScaleByMuonState", "PartitionState",
    "onebit_adam", "zero_one_adam", "onebit_lamb", "onebit_adam_chain", "zero_one_adam_chain", "onebit_lamb_chain",
    "OneBitAdamState", "ZeroOneAdamState", "OneBitLambState",
]
