"""`deepspeed_to_fnzero`: a DeepSpeed checkpoint rewritten as an fnzero checkpoint, without the
model (`specs/checkpoint-format.md` §DeepSpeed, "Converting to fnzero").

A state is laid out for the model the checkpoint describes (`checkpoint.deepspeed_model`: its
names, shapes, ties, frozen parameters and buffers), in one process; the checkpoint is loaded into
it as any resume loads it (`checkpoint.load`) and saved in fnzero's format. Its own module in the
state layer because it builds a first state, which layers below cannot.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

from .._errors import CheckpointError, ConfigError
from ..checkpoint import deepspeed_model, load, recorded_world, save
from ..config import ConfigWarning, load_config
from ._shard import shard

__all__ = ["deepspeed_to_fnzero"]


def deepspeed_to_fnzero(path: str | os.PathLike, out: str | os.PathLike, *, tag: str | None = None,
                        out_tag: str | None = None, config: Any = None) -> str:
    """Write DeepSpeed checkpoint `path/tag` (default: its `latest`) as fnzero checkpoint
    `out/out_tag` (default: the DeepSpeed tag) and return that directory. Everything `load` reads
    from a DeepSpeed checkpoint is kept (weights, fp32 masters, Adam's moments and step, the
    schedule's position, an fp16 run's loss scale, the client state), with the run's config, so the
    result resumes at any world size and stage (`load`) and converts back
    (`to_deepspeed_universal`). `config`: a DeepSpeed config (path, dict or JSON) to use instead of
    the one the checkpoint recorded. Not a collective: call it in one process. Needs the whole
    model's state in memory once."""
    model, ck = deepspeed_model(path, tag)
    cfg = _config(ck, config)
    like = shard(model, config=cfg).init_state()
    state, client_state = load(path, like, tag=ck.tag, config=cfg)
    handle = save(out, state, tag=out_tag or ck.tag, client_state=client_state or None, config=cfg)
    return handle.wait()


def _config(ck, given: Any):
    """The run's config at its data-parallel size, less what names this machine (NVMe paths,
    offload devices), which says nothing of the state and is the resuming run's to choose."""
    src = given if given is not None else ck.meta.get("ds_config")
    if not src:
        raise CheckpointError(f"{ck.dir}: the checkpoint records no config (ds_config); pass config=")
    if isinstance(src, (str, os.PathLike)) and os.path.isfile(src):
        with open(src, encoding="utf-8") as f:
            src = f.read()
    d = json.loads(src) if isinstance(src, str) else dict(src)
    zero = d.get("zero_optimization")
    if isinstance(zero, dict):
        d["zero_optimization"] = {k: v for k, v in zero.items() if k not in ("offload_optimizer", "offload_param")}
    try:
        with warnings.catch_warnings():
            # Its no-effect keys were warned about when the run loaded it; converting changes nothing.
            warnings.simplefilter("ignore", ConfigWarning)
            return load_config(d, world_size=recorded_world(d, ck.dp))
    except ConfigError as e:
        raise CheckpointError(f"{ck.dir}: the run's config cannot be read: {e}") from None

