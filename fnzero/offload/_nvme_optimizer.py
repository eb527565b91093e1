"""ZeRO-Infinity: any elementwise `Optimizer` with its state streamed through an
`NvmeOptimizerStore`'s files, its own `update_` on each sub-group (`specs/offload.md` §Step (NVMe)).
The files change in place, the one exception to `Optimizer`'s purity: only the newest state steps."""

from __future__ import annotations

import atexit
import dataclasses
from typing import Any

import torch

from .._errors import ShardingError
from ..optim import Optimizer
from ..sharding import is_placeholder
from ._layout import CHUNK, NvmeOptState, StoreLayout, layout_of
from ._nvme import NvmeOptimizerStore
from ._nvme_files import usable_directory

__all__ = ["StoreOptions", "nvme_optimizer", "store_options_from_config"]

_STORE_OUT = (torch.float32, torch.bfloat16, torch.float16)  # what the store writes new parameters into


@dataclasses.dataclass(frozen=True)
class StoreOptions:
    """Where and how `init` lays out the files: `directory` (nvme_path), `sub_group_size`
    elements per chunk, `buffer_count` chunks in flight, `aio` keywords, this process's `rank`;
    `key`: what a bad `directory` is called in the error."""

    directory: str
    sub_group_size: int = 1_000_000_000
    buffer_count: int = 4
    aio: dict | None = None
    rank: int = 0
    key: str = "StoreOptions.directory"


def store_options_from_config(cfg: Any, rank: int) -> StoreOptions:
    """The store options of `zero_optimization.offload_optimizer` (`nvme_path`, `buffer_count`),
    `sub_group_size` and the `aio` block, for `rank`."""
    z = cfg.zero_optimization
    oo = z.offload_optimizer
    return StoreOptions(str(oo.nvme_path), max(1, int(z.sub_group_size)), max(2, int(oo.buffer_count)),
                        _aio_kwargs(cfg.aio.model_dump()), rank, "zero_optimization.offload_optimizer.nvme_path")  # fmt: skip


def _sub_group_kernel(inner: Optimizer, layout: StoreLayout):
    """The store's kernel: `inner.update_` on one sub-group, in place on its chunks."""

    def kernel(master, g, *states, out16=None, grad_scale=1.0, lr=None, momentum=None, resident=(), extras=None,
               **ignored):  # (the store's own keywords: step, num_threads, use_cext)
        if grad_scale != 1.0:
            g = g * grad_scale
        state = layout.chunk_state(dict(zip(layout.kinds, states)), resident)
        new_p, new_s = inner.update_({CHUNK: g}, state, {CHUNK: master}, lr, momentum=momentum, **(extras or {}))
        _put(master, new_p[CHUNK])
        chunks, _ = layout.chunk_parts(new_s)
        for buf, kind in zip(states, layout.kinds):
            _put(buf, chunks[kind])
        if out16 is not None:
            out16.copy_(master)

    return kernel


def _put(buf: torch.Tensor, value: torch.Tensor) -> None:
    if value is not buf:
        buf.copy_(value)


def nvme_optimizer(inner: Optimizer, store: StoreOptions | None = None, label: str = "optimizer") -> Optimizer:
    """`inner`, an elementwise Optimizer, with its state in NVMe files; `label` names it in the
    store's manifest. `store` is needed by `init` only: a step reads its store from the state.
    `init(master)` writes the fp32 master shards and the initial state to new files; `update`
    returns the new parameters in `params`' dtype (`update_` writes them into `params`), and
    placeholders of parameters the store itself holds as they are."""
    if not inner.elementwise:
        raise ShardingError("an NVMe optimizer store updates its files a sub-group at a time, which needs an "
                            "elementwise optimizer")

    def init(master: dict[str, torch.Tensor]) -> NvmeOptState:
        if store is None:
            raise ShardingError("nvme_optimizer(...).init needs StoreOptions: where to write the files")
        usable_directory(store.directory, store.key)
        flat = {k: v.detach().to(device="cpu", dtype=torch.float32).reshape(-1) for k, v in master.items()}
        layout, resident = layout_of(inner, list(flat))
        s = NvmeOptimizerStore.create(store.directory, flat, optimizer=label, kernel=_sub_group_kernel(inner, layout),
                                      kinds=layout.kinds, sub_group_size=store.sub_group_size,
                                      buffer_count=store.buffer_count, aio=store.aio, rank=store.rank)  # fmt: skip
        # Scratch files of this run: removed when the process ends (a killed process leaves them;
        # fnzero.offload.stale_stores finds and removes those).
        atexit.register(s.close)
        for unit, t in flat.items():  # a state that does not start at zero (the files do), a chunk at a time
            for start in range(0, t.numel(), s.chunk_elems):
                chunks, _ = layout.chunk_parts(inner.init({CHUNK: t[start:start + s.chunk_elems]}))
                for kind, value in chunks.items():
                    if value.any():
                        s.write(unit, kind, value, start=start)
        return NvmeOptState(count=torch.zeros((), dtype=torch.int64), store=s, resident=resident, layout=layout)

    def update_(grads, opt_state: NvmeOptState, params, lr=None, *, momentum=None, **extras):
        s, count = opt_state.store, int(opt_state.count)
        if (s.last_step or 0) != count:
            raise ShardingError(
                f"this TrainState is at step {count} but its NVMe optimizer files are at step {s.last_step}: "
                "with offload_optimizer device nvme the files are updated in place, so only the newest state "
                "can take a step"
            )
        out = {k: p for k, p in params.items() if not is_placeholder(p)}
        direct = {k: p for k, p in out.items() if p.device.type == "cpu" and p.dtype in _STORE_OUT and p.is_contiguous()}
        s.step({k: g.to("cpu") for k, g in grads.items()}, step=count + 1, out=direct, lr=lr, momentum=momentum,
               resident=opt_state.resident, extras=extras)
        for k, p in out.items():
            if k not in direct:  # accelerator (or other-dtype) parameters: copied from the new master
                p.copy_(s.read(k, "master").to(p.dtype))
        return params, dataclasses.replace(opt_state, count=torch.tensor(count + 1, dtype=torch.int64),
                                           resident=_next_resident(inner, opt_state, lr, momentum, extras))

    def update(grads, opt_state: NvmeOptState, params, lr=None, *, momentum=None, **extras):
        fresh = {k: p if is_placeholder(p) else torch.empty_like(p) for k, p in params.items()}
        return update_(grads, opt_state, fresh, lr, momentum=momentum, **extras)

    return Optimizer(init=init, update=update, update_=update_, elementwise=True)


def _next_resident(inner: Optimizer, opt_state: NvmeOptState, lr, momentum, extras) -> tuple:
    """The in-memory leaves after the step, from the same update on an empty sub-group (every
    sub-group started from the same ones and advanced them alike)."""
    layout, empty = opt_state.layout, torch.zeros(0)
    state = layout.chunk_state({kind: empty for kind in layout.kinds}, opt_state.resident)
    _, new_state = inner.update({CHUNK: empty}, state, {CHUNK: empty}, lr, momentum=momentum, **extras)
    return layout.chunk_parts(new_state)[1]


def _aio_kwargs(aio: dict) -> dict:
    """The config's aio block in the names the store takes (DeepSpeed renamed thread_count)."""
    keys = {"block_size", "queue_depth", "thread_count", "single_submit", "overlap_events"}
    out = {k: v for k, v in aio.items() if k in keys and v is not None}
    if "thread_count" not in out and aio.get("intra_op_parallelism") is not None:
        out["thread_count"] = aio["intra_op_parallelism"]
    return out
