"""ZeRO-Infinity: optimizer state in files (`_nvme`: the store; `_nvme_optimizer`: the optimizer
implementation that streams the host kernels through it), and the parameter shards no optimizer
holds (`_nvme_params`); `specs/offload.md`. ZeRO-Offload's
in-memory host step is `fnzero.optim.host_optimizer`."""

from ._nvme import NvmeOptimizerStore, NvmeStoreError, stale_stores
from ._nvme_params import NvmeParamStore


# What fnzero's other packages use of this package: they import it from here, its face, and
# never from its private modules (`specs/architecture.md` §Package faces).
from ._checkpoint import is_nvme, like_in_memory, materialize, restore_into_store
from ._nvme_optimizer import nvme_optimizer, store_options_from_config
from ._nvme_params import store_shards
from ._layout import NvmeOptState

__all__ = ["NvmeOptimizerStore", "NvmeParamStore", "NvmeStoreError", "stale_stores"]
