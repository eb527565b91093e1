"""ZeRO-Offload (`_cpu`: the host optimizer step) and ZeRO-Infinity (`_nvme`: optimizer state in
files); `specs/offload.md`."""

from ._nvme import NvmeOptimizerStore, NvmeStoreError, stale_stores

__all__ = ["NvmeOptimizerStore", "NvmeStoreError", "stale_stores"]
