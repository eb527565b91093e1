"""Write the table of every key spelling DeepSpeed 0.19.8's config models accept, and what DeepSpeed
makes of a sample value of each, for tests/test_config_deepspeed_keys.py.

DeepSpeed is not a dependency of fnzero (its sdist builds for a minute; it is not in the `test`
extra), so the table is checked in, and this script regenerates it where DeepSpeed is importable:

    python -m venv /tmp/dsvenv && /tmp/dsvenv/bin/pip install torch==2.13.0 deepspeed==0.19.8
    DS_BUILD_OPS=0 /tmp/dsvenv/bin/python tests/scripts/deepspeed_config_table.py      # rewrite the table
    /tmp/dsvenv/bin/python tests/scripts/deepspeed_config_table.py --check             # compare only

It walks the pydantic models (`DeepSpeedConfigModel` subclasses) the training config is parsed
with: each field's name, its `alias`, and the deprecated fields (`json_schema_extra` "deprecated",
"new_param"). For each spelling it builds a whole config (with a sample value, and with values on
each side of every bound the field declares), parses it with DeepSpeed's own
`DeepSpeedConfig` (one process, world size 1), and records the value DeepSpeed resolved, or that it
refused the config. It records both spellings given together too, each field's resolved default, and
the keys DeepSpeed refuses in any form (removed features).
"""

from __future__ import annotations

import argparse
import enum
import json
import os
import pathlib
import sys
import typing
import warnings

TABLE = pathlib.Path(__file__).resolve().parents[1] / "data" / "deepspeed_0_19_8_config_keys.json"
VERSION = "0.19.8"
BASE = {"train_batch_size": 1}

# JSON path of each model in the training config -> (how to read it from a DeepSpeedConfig, the
# config around the block). Offload blocks sit at stage 3, where DeepSpeed reads all their keys.
SECTIONS: dict[str, tuple[str, dict]] = {
    "zero_optimization": ("zero_config", {}),
    "zero_optimization.offload_param": ("zero_config.offload_param", {"zero_optimization": {"stage": 3}}),
    "zero_optimization.offload_optimizer": ("zero_config.offload_optimizer", {"zero_optimization": {"stage": 3}}),
    "zero_optimization.leaf_module": ("zero_config.leaf_module", {}),
    "zero_optimization.zenflow": ("zero_config.zenflow", {}),
    "fp16": ("float16_config", {}),
    "bf16": ("bfloat16_config", {}),
    "tensor_parallel": ("tensor_parallel_config", {}),
    "tensor_parallel.tp": ("tensor_parallel_config.tensor_parallel", {}),
    "comms_logger": ("comms_config.comms_logger", {}),
    "tensorboard": ("monitor_config.tensorboard", {}),
    "csv_monitor": ("monitor_config.csv_monitor", {}),
    "wandb": ("monitor_config.wandb", {}),
    "comet": ("monitor_config.comet", {}),
    "compile": ("compile_config", {}),
    "hybrid_engine": ("hybrid_engine", {}),
    "timers.throughput": ("timers_config", {}),
}
# Models that are not part of the training config, and why.
SKIPPED = {
    "inference": "deepspeed.init_inference's config (deepspeed/inference/), not a key of the training JSON",
    "DeepSpeedMonitorConfig": "a holder of the top-level tensorboard/wandb/csv_monitor/comet blocks, not a key",
}
# Values beyond the one sample per field (DeepSpeed types these `int`: a fraction is refused there).
EXTRA_SAMPLES = {"fp16.min_loss_scale": [0.5, 1e-10, 2.0], "fp16.loss_scale_window": [0.5]}
# Sections whose bounds are not sampled: fnzero drops these blocks unread when off (hybrid_engine) or
# refuses them whole (zenflow), so a bound inside them says nothing about fnzero's reading.
NO_BOUND_SAMPLES = ("hybrid_engine", "zero_optimization.zenflow")
# A sample DeepSpeed would accept here and fail on later (any string for a preset name).
SAMPLE_OVERRIDES = {"tensor_parallel.preset_model": "llama"}
# The config around a deprecated key that turns on offload: DeepSpeed reads offload at stage 3.
FIELD_CONTEXT = {"zero_optimization.cpu_offload_param": {"zero_optimization": {"stage": 3}},
                 "zero_optimization.cpu_offload": {"zero_optimization": {"stage": 3}}}


def _models():
    """Import every module that defines a DeepSpeedConfigModel, then walk the subclasses."""
    import importlib

    from deepspeed.runtime.config_utils import DeepSpeedConfigModel

    for name in ("deepspeed.runtime.config", "deepspeed.inference.config", "deepspeed.compile.config",
                 "deepspeed.utils.config", "deepspeed.comm.config", "deepspeed.monitor.config"):
        importlib.import_module(name)
    out, stack = set(), [DeepSpeedConfigModel]
    while stack:
        for sub in stack.pop().__subclasses__():
            out.add(sub)
            stack.append(sub)
    return out


def _jsonable(value):
    from pydantic import BaseModel

    if isinstance(value, BaseModel):
        return {k: _jsonable(getattr(value, k)) for k in type(value).model_fields}
    if isinstance(value, enum.Enum):
        return _jsonable(value.value)
    if isinstance(value, pathlib.PurePath):
        return str(value)
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return {"python": repr(value)}  # torch.dtype, process groups: not JSON


def _sample(info, default):
    """One JSON value other than the default that the field's type takes, or None when it takes none."""
    from pydantic import BaseModel

    ann = info.annotation
    args = [a for a in typing.get_args(ann) if a is not type(None)]
    if typing.get_origin(ann) is typing.Union and len(args) == 1:
        ann, args = args[0], list(typing.get_args(args[0]))
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return {}
    if isinstance(ann, type) and issubclass(ann, enum.Enum):
        values = [m.value for m in ann if m.value != _jsonable(default)]
        return "cpu" if "cpu" in values else values[-1]
    if typing.get_origin(ann) is typing.Literal:
        return next(v for v in typing.get_args(ann) if v != default)
    if ann is bool or (default is None and bool in args):
        return not default if isinstance(default, bool) else True
    if ann is int or (isinstance(ann, type) and issubclass(ann, int)):
        if not isinstance(default, int):
            return 5
        return int(default) + 1 if default < 2**62 else int(default) - 1  # within 64 bits
    if ann is float:
        return default / 2 if default else 0.5
    if ann is str:
        return "x"
    if typing.get_origin(ann) in (list, typing.List) or ann is list:  # noqa: UP006
        items = typing.get_args(ann)
        if items and typing.get_origin(items[0]) is typing.Literal:
            return [typing.get_args(items[0])[0]]
        return ["all_reduce"]
    if ann is pathlib.Path:
        return "/tmp/nvme"
    if typing.get_origin(ann) in (dict, typing.Dict):  # noqa: UP006
        return {"use_default_specs": False}
    if typing.get_origin(ann) is typing.Union and int in args:
        return 5
    return None  # Python objects (mpu, process groups, torch.dtype, tuples): not JSON


def _bound_samples(info) -> list:
    """Values on each side of every bound of a field's constraints (pydantic `gt`/`ge`/`lt`/`le`): the
    bound itself and one step past it, so fnzero must refuse exactly where DeepSpeed does."""
    import annotated_types as at

    step = 1 if info.annotation is int else 0.25
    out: list = []
    for bound in info.metadata:
        for kind, sign in ((at.Gt, -1), (at.Ge, -1), (at.Lt, 1), (at.Le, 1)):
            if isinstance(bound, kind):
                edge = getattr(bound, kind.__name__.lower())
                out += [edge, edge + sign * step] if kind in (at.Ge, at.Le) else [edge, edge - sign * step]
    return out


def _nest(path: str, leaf: dict) -> dict:
    node = leaf
    for part in reversed(path.split(".")):
        node = {part: node}
    return node


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _parse(config: dict, getter: str, field: str | None):
    """DeepSpeed's verdict on a whole config: {"value": the field's resolved value} or {"error": ...}."""
    import logging

    from deepspeed.runtime.config import DeepSpeedConfig

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    try:
        cfg = DeepSpeedConfig(json.loads(json.dumps(config)))
    except Exception as err:  # DeepSpeed raises ValidationError, AssertionError, ValueError, TypeError
        return {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
    if field is None:
        return {"value": None}
    node = cfg
    for part in getter.split("."):
        node = getattr(node, part)
    return {"value": _jsonable(getattr(node, field))}


def _model_at(getter: str):
    from deepspeed.runtime.config import DeepSpeedConfig

    node = DeepSpeedConfig(dict(BASE))
    for part in getter.split("."):
        node = getattr(node, part, None)
        if node is None:
            return _NONE_MODELS.get(getter)
    return type(node)


def _none_models():
    # Blocks DeepSpeed leaves None by default: name their models here.
    from deepspeed.runtime.zenflow.zenflow_config import ZenFlowConfig
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig, DeepSpeedZeroOffloadParamConfig,
    )
    from deepspeed.comm.config import CommsLoggerConfig

    return {"zero_config.offload_param": DeepSpeedZeroOffloadParamConfig,
            "zero_config.offload_optimizer": DeepSpeedZeroOffloadOptimizerConfig,
            "zero_config.zenflow": ZenFlowConfig, "comms_config.comms_logger": CommsLoggerConfig}


_NONE_MODELS: dict = {}


def _cases_of(path: str, model, getter: str, context: dict) -> list[dict]:
    cases = []
    resolved = _parse(_merge(BASE, _merge(context, _nest(path, {}))), getter, None)
    for name, info in model.model_fields.items():
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        default = info.get_default(call_default_factory=True)
        spellings = [("name", name)] + ([("alias", info.alias)] if info.alias and info.alias != name else [])
        entry = {"section": path, "field": name, "alias": info.alias if info.alias != name else None,
                 "deprecated": bool(extra.get("deprecated")), "new_param": extra.get("new_param"),
                 "set_new_param": extra.get("set_new_param", True) if extra.get("deprecated") else None}
        base = _merge(BASE, _merge(context, FIELD_CONTEXT.get(f"{path}.{name}", {})))
        if resolved.get("error") is None and not entry["deprecated"]:
            config = _merge(base, _nest(path, {}))
            entry["default"] = {"config": config, **_parse(config, getter, name)}
        samples = [SAMPLE_OVERRIDES.get(f"{path}.{name}", _sample(info, default))] + EXTRA_SAMPLES.get(f"{path}.{name}", [])
        if not path.startswith(NO_BOUND_SAMPLES):
            samples += [v for v in _bound_samples(info) if v not in samples]
        for value in samples:
            if value is None:
                continue
            for kind, key in spellings:
                read = extra.get("new_param") if entry["deprecated"] and entry["set_new_param"] else name
                read = None if entry["deprecated"] and not entry["set_new_param"] else read
                verdict = _parse(_merge(base, _nest(path, {key: value})), getter, read)
                cases.append({**entry, "kind": "deprecated" if entry["deprecated"] else kind, "key": f"{path}.{key}",
                              "value": value, "config": _merge(base, _nest(path, {key: value})), "deepspeed": verdict})
            if len(spellings) == 2:
                both = {k: value for _, k in spellings}
                cases.append({**entry, "kind": "both", "key": f"{path}.{spellings[1][1]}", "value": value,
                              "config": _merge(base, _nest(path, both)),
                              "deepspeed": _parse(_merge(base, _nest(path, both)), getter, name)})
    return cases


# Every object of the training config that can hold keys, and what it needs around an unknown key.
PROBED = {"": {}, "optimizer": {"type": "Adam", "params": {}}, "scheduler": {"type": "WarmupLR", "params": {}},
          "optimizer.params": None, "scheduler.params": None}
PROBED_SECTIONS = ("fp16", "bf16", "zero_optimization", "zero_optimization.offload_optimizer",
                   "zero_optimization.offload_param", "zero_optimization.leaf_module", "aio", "activation_checkpointing",
                   "checkpoint", "checkpoint.parallel_write", "data_types", "torch_autocast", "comms_logger",
                   "flops_profiler", "tensorboard", "csv_monitor", "compile", "timers", "timers.throughput",
                   "tensor_parallel", "tensor_parallel.tp", "pipeline", "expert_parallel")


def _ignoring_sections() -> list[str]:
    """The objects in which DeepSpeed accepts a key it does not know (and ignores it): "" is the top level.
    Sections parsed by a DeepSpeedConfigModel refuse one (pydantic's extra="forbid"); the others are read
    key by key with dict.get. optimizer.params / scheduler.params go to a constructor, which refuses it."""
    out = []
    probes = {**PROBED, **dict.fromkeys(PROBED_SECTIONS, {})}
    for path, around in probes.items():
        if around is None:
            section = path.split(".")[0]
            config = _merge(BASE, {section: {**PROBED[section], "params": {"bogus_key": 1}}})
            verdict = _parse_engine_params(config, section)
        else:
            context = {"zero_optimization": {"stage": 3}} if path.startswith("zero_optimization.") else {}
            block = {**around, "bogus_key": 1}
            config = _merge(BASE, _merge(context, _nest(path, block) if path else block))
            verdict = _parse(config, "zero_config", None)
        if "error" not in verdict:
            out.append(path)
    return out


def _parse_engine_params(config: dict, section: str) -> dict:
    """`params` goes to the optimizer's / scheduler's constructor, which the engine calls: a key the
    constructor lacks is a TypeError there (FusedAdam and WarmupLR here)."""
    import inspect

    from deepspeed.runtime import lr_schedules
    from deepspeed.ops.adam import FusedAdam

    target = FusedAdam if section == "optimizer" else lr_schedules.WarmupLR
    try:
        inspect.signature(target.__init__).bind(None, None, **config[section]["params"])
    except TypeError as err:
        return {"error": f"TypeError: {err}"}
    return {"value": None}


def build() -> dict:
    """The table, from the DeepSpeed importable here (which must be 0.19.8)."""
    import deepspeed

    if deepspeed.__version__ != VERSION:
        raise SystemExit(f"DeepSpeed {deepspeed.__version__} is importable; the table is of {VERSION}")
    _NONE_MODELS.update(_none_models())
    walked, skipped, cases = [], [], []
    for path, (getter, context) in SECTIONS.items():
        model = _model_at(getter)
        walked.append({"section": path, "model": f"{model.__module__}.{model.__qualname__}"})
        cases += _cases_of(path, model, getter, context)
    seen = {w["model"] for w in walked}
    for model in sorted(_models(), key=lambda m: (m.__module__, m.__qualname__)):
        name = f"{model.__module__}.{model.__qualname__}"
        if name in seen:
            continue
        why = next((w for k, w in SKIPPED.items() if k in name), None)
        if why is None:
            raise SystemExit(f"{name} is a config model this script does not place: add it to SECTIONS or SKIPPED")
        skipped.append({"model": name, "why": why})
    from deepspeed.runtime.config import _REMOVED_TOP_LEVEL_CONFIG_KEYS, _REMOVED_ZERO_CONFIG_KEYS

    # Keys DeepSpeed refuses in any form, off included (runtime/config.py _reject_removed_config_keys).
    removed = sorted(_REMOVED_TOP_LEVEL_CONFIG_KEYS) + [f"zero_optimization.{k}" for k in sorted(_REMOVED_ZERO_CONFIG_KEYS)]
    return {"deepspeed": VERSION, "generated_by": "tests/scripts/deepspeed_config_table.py", "models": walked,
            "skipped": skipped, "removed_keys": removed, "unknown_keys_ignored_in": _ignoring_sections(), "cases": cases}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the checked-in table; write nothing")
    args = parser.parse_args(argv)
    os.environ.setdefault("DS_BUILD_OPS", "0")
    warnings.simplefilter("ignore")
    table = build()
    text = json.dumps(table, indent=1, sort_keys=True) + "\n"
    if args.check:
        old = json.loads(TABLE.read_text()) if TABLE.exists() else {"cases": []}
        same = old == json.loads(text)
        print(f"{TABLE}: {'up to date' if same else 'differs from what DeepSpeed says now'}")
        if not same:
            def keyed(cases):
                return {(c["kind"], c["key"], json.dumps(c["value"])): c for c in cases}
            before, now = keyed(old["cases"]), keyed(table["cases"])
            for k in sorted(set(before) | set(now)):
                if before.get(k) != now.get(k):
                    print(f"  {k[0]} {k[1]} = {k[2]}: table {json.dumps(before.get(k, {}).get('deepspeed'))}, "
                          f"DeepSpeed now {json.dumps(now.get(k, {}).get('deepspeed'))}")
        return 0 if same else 1
    TABLE.parent.mkdir(parents=True, exist_ok=True)
    TABLE.write_text(text)
    print(f"wrote {TABLE}: {len(table['cases'])} cases from {len(table['models'])} models")
    return 0


if __name__ == "__main__":
    sys.exit(main())
