"""ZeRO-Infinity: optimizer state in files (`_nvme`: the store; `_nvme_optimizer`: the optimizer
implementation that streams the host kernels through it); `specs/offload.md`. ZeRO-Offload's
in-memory host step is `fnzero.optim.host_optimizer`."""

from ._nvme import NvmeOptimizerStore, NvmeStoreError, stale_stores

__all__ = ["NvmeOptimizerStore", "NvmeStoreError", "stale_stores"]
