"""`export_adapters`: a running PEFT job's adapters as PEFT's own directory, which
`PeftModel.from_pretrained(base, dir)` loads (`specs/peft.md` §Export): only the units that
hold the adapter's tensors are gathered, then one rank writes (`_one_writer.py`).
"""

from __future__ import annotations

import copy
import os

from .._errors import CheckpointError
from ._export import _cast_dtype, _Entry, _write_all, parse_dtype
from ._one_writer import Rounds
from ._peft_adapters import CONFIG, WEIGHTS, adapter_names
from ._tree import slots_by_name

__all__ = ["export_adapters"]


def export_adapters(sm, state, out: str | os.PathLike, *, adapter: str | None = None, dtype=None) -> list[str]:
    """Write the trained adapter of a PEFT model (`peft.get_peft_model(...)` sharded by
    `fnzero.shard`) to the directory `out` as `PeftModel.save_pretrained` writes it; returns the
    paths written, on every rank. Collective, as `export_live` (`specs/peft.md` §Export).

    `adapter`: which adapter (None: the model's only one). `dtype`: 'fp32', 'bf16', ... (None:
    the dtype the state keeps them in). Load it back with `PeftModel.from_pretrained(base, out)`,
    or resume with `sm.init_state(pretrained=base_dir, adapters=out)`.

    >>> fnzero.checkpoint.export_adapters(sm, state, "lora_out")  # doctest: +SKIP
    """
    want = parse_dtype(dtype)
    if state.sharding.pp is not None and state.sharding.pp.stages > 1:
        raise CheckpointError("export_adapters of a pipeline-parallel state is not implemented yet")
    names = adapter_names(sm.module, adapter)  # every rank checks the arguments before any collective
    trainable = slots_by_name(sm.plan)
    frozen = sorted(m for m in names.to_model.values() if m not in trainable)
    if frozen:
        raise CheckpointError(f"adapter tensors that are not trainable in this model, so not in the state's "
                              f"parameters: {frozen[:8]}")
    full = sm.gather(state, names=set(names.to_model.values()))
    tp = state.sharding.tp if state.sharding.tp is not None and state.sharding.tp.size > 1 else None
    comm = state.sharding.comm
    replicas = state.sharding.replicas  # MiCS: every shard group holds the same; the first one's rank 0 writes
    writes = comm.rank == 0 and (tp is None or tp.rank == 0) and (replicas is None or replicas.rank == 0)
    rounds = Rounds([comm, tp.comm if tp is not None else None, replicas], writes, state.sharding.device)
    if not writes:
        return rounds.result()

    def write() -> list[str]:
        entries = []
        for saved, name in sorted(names.to_model.items()):
            t = full[name]
            dt = _cast_dtype(t.dtype, want)
            entries.append(_Entry(saved, t.shape, dt, lambda a, b, t=t, dt=dt: t.reshape(-1)[a:b].cpu().to(dt)))
        paths = _write_all(entries, os.path.join(os.fspath(out), WEIGHTS), "safetensors", None, False, {"format": "pt"})
        config = copy.deepcopy(names.config)
        config.inference_mode = True  # as PeftModel.save_pretrained records it
        # Without a task type PEFT records the base model's class, which AutoPeftModel builds.
        base = type(sm.module.get_base_model())
        auto = {"base_model_class": base.__name__, "parent_library": base.__module__} if config.task_type is None else None
        config.save_pretrained(os.fspath(out), auto_mapping_dict=auto)
        return paths + [os.path.abspath(os.path.join(os.fspath(out), CONFIG))]

    return rounds.write(write)
