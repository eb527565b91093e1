"""Filling DeepSpeed's `"auto"` placeholders from the caller's `auto=` mapping (specs/config.md §"auto").

fnzero has no trainer to fill them, so an `"auto"` left unfilled is an error, not a dropped key.
"""

from __future__ import annotations

import json
import math
import textwrap
from collections.abc import Iterator, Mapping
from typing import Any

from ._expert import ExpertParallelConfig
from ._parse import plain_tree
from ._problems import Problems, config_error, join_path, suggest
from ._schema import all_paths
from ._types import describe

__all__ = ["fill_auto", "find_auto", "auto_message", "AUTO", "AutoValues", "hf_auto_values", "HF_ARGUMENTS"]

AUTO = "auto"
_WIDTH = 100  # characters per line of the wrapped key list

# DeepSpeed key -> the hf_auto_values argument(s) it comes from (transformers' trainer_config_process /
# trainer_config_finalize); also the table in specs/config.md §"auto".
HF_ARGUMENTS: dict[str, str] = {
    "train_micro_batch_size_per_gpu": "micro_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "train_batch_size": "micro_batch_size * gradient_accumulation_steps * world_size",
    "gradient_clipping": "max_grad_norm",
    "optimizer.params.lr": "lr",
    "optimizer.params.betas": "betas",
    "optimizer.params.eps": "eps",
    "optimizer.params.weight_decay": "weight_decay",
    "scheduler.params.warmup_min_lr": "0 (always)",
    "scheduler.params.warmup_max_lr": "lr",
    "scheduler.params.warmup_num_steps": "warmup_steps (>= 1: steps; below 1: ceil(ratio * total_steps))",
    "scheduler.params.total_num_steps": "total_steps",
    "fp16.enabled": "fp16",
    "bf16.enabled": "bf16",
    "zero_optimization.reduce_bucket_size": "hidden_size ** 2",
    "zero_optimization.stage3_prefetch_bucket_size": "int(0.9 * hidden_size * hidden_size)",
    "zero_optimization.stage3_param_persistence_threshold": "10 * hidden_size",
}
# The example arguments an error message shows for the auto keys a config holds.
_EXAMPLE_ARGS = {
    "scheduler.params.warmup_num_steps": "warmup_steps=100",
    "scheduler.params.total_num_steps": "total_steps=10_000",
    "zero_optimization.reduce_bucket_size": "hidden_size=4096",
    "zero_optimization.stage3_prefetch_bucket_size": "hidden_size=4096",
    "zero_optimization.stage3_param_persistence_threshold": "hidden_size=4096",
    "fp16.enabled": "bf16=True",
    "bf16.enabled": "bf16=True",
}


class AutoValues(Mapping[str, Any]):
    """Values for `load_config(..., auto=...)` that fill only the keys a config sets to `"auto"`.

    Other keys are left as they are, so the same values fit any config (a plain dict is stricter:
    specs/config.md §"auto"). Built from any mapping of dotted DeepSpeed paths; `|` merges (the
    right side wins).

    >>> from fnzero.config import AutoValues, load_config
    >>> auto = AutoValues({"optimizer.params.lr": 3e-4, "scheduler.params.total_num_steps": 100})
    >>> cfg = load_config({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, auto=auto)
    >>> cfg.optimizer.params.lr, cfg.scheduler is None
    (0.0003, True)
    """

    __slots__ = ("_values",)

    def __init__(self, values: Mapping[str, Any] | None = None) -> None:
        values = {} if values is None else values
        if not isinstance(values, Mapping):
            raise config_error([f"AutoValues takes a dict of dotted DeepSpeed paths to values, got {describe(values)}"])
        self._values = dict(values)

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __or__(self, other: Mapping[str, Any]) -> AutoValues:
        if not isinstance(other, Mapping):
            return NotImplemented
        return AutoValues({**self._values, **other})

    def __repr__(self) -> str:
        return f"AutoValues({self._values!r})"


_WANT = {"pos_int": "a positive integer", "opt_pos_int": "None or a positive integer",
         "nonneg": "a finite number >= 0", "bool": "True or False"}


def _fits(value: Any, kind: str) -> bool:
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "opt_pos_int" and value is None:
        return True
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if kind == "nonneg":
        return math.isfinite(value) and value >= 0
    return isinstance(value, int) and value > 0  # pos_int, opt_pos_int


def _check_args(problems: list[str], **checks: tuple[Any, str]) -> None:
    for name, (value, kind) in checks.items():
        if not _fits(value, kind):
            problems.append(f"hf_auto_values: `{name}` must be {_WANT[kind]}, got {describe(value)}")


def hf_auto_values(
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    warmup_steps: int | float = 0,
    total_steps: int | None = None,
    micro_batch_size: int,
    gradient_accumulation_steps: int = 1,
    max_grad_norm: float = 1.0,
    bf16: bool = False,
    fp16: bool = False,
    hidden_size: int | None = None,
    world_size: int | None = None,
) -> AutoValues:
    """The values HuggingFace's Trainer would put where a DeepSpeed config says `"auto"`.

    Pass the result as `load_config(path, auto=...)`. Arguments are named after (and default like)
    transformers' `TrainingArguments`; the table in specs/config.md §"auto" gives each one's Trainer
    argument and DeepSpeed key. `warmup_steps` below 1 is a ratio of `total_steps`; `world_size`
    defaults to 1 here (`fnzero.hf_auto_values`: the running world's size).

    >>> from fnzero.config import hf_auto_values, load_config
    >>> cfg = load_config(
    ...     {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto",
    ...      "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
    ...      "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}},
    ...     world_size=2,
    ...     auto=hf_auto_values(lr=3e-4, weight_decay=0.1, micro_batch_size=4, hidden_size=1024, world_size=2),
    ... )
    >>> cfg.train_batch_size, cfg.optimizer.params.lr, cfg.zero_optimization.reduce_bucket_size
    (8, 0.0003, 1048576)
    """
    world = 1 if world_size is None else world_size
    problems: list[str] = []
    _check_args(
        problems, lr=(lr, "nonneg"), eps=(eps, "nonneg"), weight_decay=(weight_decay, "nonneg"),
        warmup_steps=(warmup_steps, "nonneg"), total_steps=(total_steps, "opt_pos_int"),
        micro_batch_size=(micro_batch_size, "pos_int"), gradient_accumulation_steps=(gradient_accumulation_steps, "pos_int"),
        max_grad_norm=(max_grad_norm, "nonneg"), bf16=(bf16, "bool"), fp16=(fp16, "bool"),
        hidden_size=(hidden_size, "opt_pos_int"), world_size=(world, "pos_int"),
    )
    if not (isinstance(betas, (list, tuple)) and len(betas) == 2):
        problems.append(f"hf_auto_values: `betas` must be a pair such as (0.9, 0.999), got {describe(betas)}")
    if bf16 is True and fp16 is True:
        problems.append("hf_auto_values: `bf16` and `fp16` are both True; choose at most one precision")
    warmup = None if problems else _warmup(warmup_steps, total_steps, problems)
    if problems:
        raise config_error(problems)
    values: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "train_batch_size": micro_batch_size * gradient_accumulation_steps * world,
        "gradient_clipping": max_grad_norm,
        "optimizer.params.lr": lr,
        "optimizer.params.betas": [betas[0], betas[1]],
        "optimizer.params.eps": eps,
        "optimizer.params.weight_decay": weight_decay,
        "scheduler.params.warmup_min_lr": 0,
        "scheduler.params.warmup_max_lr": lr,
        "scheduler.params.warmup_num_steps": warmup,
        "fp16.enabled": fp16,
        "bf16.enabled": bf16,
    }
    if total_steps is not None:
        values["scheduler.params.total_num_steps"] = total_steps
    values.update(_bucket_sizes(hidden_size))
    return AutoValues(values)


def _warmup(warmup_steps: int | float, total_steps: int | None, problems: list[str]) -> int | None:
    """The Trainer's warmup step count: `warmup_steps` itself, or below 1 a ratio of `total_steps`
    rounded up (TrainingArguments.get_warmup_steps); a ratio without `total_steps` is a problem."""
    if warmup_steps >= 1:
        return int(warmup_steps)
    if warmup_steps == 0:
        return 0
    if total_steps is not None:
        return math.ceil(total_steps * warmup_steps)
    problems.append(
        f"hf_auto_values: `warmup_steps` {warmup_steps!r} is a ratio of total_steps (it is below 1); "
        "pass total_steps, or give warmup_steps as a step count"
    )
    return None


def _bucket_sizes(hidden_size: int | None) -> dict[str, int]:
    """The ZeRO bucket sizes transformers derives from the model's hidden size (none without it)."""
    if hidden_size is None:
        return {}
    return {
        "zero_optimization.reduce_bucket_size": hidden_size * hidden_size,
        "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
        "zero_optimization.stage3_param_persistence_threshold": 10 * hidden_size,
    }


def _same(a: Any, b: Any) -> bool:
    # 1 and 1.0 agree; true and 1 do not (JSON keeps booleans apart from numbers).
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == AUTO


# Keys whose "auto" is DeepSpeed's own value, not a Trainer placeholder (pipeline.stages: as many
# stages as the PipelineModule asks for; expert_parallel's routing and kernel keys: the preset's choice).
NATIVE_AUTO = {"pipeline.stages"} | {f"expert_parallel.{name}" for name, field in
                                     ExpertParallelConfig.model_fields.items() if field.default == "auto"}


def find_auto(raw: dict[str, Any]) -> list[tuple[str, tuple[Any, ...]]]:
    """(dotted path, key tuple) of every value that is the string "auto" as a placeholder (not a
    key of NATIVE_AUTO), sorted by path."""
    found: list[tuple[str, tuple[Any, ...]]] = []
    stack: list[tuple[Any, tuple[Any, ...]]] = [(raw, ())]
    while stack:
        node, keys = stack.pop()
        items = list(node.items()) if isinstance(node, dict) else list(enumerate(node))
        for key, value in items:
            sub = keys + (key,)
            if _is_auto(value):
                if join_path(*sub) not in NATIVE_AUTO:
                    found.append((join_path(*sub), sub))
            elif isinstance(value, (dict, list)):
                stack.append((value, sub))
    return sorted(found, key=lambda item: item[0])


def auto_message(paths: list[str]) -> str:
    """One problem naming every unfilled "auto" key once, with one example of filling them."""
    why = "HuggingFace's Trainer fills such placeholders in; fnzero has no trainer, so pass"
    if len(paths) == 1:
        also = " (or auto=fnzero.config.hf_auto_values(...))" if paths[0] in HF_ARGUMENTS else ""
        return f'`{paths[0]}` is "auto": {why} the value, e.g. load_config(..., auto={{"{paths[0]}": <value>}}){also}'
    if all(path in HF_ARGUMENTS for path in paths):
        args = ["lr=3e-4", "micro_batch_size=8"]
        for path, arg in _EXAMPLE_ARGS.items():
            if path in paths and arg not in args:
                args.append(arg)
        example = f"auto=fnzero.config.hf_auto_values({', '.join(args)})"
    else:
        shown = [f'"{_config_path(path)}": <value>' for path in paths[:2]]
        example = "auto={" + ", ".join(shown) + (", ...}" if len(paths) > 2 else "}")
    listed = textwrap.fill(
        ", ".join(paths), width=_WIDTH, initial_indent="      ", subsequent_indent="      ",
        break_long_words=False, break_on_hyphens=False,
    )
    return (
        f'{len(paths)} keys are "auto" (placeholders HuggingFace\'s Trainer fills in; fnzero has no trainer, '
        f'so pass their values, specs/config.md §"auto"):\n{listed}\n'
        f"    e.g. load_config(..., {example})"
    )


def fill_auto(raw: dict[str, Any], auto: Mapping[str, Any] | None, problems: Problems) -> set[str]:
    """Apply `auto` to `raw` in place, then report and remove every "auto" still left; returns their paths."""
    valid = all_paths()
    if auto is not None:
        if not isinstance(auto, Mapping):
            problems.add(
                f"`auto` must be a dict of dotted DeepSpeed paths to values, got {describe(auto)}; "
                'e.g. auto={"optimizer.params.lr": 3e-4} or auto=fnzero.config.hf_auto_values(...)'
            )
            auto = {}
        fill_only = isinstance(auto, AutoValues)
        for path, value in auto.items():
            if not isinstance(path, str) or path not in valid:
                hint = suggest(str(path), valid)
                problems.add(
                    f"auto key {describe(path)} is not a DeepSpeed config path{hint or '; use dotted paths such as `optimizer.params.lr`'}"
                )
                continue
            if fill_only and not _holds_auto(raw, path):
                continue
            try:
                value = plain_tree({"v": value})["v"]
            except ValueError as err:  # ConfigError: not a JSON value
                problems.add(f"auto value for `{path}`: {getattr(err, 'errors', [str(err)])[0]}")
                continue
            _set(raw, path, value, problems)
    left = [(path, keys) for path, keys in find_auto(raw) if _config_path(path) in valid]  # others: unknown keys
    if left:
        problems.add(auto_message([path for path, _ in left]))
        problems.cover(path for path, _ in left)  # e.g. not also "required here" once the "auto" is dropped
    for _, keys in left:
        _drop(raw, keys)  # reported once here; do not also report it as a wrong type
    return {path for path, _ in left}


def _config_path(path: str) -> str:
    """`optimizer.params.betas[1]` -> `optimizer.params.betas` (an "auto" inside a list)."""
    return path.split("[", 1)[0]


def _holds_auto(raw: dict[str, Any], path: str) -> bool:
    node: Any = raw
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return _is_auto(node)


def _set(raw: dict[str, Any], path: str, value: Any, problems: Problems) -> None:
    *head, leaf = path.split(".")
    node: Any = raw
    walked = ""
    for part in head:
        walked = join_path(walked, part)
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            problems.add(f"auto sets `{path}`, but `{walked}` in the config is {describe(child)}, not an object; make it an object")
            return
        node = child
    current = node.get(leaf, AUTO)
    if _is_auto(current):
        node[leaf] = value
    elif not _same(current, value):
        problems.add(
            f"`{path}` is {describe(current)} in the config but auto= supplies {describe(value)}; "
            f'remove one of them, or write "auto" in the config to take the supplied value'
        )


def _drop(raw: dict[str, Any], keys: tuple[Any, ...]) -> None:
    node: Any = raw
    for key in keys[:-1]:
        node = node[key]
    if isinstance(node, list):
        node[keys[-1]] = None
    else:
        del node[keys[-1]]
