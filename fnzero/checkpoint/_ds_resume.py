"""`load` of a DeepSpeed checkpoint into an fnzero `TrainState` (`specs/checkpoint-format.md`
§DeepSpeed, "Resuming in fnzero"): the fp32 weights, Adam's moments and step, the step counts and
the schedule's position, at any world size and stage of `like`, pipeline and expert parallelism
included (a pipeline stage's `like` holds some of the model's layers; an expert-parallel rank's,
its experts, looked up under their names in the whole model).

Each rank reads only its shard (`_ds_shard`): the element ranges of each parameter its leaves
hold, from the optimizer files that overlap them (stage 0: the model files, `_ds_stage0`; a
universal checkpoint: the parameters' own files, `_ds_universal_read`, frozen ones kept `like`'s),
and at ZeRO-3 of its frozen parameters from the model files that overlap them; below ZeRO-3 frozen
parameters and buffers are read whole by name (`_ds_weights.consolidate`, the trainable ones left
unread); every leaf of `like` is then filled by its unit's slots. An fp16 checkpoint's
loss scaler becomes the state's loss scale (`_ds_loss_scale`). Refused, one `CheckpointError`
naming what: optimizers other than Adam/AdamW, a model whose parameter names or shapes differ,
step counts that disagree, a loss scaler whose policy is not the given config's, an fp16 stage-0
checkpoint, a `like` with its optimizer on NVMe, with tensor parallelism unless the checkpoint is
universal (whole tensors), or with pipeline or expert parallelism from a universal checkpoint.
"""

from __future__ import annotations

import os

import torch

from .._errors import CheckpointError
from .._state import TrainState
from ._ds_layout import check_resumable, describe, optim_of
from ._ds_loss_scale import ds_loss_scale
from ._ds_optim import MOMENTS
from ._ds_shard import ShardRead
from ._ds_stage0 import Stage0Read
from ._ds_trainer import check_trainer_dir
from ._ds_universal_read import UniversalRead, universal_optimizer_state, universal_weights
from ._ds_weights import DsWeights, consolidate
from ._ep import expert_places
from ._load import rebuild_into_constants
from ._same_model import describe as describe_mismatch
from ._tp import tp_check_view
from ._tree import Leaf, units_by_key

__all__ = ["load_deepspeed"]

# The model-states keys DeepSpeed writes itself (engine.py `_common_checkpoint_state`, `_save_checkpoint`);
# `save_checkpoint(client_state=...)` adds the caller's own beside them.
_DS_KEYS = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
            "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
            "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
            "ds_version", "checkpoint_parallel_dimensions", "universal_checkpoint_info", "bf16_optimizer",
            "num_experts", "ds_autoep_layers"}
def load_deepspeed(path, like: TrainState, *, tag: str | None = None, keep_frozen: bool = False,
                   config=None) -> tuple[TrainState, dict]:
    """(state laid out as `like`, the client state `save_checkpoint` was given) from DeepSpeed
    checkpoint `path` (its save directory, `latest` naming the tag, or a tag directory). `config`
    (optional): the step's, whose fp16 block is checked against an fp16 checkpoint's loss scaler,
    and whose `checkpoint.load_universal` prefers `latest_universal` to `latest`."""
    ck = describe(path, tag, universal=bool(config is not None and config.checkpoint.load_universal))
    universal = ck.layout == "universal"
    _check_like(like, universal)
    check_resumable(ck)
    reader = UniversalRead if universal else Stage0Read if ck.layout == "whole" else ShardRead
    shard = reader(ck, like)  # (what this rank needs: nothing read yet)
    step = _step(ck, shard)
    loss_scale = _loss_scale(ck, like, config)
    w = universal_weights(ck, trainable=False, frozen=False) if universal else consolidate(ck, trainable=False)
    tp = like.sharding.tp is not None and like.sharding.tp.size > 1
    _check_model(w, tp_check_view(like) if tp else like, keep_frozen)
    # A universal checkpoint holds no frozen parameters (DeepSpeed's universal load takes them from
    # the model): they stay `like`'s own, as `keep_frozen` keeps them.
    keep_frozen = keep_frozen or universal
    shard.read()
    names = {a: first for first, aliases in w.aliases.items() for a in aliases}
    units = units_by_key(like.sharding.plan)

    def whole(field: str, name: str, a: int | None = None, b: int | None = None) -> torch.Tensor:
        if a is not None and (got := shard.piece(field, name, a, b)) is not None:
            return got
        if field != "weights":  # (trainable here, frozen in the checkpoint: it holds no moments for it)
            raise CheckpointError(f"{ck.dir}: holds no optimizer state for {name!r} (frozen when it was saved)")
        t = w.tensors[names.get(name, name)]
        return t if a is None else t.reshape(-1)[a:b]

    def fill(leaf: Leaf) -> torch.Tensor:
        return _leaf(leaf, like, units, whole, step + shard.extra_steps, keep_frozen)

    state = rebuild_into_constants(like, fill, step=torch.tensor(step, dtype=torch.int64))
    if loss_scale is not None:
        state = state.replace(loss_scale=loss_scale)
    return state, {k: v for k, v in ck.meta.items() if k not in _DS_KEYS}


def _check_like(like: TrainState, universal: bool) -> None:
    from ..offload import is_nvme

    sh = like.sharding
    if sh.tp is not None and sh.tp.size > 1 and not universal:
        raise CheckpointError("loading a DeepSpeed checkpoint into a state with tensor parallelism is not implemented "
                              "yet (data-, pipeline- and expert-parallel states at any ZeRO stage are, and "
                              "tensor-parallel ones from a universal checkpoint)")
    if universal and ((sh.pp is not None and sh.pp.stages > 1) or sh.ep is not None):
        raise CheckpointError("loading a DeepSpeed universal checkpoint into a state with pipeline or expert "
                              "parallelism is not implemented yet (its regular checkpoint loads into one)")
    if is_nvme(like):
        raise CheckpointError("loading a DeepSpeed checkpoint into a state with its optimizer on NVMe is not "
                              "implemented yet")
    if type(like.opt_state).__name__ != "AdamState":
        raise CheckpointError(f"a DeepSpeed checkpoint is read into an Adam or AdamW state only; the state you are "
                              f"loading into holds {type(like.opt_state).__name__}")


def _loss_scale(ck, like: TrainState, config):
    """An fp16 run's loss scaler (data-parallel rank 0's copy) as the state's loss scale; None for
    the others."""
    if ck.precision != "fp16":
        return None
    osd, where = universal_optimizer_state(ck) if ck.layout == "universal" else optim_of(ck, 0, 0)
    return ds_loss_scale(where, osd, like, config)


def _step(ck, shard) -> int:
    """Adam's step count, which is fnzero's `step` (applied steps): checked against DeepSpeed's
    global_steps less skipped_steps, and against its schedule's position: both kinds step with the
    optimizer, skipped steps excepted, from -1 for DeepSpeed's own (`last_batch_iteration`: one
    less) and from 0 for a torch scheduler the client passed (`last_epoch`: equal, as a Hugging Face
    Trainer's `LambdaLR`)."""
    adam = shard.adam_step()  # (of the first file this rank reads: `read` checks each other one alike)
    global_steps, skipped = ck.meta.get("global_steps"), ck.meta.get("skipped_steps") or 0
    if type(global_steps) is not int or global_steps - skipped != adam:
        raise CheckpointError(f"{ck.dir}: the optimizer's step {adam} is not global_steps {global_steps} less "
                              f"skipped_steps {skipped}; the files disagree on how far the run got")
    sched = ck.meta.get("lr_scheduler")
    key = next((k for k in ("last_batch_iteration", "last_epoch") if isinstance(sched, dict) and k in sched), None)
    want = adam - 1 if key == "last_batch_iteration" else adam
    if key is not None and sched[key] != want:
        raise CheckpointError(f"{ck.dir}: the schedule's {key} {sched[key]} is not the optimizer's step {adam}"
                              f"{' less one' if want != adam else ''} (global_steps {global_steps}); fnzero's "
                              "schedule is a function of the step and cannot resume it")
    check_trainer_dir(os.path.dirname(ck.dir), global_steps, adam)
    return adam


def _check_model(w: DsWeights, like: TrainState, keep_frozen: bool) -> None:
    """The checkpoint's trainable, frozen and buffer names and shapes are `like`'s, else one
    message naming every difference."""
    places = expert_places(like.sharding)  # (every layer's experts, by their names in the whole model)
    plan = places.whole if places is not None else like.sharding.plan
    stage_only = like.sharding.pp is not None and like.sharding.pp.stages > 1  # (some of the model's layers)
    saved = {n: tuple(t.shape) for n, t in w.tensors.items() if n not in w.buffers}
    saved.update({a: saved[first] for first, aliases in w.aliases.items() for a in aliases})
    mine = {n: tuple(s.shape) for u in plan.units for s in u.slots for n in (s.name, *s.aliases)}
    if not keep_frozen:
        mine.update({s.name: tuple(s.shape) for u in plan.frozen_units for s in u.slots})
        mine.update({n: tuple(t.shape) for n, t in like.frozen.items() if plan.frozen_unit(n) is None})
    else:
        saved = {n: s for n, s in saved.items() if n not in w.frozen}
    transient = set(plan.saved.non_persistent)  # DeepSpeed saves none of them: `like`'s are kept
    mine.update({f"{n} (buffer)": tuple(t.shape) for n, t in like.buffers.items() if n not in transient})
    saved.update({f"{n} (buffer)": tuple(w.tensors[n].shape) for n in w.buffers})
    only_mine = [n for n in mine if n not in saved]
    only_saved = [] if stage_only else [n for n in saved if n not in mine]
    reshaped = [(n, mine[n], saved[n]) for n in mine if n in saved and saved[n] != mine[n]]
    if only_mine or only_saved or reshaped:
        raise CheckpointError("the DeepSpeed checkpoint does not hold the model you are loading into: "
                              + describe_mismatch(only_mine, only_saved, reshaped))


def _leaf(leaf: Leaf, like: TrainState, units: dict, whole, count: int, keep_frozen: bool) -> torch.Tensor:
    """One leaf of `like`, from the tensors by name (`whole(field, name[, a, b])`); `count`: Adam's."""
    t = leaf.tensor
    top, _, rest = leaf.path.partition("/")
    if leaf.per_rank:
        raise CheckpointError(f"{leaf.path!r} is per-rank state, which a DeepSpeed checkpoint does not hold")
    if leaf.path == "opt_state/count":
        return torch.tensor(count, dtype=t.dtype, device=t.device)
    if (top == "frozen" and keep_frozen) or (top == "buffers" and rest in like.sharding.plan.saved.non_persistent):
        return t  # (a buffer registered persistent=False, as a Llama's rotary `inv_freq`: in no DeepSpeed file)
    if leaf.unit is None:  # a replicated tensor by its name: a buffer or a frozen parameter
        if top not in ("frozen", "buffers"):
            raise CheckpointError(f"{leaf.path!r} of the state has no counterpart in a DeepSpeed checkpoint")
        return whole("weights", rest, 0, t.numel()).to(t.dtype).reshape(t.shape).to(t.device)
    field = "weights" if top in ("params", "master", "frozen") else rest.partition("/")[0]
    if field not in ("weights", *MOMENTS):
        raise CheckpointError(f"{leaf.path!r} of the state has no counterpart in a DeepSpeed checkpoint")
    out = torch.zeros(t.numel(), dtype=t.dtype)  # the unit's padding stays zero
    for s in units[leaf.unit].slots:
        a, b = max(leaf.lo, s.offset), min(leaf.hi, s.offset + s.numel)
        if a < b:
            out[a - leaf.lo: b - leaf.lo] = whole(field, s.name, a - s.offset, b - s.offset)
    return out.reshape(t.shape).to(t.device)
