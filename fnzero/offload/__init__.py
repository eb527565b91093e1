"""ZeRO-Infinity: optimizer state in files (`_nvme`: the store; `_nvme_optimizer`: the optimizer
implementation that streams the host kernels through it), and the parameter shards no optimizer
holds (`_nvme_params`); `specs/offload.md`. ZeRO-Offload's
in-memory host step is `fnzero.optim.host_optimizer`."""

from ._nvme import NvmeOptimizerStore, NvmeStoreError, stale_stores
from ._nvme_params import NvmeParamStore

__all__ = ["NvmeOptimizerStore", "NvmeParamStore", "NvmeStoreError", "stale_stores"]
