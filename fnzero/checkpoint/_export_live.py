"""`export_live`: consolidated weights from a running job's state, the collective form of
`export` (`specs/checkpoint-format.md` §Export)."""

from __future__ import annotations

import os

import torch

from .._errors import CheckpointError
from ..sharding import ShardSource, held, read_placeholders, sources_of
from ._export import Naming, _Entry, _cast_dtype, _check_arguments, _write_all
from ._hf_config import hf_source, module_source, write_hf_files
from ._ep import check_ep_supported, expert_places
from ._one_writer import Rounds

__all__ = ["export_live"]


class _Gathered:
    """The whole units of a running job, gathered in plan order by every rank of its data-parallel
    group, one at a time, each after a round (`_one_writer.py`): the writer asks for a unit when
    it writes it, the others take part in the same gathers."""

    def __init__(self, units, src: dict, comm, rounds: Rounds, source: ShardSource | None = None, sharding=None):
        self.units, self.src, self.comm, self.rounds = units, src, comm, rounds
        self.source = source  # where placeholder shards are read from (`offload_param: nvme`)
        # Expert parallelism: an expert unit is gathered over its expert-data-parallel ranks, then
        # every ep rank's into the whole layer's (`_ep.py`).
        self.ep = sharding.ep if sharding is not None else None
        self.places = expert_places(sharding) if self.ep is not None else None
        self.expert_comm = sharding.expert_comm if sharding is not None else None
        self.index = {u.name: i for i, u in enumerate(units)}
        self.next, self.full = 0, None  # the next unit to gather; the last one gathered (one alive at a time)

    def upto(self, i: int) -> bool:
        """Gather units through `i`; False (on a rank that does not write) when the writer stopped."""
        from ..sharding import full_unit

        while self.next <= i:
            if self.rounds.writes:
                self.rounds.beat(force=True)
            elif not self.rounds.follow():
                return False
            u = self.units[self.next]
            self.full = None  # drop the previous unit before gathering the next
            comm = self.expert_comm if u.is_expert else self.comm
            full = full_unit(u, held(self.src[u.name], self.source, u.name), comm)
            if u.is_expert:
                full = self.places.consolidate(u, self.ep.comm.all_gather(full).view(self.ep.size, -1))
            self.full = full.cpu()
            self.next += 1
        return True

    def of(self, name: str) -> torch.Tensor:
        self.upto(self.index[name])
        assert self.next - 1 == self.index[name], "export_live reads the units in plan order"
        return self.full


def export_live(
    sm,
    state,
    out: str | os.PathLike,
    *,
    dtype="fp32",
    max_shard_size: int | str | None = None,
    exclude_frozen: bool = False,
    format: str = "safetensors",
    tied: str = "auto",
    progress: bool | None = None,
    hf_config=None,
) -> list[str]:
    """Export from a live state (DeepSpeed's `save_16bit_model`), the collective form of `export`:
    every rank calls it with its state, units are gathered one at a time, one rank writes, and
    every rank returns its paths or raises its failure (`specs/checkpoint-format.md` §Export).
    The arguments are `export`'s; `hf_config` defaults to the sharded model's own Hugging Face
    config (`hf_config=False`: the weights only)."""
    from ._tp import consolidated

    want = _check_arguments(dtype, format, tied, max_shard_size)
    hf = hf_source(module_source(sm.module) if hf_config is None else hf_config)
    tp = state.sharding.tp if state.sharding.tp is not None and state.sharding.tp.size > 1 else None
    if state.sharding.pp is not None and state.sharding.pp.stages > 1:
        raise CheckpointError("export_live of a pipeline-parallel state is not implemented yet: save a checkpoint "
                              "(fnzero.checkpoint.save) and export it (fnzero.checkpoint.export, on every rank), "
                              "which needs no running job")
    check_ep_supported(state, optimizer=False)
    if tp is not None:  # the whole model's units, as without tensor parallelism (weights only)
        state = consolidated(read_placeholders(state).replace(opt_state=None))
    plan, comm = state.sharding.plan, state.sharding.comm
    replicas = state.sharding.replicas  # MiCS: every shard group holds the same; the first one's rank 0 writes
    writes = comm.rank == 0 and (tp is None or tp.rank == 0) and (replicas is None or replicas.rank == 0)
    rounds = Rounds([comm, tp.comm if tp is not None else None, replicas], writes, state.sharding.device)
    sources = sources_of(state.sharding)  # shards in NVMe stores are read a unit at a time
    units = _Gathered(plan.units, state.master if state.master is not None else state.params, comm, rounds,
                      sources.params, state.sharding)
    # Stage 3's frozen units, gathered after every trainable unit (`_live_entries`), unless left out.
    frozen = _Gathered(() if exclude_frozen else plan.frozen_units, state.frozen, comm, rounds, sources.frozen)
    if not writes:
        units.upto(len(units.units) - 1)
        frozen.upto(len(frozen.units) - 1)
        return rounds.result()

    def write() -> list[str]:
        naming = Naming.of_plan(state.sharding.plan, tied)
        paths = _write_all(_live_entries(state, units, frozen, want, naming, exclude_frozen), out, format,
                           max_shard_size, progress, {"format": "pt", "fnzero_step": str(int(state.step))})
        units.upto(len(units.units) - 1)  # units with nothing to write: the others gather them too
        frozen.upto(len(frozen.units) - 1)
        return paths + write_hf_files(hf, os.path.dirname(paths[0]), want)

    return rounds.write(write)


def _live_entries(state, units: _Gathered, frozen: _Gathered, want, naming: Naming, exclude_frozen: bool) -> list[_Entry]:
    """What `export_live` writes from a (tensor-parallel: consolidated) state."""
    src = state.master if state.master is not None else state.params
    entries = []
    for u in units.places.whole.units if units.places is not None else state.sharding.plan.units:
        dt = _cast_dtype(src[u.name].dtype, want)
        for s in u.slots:
            entries += naming.entries([s.name, *s.aliases], s.shape, dt,
                                      lambda a, b, u=u, o=s.offset, dt=dt: units.of(u.name)[o + a: o + b].to(dt))
    last = len(units.units) - 1

    def frozen_piece(u, o: int, a: int, b: int, dt) -> torch.Tensor:
        units.upto(last)  # every rank gathers the trainable units first, whatever was written
        return frozen.of(u.name)[o + a: o + b].to(dt)

    for u in frozen.units:
        dt = _cast_dtype(state.frozen[u.name].dtype, want)
        for s in u.slots:
            entries += naming.entries([s.name, *s.aliases], s.shape, dt,
                                      lambda a, b, u=u, o=s.offset, dt=dt: frozen_piece(u, o, a, b, dt))
    whole = {n: state.frozen[n] for n in state.sharding.plan.frozen}
    for kind, named in (("frozen", whole), ("buffers", state.buffers)):
        if kind == "frozen" and exclude_frozen:
            continue
        for name, t in named.items():
            dt = _cast_dtype(t.dtype, want)
            entries += naming.entries([name], t.shape, dt,
                                      lambda a, b, t=t, dt=dt: t.detach().reshape(-1)[a:b].cpu().to(dt))
    return entries
