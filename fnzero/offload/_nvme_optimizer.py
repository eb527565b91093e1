"""ZeRO-Infinity's implementation of the Adam, AdamW, Adagrad and Lion chains: the host kernels
(`fnzero.optim`'s host implementations, the same keywords) streamed through an
`NvmeOptimizerStore`'s files, sub-group by sub-group (`specs/offload.md §NVMe store`).

It is an `Optimizer` like the others: `init(master)` writes the fp32 master shards and zero moments
to new files and returns an `NvmeOptState`; `update_` runs one step through them. The master lives
in the files, so the returned parameters are None and `out` (the step's extra, as on the host)
receives the new parameters. The files change in place, so `update` is `update_`: only the newest
state can take a step, and an older one is refused.
"""

from __future__ import annotations

import atexit
import dataclasses
from typing import Any

import torch

from .._errors import ShardingError
from ..optim._base import Optimizer
from ..optim._host import host_hyper, kernel_kwargs
from ._nvme import NvmeOptimizerStore
from ._state import NvmeOptState

__all__ = ["StoreOptions", "nvme_optimizer", "store_options_from_config"]


@dataclasses.dataclass(frozen=True)
class StoreOptions:
    """Where and how `init` lays out the files: `directory` (nvme_path), `sub_group_size`
    elements per chunk, `buffer_count` chunks in flight, `aio` keywords, this process's `rank`."""

    directory: str
    sub_group_size: int = 1_000_000_000
    buffer_count: int = 4
    aio: dict | None = None
    rank: int = 0


def store_options_from_config(cfg: Any, rank: int) -> StoreOptions:
    """The store options of `zero_optimization.offload_optimizer` (`nvme_path`, `buffer_count`),
    `sub_group_size` and the `aio` block, for `rank`."""
    z = cfg.zero_optimization
    oo = z.offload_optimizer
    aio = cfg.aio.model_dump() if getattr(cfg, "aio", None) is not None else None
    return StoreOptions(str(oo.nvme_path), max(1, int(z.sub_group_size)), max(2, int(oo.buffer_count)),
                        _aio_kwargs(aio), rank)  # fmt: skip


def nvme_optimizer(name: str, params: dict, store: StoreOptions | None = None) -> Optimizer:
    """The NVMe implementation of optimizer type `name` with `params` (a config's `params` block).
    `store` is needed by `init` only: a step reads its store from the state it is given."""
    kind, hyper = host_hyper(name, params)

    def init(master: dict[str, torch.Tensor]) -> NvmeOptState:
        if store is None:
            raise ShardingError("nvme_optimizer(...).init needs StoreOptions: where to write the files")
        flat = {k: v.detach().to(device="cpu", dtype=torch.float32) for k, v in master.items()}
        s = NvmeOptimizerStore.create(store.directory, flat, optimizer=kind, sub_group_size=store.sub_group_size,
                                      buffer_count=store.buffer_count, aio=store.aio, rank=store.rank)  # fmt: skip
        # Scratch files of this run: removed when the process ends (a killed process leaves them;
        # fnzero.offload.stale_stores finds and removes those).
        atexit.register(s.close)
        return NvmeOptState(count=torch.zeros((), dtype=torch.int64), store=s)

    def update_(grads, opt_state: NvmeOptState, master=None, lr=None, *, momentum=None, grad_scale=1.0, out=None,
                **extra):  # fmt: skip
        s, count = opt_state.store, int(opt_state.count)
        if (s.last_step or 0) != count:
            raise ShardingError(
                f"this TrainState is at step {count} but its NVMe optimizer files are at step {s.last_step}: "
                "with offload_optimizer device nvme the files are updated in place, so only the newest state "
                "can take a step"
            )
        out = {k: v for k, v in (out or {}).items() if v is not None}
        on_host = {k: v for k, v in out.items() if v.device.type == "cpu"}
        s.step({k: g.to("cpu") for k, g in grads.items()}, step=count + 1, out=on_host, grad_scale=grad_scale,
               **kernel_kwargs(kind, hyper, hyper["lr"] if lr is None else lr, momentum))
        for k, v in out.items():
            if k not in on_host:  # accelerator parameters: copy the host result over
                v.copy_(s.read(k, "master").to(v.dtype))
        return None, dataclasses.replace(opt_state, count=torch.tensor(count + 1, dtype=torch.int64))

    return Optimizer(init=init, update=update_, update_=update_, elementwise=True, takes_extras=True)


def _aio_kwargs(aio: dict | None) -> dict | None:
    """The config's aio block in the names the store takes (DeepSpeed renamed thread_count)."""
    if aio is None:
        return None
    keys = {"block_size", "queue_depth", "thread_count", "single_submit", "overlap_events"}
    out = {k: v for k, v in aio.items() if k in keys and v is not None}
    if "thread_count" not in out and aio.get("intra_op_parallelism") is not None:
        out["thread_count"] = aio["intra_op_parallelism"]
    return out
