"""Per-rank model-state memory, counted exactly from a TrainState (`specs/sharding.md` §Memory).

`model_state_bytes(state)` counts what the state holds (parameters, master weights, optimizer
state, unique storage only) plus the gradient buffer the step holds for this stage: the whole
padded model at stages 0-1, this rank's shards at stages 2-3, in the gradient-accumulation dtype.
`zero_formula(...)` gives the ZeRO paper's figure for comparison.
"""

from __future__ import annotations

import dataclasses
import functools
import resource
import sys

import optree
import torch

from ._state import TrainState

__all__ = [
    "ModelStateBytes", "allocator_env", "model_state_bytes", "peak_rss_bytes", "return_freed_memory",
    "trim_freed_memory", "zero_formula",
]


@dataclasses.dataclass(frozen=True)
class ModelStateBytes:
    params: int
    master: int
    optimizer: int
    grads: int

    @property
    def total(self) -> int:
        return self.params + self.master + self.optimizer + self.grads


def _unique_bytes(tree, seen: set) -> int:
    total = 0
    for t in optree.tree_leaves(tree):
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            continue  # scalars (step counts) are not model state
        st = t.untyped_storage()
        key = (st.data_ptr(), t.device)
        if key in seen:
            continue
        seen.add(key)
        total += st.nbytes()
    return total


def model_state_bytes(state: TrainState, grad_dtype: torch.dtype | None = None) -> ModelStateBytes:
    """Bytes of model state this rank holds. Views share storage and are counted once, so an fp32
    run whose optimizer updates slices of the parameters shows no separate master copy."""
    plan = state.sharding.plan
    seen: set = set()
    params = _unique_bytes(state.params, seen)
    master = _unique_bytes(state.master, seen) if state.master is not None else 0
    optimizer = _unique_bytes(state.opt_state, seen)
    if grad_dtype is None:
        any_param = next(iter(state.params.values()), None)
        grad_dtype = any_param.dtype if any_param is not None else plan.param_dtype
    esize = torch.empty((), dtype=grad_dtype).element_size()
    grads = 0
    for u in plan.units:
        grads += (u.shard_numel if u.placement.grads else u.padded_numel) * esize
    return ModelStateBytes(params=params, master=master, optimizer=optimizer, grads=grads)


def zero_formula(num_params: int, stage: int, world_size: int, mixed_precision: bool) -> float:
    """ZeRO model-state bytes per rank for Adam: fp32 16Ψ, 8Ψ+8Ψ/N, 4Ψ+12Ψ/N, 16Ψ/N; 16-bit
    with fp32 master 16Ψ, 4Ψ+12Ψ/N, 2Ψ+14Ψ/N, 16Ψ/N."""
    p, n = float(num_params), float(world_size)
    if mixed_precision:
        table = {0: 16 * p, 1: 4 * p + 12 * p / n, 2: 2 * p + 14 * p / n, 3: 16 * p / n}
    else:
        table = {0: 16 * p, 1: 8 * p + 8 * p / n, 2: 4 * p + 12 * p / n, 3: 16 * p / n}
    return table[stage]


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_TRIM_HEAP = False  # set by `return_freed_memory`; read by `_trim_heap`


@functools.cache
def _glibc():
    """glibc through ctypes, or None (not Linux, or a libc without malloc_trim such as musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


def return_freed_memory(mmap_threshold: int = 4 << 20) -> bool:
    """Make glibc give large freed blocks back to the OS: allocations of `mmap_threshold` bytes or
    more are served by mmap and unmapped on free. Returns whether the setting took effect.

    [Note: why] glibc raises its mmap threshold dynamically up to 32 MiB after the first large
    free, after which freed tensors of a few MiB stay in the heap: a sharded run's resident memory
    then keeps what the *unsharded* model once used (construction, the first steps) and does not
    show the savings of the stage. A fixed threshold stops that; smaller blocks (most
    activations) still come from the heap, so steps do not pay for page faults on every tensor.
    `fnzero.init_distributed` applies it; pass `malloc_mmap_threshold=None` there to opt out.
    Mapping fresh pages costs page faults; `fnzero launch` also sets glibc's `malloc.hugetlb`
    tunable (see `allocator_env`) so those mappings use transparent huge pages, 512x fewer faults.
    While the setting holds, CPU steps also trim the heap between each forward and its backward.
    """
    global _TRIM_HEAP
    libc = _glibc()
    if libc is None:  # not glibc (musl, ...): nothing to tune
        return False
    ok = libc.mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold)) == 1
    ok = ok and libc.mallopt(_M_TRIM_THRESHOLD, int(mmap_threshold)) == 1
    _TRIM_HEAP = bool(ok)
    return bool(ok)


def allocator_env(environ: dict | None = None) -> dict:
    """Environment for processes started by `fnzero launch`: glibc's `malloc.hugetlb=1` tunable
    (transparent huge pages for mmap-served blocks; read by glibc at process start only, hence an
    environment variable). Existing GLIBC_TUNABLES are kept; FNZERO_NO_HUGEPAGES=1 opts out."""
    import os

    env = dict(os.environ if environ is None else environ)
    if env.get("FNZERO_NO_HUGEPAGES") == "1":
        return env
    tunables = env.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" not in tunables:
        env["GLIBC_TUNABLES"] = ":".join(t for t in (tunables, "glibc.malloc.hugetlb=1") if t)
    return env


def trim_freed_memory() -> None:
    """Give the heap's free pages back to the OS now (glibc `malloc_trim`; a no-op elsewhere).
    `shard` calls it after releasing the model's own parameter storage."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def _trim_heap() -> None:
    """Called on CPU by the step between a micro-batch's forward and its backward.

    [Note: why] Forward frees its temporaries (sub-threshold blocks, served from the heap) while
    the activations around them stay alive, so the heap holds free holes that backward does not
    fully reuse, and backward's peak sits on top of them. On the 112M GPT at 4 ranks this trim
    lowered the stage-3 peak by ~15 MiB, at 1-2 ms a call. Trimming after every stage-3 unit's
    forward as well saved ~5 MiB more there but cost each step page faults to map the returned
    pages again, so it is not done. Only under the allocator policy of `return_freed_memory`,
    so an opt-out stays an opt-out."""
    if _TRIM_HEAP:
        trim_freed_memory()

