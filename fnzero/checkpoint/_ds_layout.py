"""Which DeepSpeed checkpoint a directory holds, and what it is (`specs/checkpoint-format.md`
§DeepSpeed, "Finding the checkpoint"): the save directory (with `latest`, or `latest_universal`),
one `global_stepN` tag directory, or a Hugging Face Trainer `checkpoint-N/` holding one; a tag
directory with a `zero/` directory is a universal checkpoint (`ds_to_universal`'s, or
`to_deepspeed_universal`'s). `describe` reads the first model-states file (its small fields;
tensors stay mapped, unread) and checks that every rank's file is there.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass, field

import torch

from .._errors import CheckpointError
from ._ds_pickle import load_ds_file
from ._format import LATEST_NAME
from ._load import read_latest
from ._safe import entry_kind, is_real_dir, is_real_file

__all__ = ["DsCheckpoint", "is_deepspeed", "find_tag_dir", "describe", "ds_tags", "check_meta", "malformed",
           "check_resumable", "LATEST_UNIVERSAL", "UNIVERSAL_DIR", "UNIVERSAL_OPTIM"]

_MODEL = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_?optim_states\.pt$")
_LAYER = re.compile(r"^layer_(\d+)(?:-model_(\d+))?-model_states\.pt$")
_EXPERT = re.compile(r"^(?:layer_(\d+)_)?expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_EXPP = re.compile(r"^expp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
LATEST_UNIVERSAL = "latest_universal"  # what DeepSpeed's engine reads with `load_universal` (and `latest` without)
UNIVERSAL_DIR = "zero"  # a universal checkpoint's per-parameter directories, beside its model-states files
UNIVERSAL_OPTIM = "optimizer_state.pt"  # in UNIVERSAL_DIR: the optimizer's hyper-parameters, loss scaler, ...


@dataclass
class DsCheckpoint:
    """One DeepSpeed checkpoint (a tag directory) and what its files say."""

    dir: str
    tag: str
    model_files: dict[tuple[int, int], str] = field(default_factory=dict)  # (dp, mp) -> name; dp 0 below stage 3
    optim_files: dict[tuple[int, int], str] = field(default_factory=dict)  # (dp, mp) -> name
    layer_files: dict[tuple[int, int], str] = field(default_factory=dict)  # (layer, tp) -> name
    expert_files: list[str] = field(default_factory=list)
    bf16_prefix: bool = False
    meta: dict = field(default_factory=dict)  # the first model file, less `module` and `optimizer`
    stage: int = 0  # as DeepSpeed's config names it, for reports; the reader goes by `layout`
    # where the trainable weights are: "whole" (the module, and the optimizer's masters in the model
    # file: stage 0), "flat" (flat fp32 partitions in the optimizer files: ZeRO-1/2, BF16_Optimizer),
    # "per_param" (each parameter partitioned, the slices in the optimizer files: ZeRO-3), "universal"
    # (each parameter whole in its own files under zero/: `_ds_universal_read.py`)
    layout: str = "whole"
    precision: str = "fp32"
    dp: int = 1
    tp: int = 1
    pp: int = 1

    def path(self, name: str) -> str:
        return os.path.join(self.dir, name)


def _ds_files(d: str) -> list[str]:
    try:
        return [n for n in os.listdir(d) if n.endswith("_model_states.pt") or n.endswith("-model_states.pt")]
    except OSError:
        return []


def _is_tag_dir(d: str) -> bool:
    return is_real_dir(d) and bool(_ds_files(d))


def ds_tags(root: str) -> list[str]:
    """The DeepSpeed tag directories under `root`, in name order."""
    try:
        names = sorted(os.listdir(root))
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint directory {root!r}: {e.strerror}") from None
    return [n for n in names if not n.startswith(".") and _is_tag_dir(os.path.join(root, n))]


def is_deepspeed(path) -> bool:
    """Whether `path` is a DeepSpeed checkpoint: a tag directory, or a directory whose `latest`
    (else `latest_universal`) names one or that holds one (fnzero's own checkpoints hold an index
    instead; a root whose `latest` names one of fnzero's is fnzero's, whatever else it holds)."""
    root = os.path.abspath(os.fspath(path))
    if not os.path.isdir(root):
        return False
    if _ds_files(root):
        return True
    for name in (LATEST_NAME, LATEST_UNIVERSAL):
        try:
            latest = read_latest(root, name=name)
        except CheckpointError:
            latest = None
        if latest is not None:
            return _is_tag_dir(os.path.join(root, latest))
    return bool(ds_tags(root))


def _latest_tag(root: str, universal: bool) -> str:
    """The tag `latest` names, else `latest_universal` (the other way round with `universal`, as
    DeepSpeed's engine reads `latest_universal` when its config sets `load_universal`)."""
    names = (LATEST_UNIVERSAL, LATEST_NAME) if universal else (LATEST_NAME, LATEST_UNIVERSAL)
    for name in names:
        tag = read_latest(root, name=name)
        if tag is not None:
            return tag
    raise CheckpointError(f"{root!r} has no 'latest' or 'latest_universal' file; pass tag= (DeepSpeed tags here: "
                          f"{ds_tags(root)})")


def find_tag_dir(path, tag: str | None = None, universal: bool = False) -> tuple[str, str]:
    """(root, tag) of the DeepSpeed checkpoint `path` names: itself when it is a tag directory,
    else `tag` under it, else the one its `latest` (or `latest_universal`) names."""
    root = os.path.abspath(os.fspath(path))
    if _ds_files(root):
        if tag is not None and tag != os.path.basename(root):
            raise CheckpointError(f"{root!r} is the DeepSpeed checkpoint {os.path.basename(root)!r}; tag={tag!r} "
                                  "names another (give the directory above it)")
        return os.path.dirname(root), os.path.basename(root)
    if tag is None:
        tag = _latest_tag(root, universal)
    if "/" in tag or tag in ("", ".", ".."):
        raise CheckpointError(f"tag {tag[:60]!r} is not a directory name")
    kind = entry_kind(os.path.join(root, tag))
    if kind != "a directory" or not _ds_files(os.path.join(root, tag)):
        what = "nothing" if kind is None else kind if kind != "a directory" else "a directory without DeepSpeed files"
        raise CheckpointError(f"DeepSpeed checkpoint {tag!r} under {root!r} is {what}")
    return root, tag


def _classify(ck: DsCheckpoint, names: list[str]) -> None:
    for n in names:
        if m := _MODEL.match(n):
            ck.model_files[(int(m.group(1) or 0), int(m.group(2)))] = n
        elif m := _OPTIM.match(n):
            ck.optim_files[(int(m.group(2)), int(m.group(3)))] = n
            ck.bf16_prefix |= bool(m.group(1))
        elif m := _LAYER.match(n):
            ck.layer_files[(int(m.group(1)), int(m.group(2) or 0))] = n
        elif _EXPERT.match(n) or _EXPP.match(n):
            ck.expert_files.append(n)
    if not ck.model_files:
        raise CheckpointError(f"{ck.dir}: no mp_rank_*_model_states.pt file; not a DeepSpeed checkpoint")
    if UNIVERSAL_DIR in names and is_real_dir(ck.path(UNIVERSAL_DIR)):
        ck.layout = "universal"


def _check_ranks(ck: DsCheckpoint, files: dict, what: str, dps: range, mps: range) -> None:
    for mp in mps:
        for dp in dps:
            if (dp, mp) not in files:
                raise CheckpointError(f"{ck.dir}: the {what} file of data-parallel rank {dp}, model-parallel rank "
                                      f"{mp} is missing (the checkpoint was saved by {len(dps)} rank(s))")


def _precision(ck: DsCheckpoint, module) -> str:
    if ck.bf16_prefix:
        return "bf16"
    skip = set(ck.meta.get("buffer_names") or ())
    for name, t in (module or {}).items():
        if isinstance(t, torch.Tensor) and t.is_floating_point() and name not in skip:
            return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(t.dtype, "fp32")
    return _config_precision(ck) or "fp32"


def _config_precision(ck: DsCheckpoint) -> str | None:
    cfg = ck.meta.get("ds_config") or {}
    for key in ("bf16", "fp16"):
        if isinstance(cfg.get(key), dict) and cfg[key].get("enabled") is True:
            return key
    return None


@contextlib.contextmanager
def malformed(where: str):
    """A field of a shape the checks before did not foresee still ends as one `CheckpointError`
    naming the checkpoint, never a raw error from deep inside the reader."""
    try:
        yield
    except CheckpointError:
        raise
    except (TypeError, ValueError, AttributeError, KeyError, IndexError, RuntimeError) as e:
        raise CheckpointError(f"{where}: malformed DeepSpeed checkpoint ({type(e).__name__}: {str(e)[:200]})") from None


def _is_shape(s) -> bool:
    return isinstance(s, (list, tuple)) and all(type(d) is int and d >= 0 for d in s)


def _is_str_map(m, value) -> bool:
    return isinstance(m, dict) and all(isinstance(k, str) and value(v) for k, v in m.items())


_META_RULES = {  # key: (check, what it must be); absent and None are accepted where DeepSpeed writes None
    "module": (lambda m: _is_str_map(m, lambda t: isinstance(t, torch.Tensor)), "a state dict (name -> tensor)"),
    "buffer_names": (lambda v: isinstance(v, list) and all(isinstance(n, str) for n in v), "a list of names"),
    "param_shapes": (lambda v: isinstance(v, list) and all(_is_str_map(g, _is_shape) for g in v),
                     "a list of name -> shape maps"),
    "frozen_param_shapes": (lambda v: _is_str_map(v, _is_shape), "a name -> shape map"),
    "shared_params": (lambda v: _is_str_map(v, lambda o: isinstance(o, str)), "an alias -> name map"),
    "dp_world_size": (lambda v: type(v) is int and v >= 1, "a positive int"),
    "mp_world_size": (lambda v: type(v) is int and v >= 1, "a positive int"),
    "checkpoint_parallel_dimensions": (lambda v: _is_str_map(v, lambda d: type(d) is int and d >= 1),
                                       "a map of positive degrees"),
    "ds_config": (lambda v: isinstance(v, dict), "a dict"),
    "global_steps": (lambda v: type(v) is int, "an int"),
    "skipped_steps": (lambda v: type(v) is int, "an int"),
}


def check_meta(state: dict, where: str) -> None:
    for key, (ok, what) in _META_RULES.items():
        if state.get(key) is not None and not ok(state[key]):
            raise CheckpointError(f"{where}: '{key}' should be {what}")


def optim_of(ck: DsCheckpoint, dp: int, mp: int) -> tuple[dict, str]:
    """Rank `dp`'s (model-parallel rank `mp`'s) `optimizer_state_dict`, and its file's path."""
    name = ck.optim_files[(dp, mp)]
    sd = load_ds_file(ck.dir, name)
    osd = sd.get("optimizer_state_dict") if isinstance(sd, dict) else None
    if not isinstance(osd, dict):
        raise CheckpointError(f"{ck.path(name)}: no 'optimizer_state_dict' entry")
    return osd, ck.path(name)


def _universal(ck: DsCheckpoint, module) -> DsCheckpoint:
    """A universal checkpoint: its stage the saving run's (its config's), its model-states files
    whichever the converter copied (every rank's, or rank 0's: only one is read)."""
    if not is_real_file(os.path.join(ck.dir, UNIVERSAL_DIR, UNIVERSAL_OPTIM)):
        raise CheckpointError(f"{ck.path(os.path.join(UNIVERSAL_DIR, UNIVERSAL_OPTIM))}: missing (or not a regular "
                              "file); a universal checkpoint keeps its optimizer's state there")
    zero = (ck.meta.get("ds_config") or {}).get("zero_optimization") or {}
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    ck.stage = stage if type(stage) is int and stage in (0, 1, 2, 3) else 0
    # (the config first: fnzero's converter writes every parameter as a float32 placeholder)
    ck.precision = _config_precision(ck) or _precision(ck, module)
    return ck


def describe(path, tag: str | None = None, universal: bool = False) -> DsCheckpoint:
    """The DeepSpeed checkpoint `path` (and `tag`) names, with its layout checked. `universal`:
    prefer `latest_universal` to `latest` where no tag is given."""
    root, tag = find_tag_dir(path, tag, universal)
    ck = DsCheckpoint(dir=os.path.join(root, tag), tag=tag)
    _classify(ck, sorted(os.listdir(ck.dir)))
    first = ck.model_files[min(ck.model_files)]
    state = load_ds_file(ck.dir, first)
    if not isinstance(state, dict) or "module" not in state:
        raise CheckpointError(f"{ck.path(first)}: holds no 'module' entry; not a DeepSpeed model-states file")
    check_meta(state, ck.path(first))
    ck.meta = {k: v for k, v in state.items() if k not in ("module", "optimizer")}
    dims = ck.meta.get("checkpoint_parallel_dimensions") or {}
    mp_world = int(ck.meta.get("mp_world_size") or 1)
    ck.pp = int(dims.get("pp_degree", 1)) if ck.layer_files or dims else 1
    ck.tp = int(dims.get("tp_degree", mp_world // max(ck.pp, 1)))
    ck.dp = int(ck.meta.get("dp_world_size") or 1)
    if ck.layout == "universal":
        return _universal(ck, state["module"])
    zero3 = any(dp > 0 for dp, _ in ck.model_files) or _MODEL.match(first).group(1) is not None
    if zero3:
        ck.stage, ck.layout = 3, "per_param"
    _check_ranks(ck, ck.model_files, "model-states", range(ck.dp if zero3 else 1), range(mp_world))
    if ck.optim_files:
        _check_ranks(ck, ck.optim_files, "optimizer-states", range(ck.dp), range(mp_world))
        if not zero3:
            osd, where = optim_of(ck, 0, 0)
            # BF16_Optimizer (a bf16 run at stage 0 or 1) writes no zero_stage, in ZeRO-1's layout.
            ck.meta["bf16_optimizer"] = "zero_stage" not in osd
            zero = (ck.meta.get("ds_config") or {}).get("zero_optimization") or {}
            stage = osd["zero_stage"] if "zero_stage" in osd else zero.get("stage", 0) or 0
            if type(stage) is not int or stage not in (0, 1, 2, 3):
                raise CheckpointError(f"{where}: 'zero_stage' should be a ZeRO stage")
            ck.stage = stage
            ck.layout = "flat"
    elif not zero3:  # the optimizer files left out: the module's own weights, at the config's stage
        zero = (ck.meta.get("ds_config") or {}).get("zero_optimization") or {}
        ck.stage = int(zero.get("stage", 0) or 0) if isinstance(zero, dict) else 0
    else:
        raise CheckpointError(f"{ck.dir}: ZeRO-3 model-states files but no optimizer-states files; the weights "
                              "live in the optimizer files")
    module = state["module"]
    if module is None and ck.layer_files:
        module = load_ds_file(ck.dir, ck.layer_files[min(ck.layer_files)])
    ck.precision = _precision(ck, module)
    return ck


def check_resumable(ck: DsCheckpoint) -> None:
    """Refuse, naming the directory, a checkpoint `load` cannot resume (its weights may still export)."""
    opt = (ck.meta.get("ds_config") or {}).get("optimizer")
    kind = str(opt.get("type", "")) if isinstance(opt, dict) else None
    if kind is not None and kind.lower() not in ("adam", "adamw"):
        raise CheckpointError(f"{ck.dir}: its optimizer is {kind}; only Adam and AdamW state is read "
                              "(exp_avg, exp_avg_sq and step per parameter)")
    if ck.layout == "universal":  # whole tensors whatever the run's tensor parallelism
        if ck.layer_files or ck.expert_files or ck.pp > 1 or ck.meta.get("num_experts"):
            raise CheckpointError(f"{ck.dir}: resuming from a universal checkpoint of a pipeline or MoE run is not "
                                  "implemented yet")
    elif ck.tp > 1:
        raise CheckpointError(f"{ck.dir}: resuming from a tensor-parallel DeepSpeed checkpoint (tp degree {ck.tp}) is "
                              "not implemented yet; its weights export with `fnzero export`")
    low_precision_stage0 = ck.layout == "whole" and ck.precision != "fp32"
    if ck.expert_files and (ck.layout == "per_param" or ck.layer_files or low_precision_stage0):
        raise CheckpointError(f"{ck.dir}: resuming from a DeepSpeed MoE checkpoint is implemented at ZeRO-1/2 and at "
                              "stage 0 in fp32, not this one (ZeRO-3, a pipeline, or a stage-0 low-precision "
                              "optimizer) yet")
    if ck.precision == "fp16" and ck.layout == "whole":
        raise CheckpointError(f"{ck.dir}: resuming from an fp16 ZeRO stage-0 checkpoint (its loss scaler in the "
                              "model file) is not implemented yet; its weights export with `fnzero export`")
