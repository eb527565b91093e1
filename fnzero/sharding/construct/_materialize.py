"""Building a sharded model from one constructed on the meta device, one region (a unit module's
subtree without the units nested in it; the root's: the rest) at a time, its init code recorded
and replayed (`Recorded`) or run over the region materialised (`Region`) (`specs/sharding.md`
§Meta construction)."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..._errors import ShardingError
from ..zero import ShardPlan, owner_module
from ._adapter_init import AdapterInit
from ._replay import Recording, TensorRecord, Unreplayable, seed_of, sentinel_fill

__all__ = ["build_on_meta", "is_meta_model", "MetaInitializer", "Region", "Recorded", "GLOBAL_RNG_LOCK"]


# A region's reseeding and draws from torch's process-wide RNG must not interleave with another
# thread's (simulated ranks; `fnzero.testing.seeded` shares it). Re-entrant: shard inside `seeded`.
GLOBAL_RNG_LOCK = threading.RLock()


def build_on_meta(factory: Callable[[], nn.Module]) -> nn.Module:
    """Call a zero-argument model factory with the meta device as the default."""
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, nn.Module):
        raise ShardingError(f"the model factory given to fnzero.shard returned {type(model).__name__}, not an nn.Module")
    return model


def is_meta_model(model: nn.Module) -> bool:
    return any(t.is_meta for t in model.parameters()) or any(t.is_meta for t in model.buffers())


def _untouched(t: torch.Tensor) -> bool:
    """Whether `t` still holds the sentinel somewhere (a float) or everywhere (an integer)."""
    if t.numel() == 0 or t.dtype == torch.bool:
        return False
    if t.is_floating_point() or t.is_complex():
        # One reduction first: a sum without NaN proves there is none (+inf and -inf may also make one)
        return bool(torch.isnan(t.sum())) and bool(torch.isnan(t).any())
    return bool((t == torch.iinfo(t.dtype).min).all())


class MetaInitializer:
    """Materialises and initialises a meta model region by region."""

    def __init__(self, model: nn.Module, plan: ShardPlan, seed: int):
        self.model = model
        self.seed = seed
        unit_paths = list(dict.fromkeys(u.module for u in (*plan.units, *plan.frozen_units) if u.module != ""))
        modules = dict(model.named_modules(remove_duplicate=False))
        self.paths = {id(m): p for p, m in reversed(list(modules.items()))}  # first path of each module
        # Children before parents, as `Module.apply` visits them.
        self.post_order: list[nn.Module] = []
        seen: set[int] = set()

        def visit(m: nn.Module) -> None:
            if id(m) in seen:
                return
            seen.add(id(m))
            for c in m.children():
                visit(c)
            self.post_order.append(m)

        visit(model)
        # Every place a tensor is registered (tied parameters live in several modules).
        self.owners: dict[int, list[tuple[nn.Module, str, str]]] = {}
        for m in self.post_order:
            for kind in ("_parameters", "_buffers"):
                for leaf, t in getattr(m, kind).items():
                    if t is not None:
                        self.owners.setdefault(id(t), []).append((m, kind, leaf))
        self.init_owner = self._init_owners()
        self.adapters = AdapterInit(model, self.paths)  # PEFT's layers init their own adapters
        # Each tensor's first name (its random draws are named by it when its init is replayed).
        self.names: dict[int, str] = {}
        for n, t in [*model.named_buffers(remove_duplicate=False), *model.named_parameters(remove_duplicate=False)]:
            self.names.setdefault(id(t), n)
        # Each module's region: the innermost unit module at or above it ('' for the root), found
        # as the plan finds a parameter's unit.
        self.region = {id(m): owner_module(self.paths[id(m)] + ".", unit_paths) for m in self.post_order}

    def _init_owners(self) -> dict[int, nn.Module]:
        """For each module, the nearest module at or above it that defines `_init_weights`."""
        out: dict[int, nn.Module] = {}

        def visit(m: nn.Module, owner: nn.Module | None) -> None:
            if callable(getattr(m, "_init_weights", None)):
                owner = m
            if owner is not None:
                out[id(m)] = owner
            for c in m.children():
                visit(c, owner)

        visit(self.model, None)
        return out

    def regions(self, order: list[str]) -> list[str]:
        """Every region, those named in `order` first (in that order)."""
        rest = []
        for m in self.post_order:
            r = self.region[id(m)]
            if r not in order and r not in rest:
                rest.append(r)
        return list(order) + rest

    def _modules(self, region: str, extra: tuple[nn.Module, ...]) -> list[nn.Module]:
        return [m for m in self.post_order if self.region[id(m)] == region or any(m is e for e in extra)]

    def _run_init(self, modules: list[nn.Module], region: str) -> None:
        """The model's init code over `modules` as eager construction runs it (§Meta construction, step
        1), then PEFT's adapter init (`_adapter_init.py`)."""
        with GLOBAL_RNG_LOCK, torch.random.fork_rng(devices=[]), torch.no_grad():
            # The CPU generator only: torch.manual_seed would also reseed (and leave reseeded)
            # every accelerator's generator.
            torch.default_generator.manual_seed(seed_of(self.seed, region))
            for m in modules:
                _reset(m)
            for m in modules:
                owner = self.init_owner.get(id(m))
                if owner is not None and not self.adapters.model_init_skips(m):
                    owner._init_weights(m)
            self.adapters.run(modules)

    @contextlib.contextmanager
    def initialised(self, region: str, extra: tuple[nn.Module, ...] = ()) -> Iterator["Region | Recorded"]:
        """`region`'s initial values (and `extra`'s): recorded and replayed, else materialised."""
        modules = self._modules(region, extra)
        recorded = self._recorded(modules, region)
        if recorded is not None:
            yield recorded
            return
        with self.materialized(region, extra) as mat:
            yield mat

    def _recorded(self, modules: list[nn.Module], region: str) -> "Recorded | None":
        """The init code of `region` run over stand-ins for its meta tensors (`_replay.py`) and
        recorded; None if it cannot be replayed (the modules are then as they were)."""
        tensors: dict[int, torch.Tensor] = {}
        for m in modules:
            for t in [*m._parameters.values(), *m._buffers.values()]:
                if t is not None:
                    tensors.setdefault(id(t), t)
        if not all(t.is_meta for t in tensors.values()):
            return None  # real tensors are the init code's to read but not to change: materialised
        try:
            recording = Recording({self.names[k]: t for k, t in tensors.items()}, self.seed)
        except Unreplayable:
            return None
        owners = {id(o): o for k in tensors for o, _, _ in self.owners[k]} | {id(m): m for m in modules}
        # Construction only: stand-ins go into the owners' table entries and the entries come back
        # after (contents restored, the dicts themselves kept, as `zero/_backward.py`'s `bind`).
        tables = [(m, dict(m._parameters), dict(m._buffers)) for m in owners.values()]
        stands = {k: recording.standins[self.names[k]] for k in tensors}
        for k, stand in stands.items():
            for owner, kind, leaf in self.owners[k]:
                getattr(owner, kind)[leaf] = stand
        try:
            self._run_init(modules, region)
            records = recording.result()
        except Exception:  # Unreplayable, raised by a stand-in (init code that reads values, `.item()`)
            records = None
        # The init code wrote into the stand-ins, or replaced or added tensors (then materialised).
        kept = all(getattr(o, kind).get(leaf) is stands[k] for k in tensors for o, kind, leaf in self.owners[k])
        kept = kept and all(m._parameters.keys() == p.keys() and m._buffers.keys() == b.keys() for m, p, b in tables)
        for m, params, bufs in tables:
            m._parameters.clear(), m._parameters.update(params), m._buffers.clear(), m._buffers.update(bufs)
        if records is None or not kept:
            return None
        return Recorded({k: records[self.names[k]] for k in tensors})

    @contextlib.contextmanager
    def materialized(self, region: str, extra: tuple[nn.Module, ...] = ()) -> Iterator["Region"]:
        """Give `region`'s modules (and `extra`) real host storage and run their init; yields the
        values by id of the meta tensor, put back on exit."""
        modules = self._modules(region, extra)
        out = Region()
        swapped: list[tuple[dict, str, Any]] = []  # table entries replaced (construction only), put back on exit
        try:
            for m in modules:
                for kind in ("_parameters", "_buffers"):
                    for leaf, t in list(getattr(m, kind).items()):
                        if t is None or not t.is_meta or id(t) in out.values:
                            continue
                        real = torch.empty(t.shape, dtype=t.dtype, device="cpu")
                        sentinel_fill(real)
                        if isinstance(t, nn.Parameter):
                            real = nn.Parameter(real, requires_grad=t.requires_grad)
                        out.values[id(t)] = real
                        out.versions[id(t)] = real._version
                        for owner, okind, oleaf in self.owners[id(t)]:
                            table = getattr(owner, okind)
                            swapped.append((table, oleaf, table[oleaf]))
                            table[oleaf] = real
            # Real tensors of a partly-meta model (loaded, or built on a device) are not the init
            # code's to change: kept aside and written back.
            fresh = {id(v) for v in out.values.values()}
            keep = [(t, t.detach().clone()) for m in modules for kind in ("_parameters", "_buffers")
                    for t in getattr(m, kind).values() if t is not None and not t.is_meta and id(t) not in fresh]
            self._run_init(modules, region)
            with torch.no_grad():
                for t, saved in keep:
                    t.copy_(saved)
            for key, real in list(out.values.items()):  # an init that replaced a tensor instead
                owner, kind, leaf = self.owners[key][0]
                now = getattr(owner, kind)[leaf]
                if now is not real and now is not None and not now.is_meta:
                    out.values[key], out.versions[key] = now, -1
            yield out
        finally:
            for table, leaf, old in reversed(swapped):
                table[leaf] = old


class Region:
    """The materialised tensors of one region: id(meta tensor) -> value, and each value's
    version counter right after its sentinel fill (init code writes in place, which bumps it)."""

    def __init__(self):
        self.values: dict[int, torch.Tensor] = {}
        self.versions: dict[int, int] = {}

    def __contains__(self, key: int) -> bool:
        return key in self.values

    def keys(self):
        return self.values.keys()

    def untouched(self, key: int) -> bool:
        v = self.values[key]
        if self.versions[key] != -1 and v._version == self.versions[key]:
            return True
        return _untouched(v)

    def whole(self, key: int) -> torch.Tensor:
        return self.values[key].detach()

    def fill(self, key: int, lo: int, hi: int, out: torch.Tensor) -> None:
        """Elements [lo, hi) of the flat value into `out`."""
        out.copy_(self.values[key].detach().reshape(-1)[lo:hi])


class Recorded:
    """A region's init code recorded (`_replay.py`): id(meta tensor) -> its record."""

    def __init__(self, records: dict[int, TensorRecord]):
        self.records = records

    def __contains__(self, key: int) -> bool:
        return key in self.records

    def keys(self):
        return self.records.keys()

    def untouched(self, key: int) -> bool:
        return self.records[key].untouched()

    def whole(self, key: int) -> torch.Tensor:
        return self.records[key].whole()

    def fill(self, key: int, lo: int, hi: int, out: torch.Tensor) -> None:
        self.records[key].fill(lo, hi, out)


def _reset(m: nn.Module) -> None:
    reset = getattr(m, "reset_parameters", None) or getattr(m, "_reset_parameters", None)
    if callable(reset):
        reset()
