"""fnzero.checkpoint: sharded, atomic, resumable checkpoints of a TrainState (`specs/checkpoint-format.md`).

A round trip in a world of one (every rank calls each function):

>>> import tempfile, torch, fnzero
>>> cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"}})
>>> state = fnzero.shard(torch.nn.Linear(3, 2), stage=1, config=cfg).init_state()
>>> d = tempfile.mkdtemp()
>>> _ = save(d, state, tag="t0", client_state={"epoch": 3})
>>> like = fnzero.shard(torch.nn.Linear(3, 2), stage=3, config=cfg).init_state()
>>> loaded, cs = load(d, like=like)
>>> cs, torch.equal(loaded.params["<root>"], state.params["<root>"])
({'epoch': 3}, True)

Public API
----------
save(path, state, *, tag, client_state, config, blocking)   -> SaveHandle (`.wait()`)
load(path, like, *, tag, verify, restore_rng)               -> (state, client_state); fnzero's or DeepSpeed's (ZeRO 1-3, universal)
export(path, out, *, dtype, tag, max_shard_size, exclude_frozen, format, tied, hf_config)
                                                            consolidated weights from files (every rank, or no process group)
export_live(sm, state, out, *, dtype, ..., hf_config)       the same from a running job's state (collective)
export_adapters(sm, state, out, *, adapter, dtype)          a PEFT model's adapters as PEFT's own directory (collective)
info(path, *, verify)                                       tags, world size, stage, sizes, health
to_deepspeed_universal(path, out, *, tag, ds_tag, config)   a DeepSpeed universal checkpoint (load_universal)
deepspeed_model(path, tag)                                  (a module of a DeepSpeed checkpoint's parameters, its description)
list_tags(path)
From the shell: `fnzero export CKPT OUT ...`, `fnzero checkpoint info CKPT` and
`fnzero checkpoint convert CKPT OUT --to deepspeed-universal`.
"""

from ._export import export
from ._ds_universal import to_deepspeed_universal
from ._ds_standin import deepspeed_model
from ._export_live import export_live
from ._info import info
from ._load import list_tags
from ._resume import load
from ._peft_export import export_adapters
from ._handle import SaveHandle
from ._save import save


# What fnzero's other packages use of this package: they import it from here, its face, and
# never from its private modules (`specs/architecture.md` §Package faces).
from ._ds_layout import is_deepspeed
from ._ds_universal import recorded_world
from ._hf_renames import hf_renames
from ._peft_adapters import load_adapters
from ._pretrained import load_pretrained

__all__ = ["save", "load", "export", "export_live", "export_adapters", "info", "list_tags", "SaveHandle",
           "to_deepspeed_universal", "deepspeed_model"]
