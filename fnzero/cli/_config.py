"""`fnzero config {validate,show} FILE [--world-size N] [--auto NAME=VALUE,...]` (specs/cli.md).

`--auto` takes `hf_auto_values`'s arguments, so a Hugging Face-style config can be checked before a
run. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import json
import sys
import warnings
from typing import Any

from ._common import load_config_or_report

__all__ = ["register", "parse_auto"]


def register(sub: Any) -> None:
    cp = sub.add_parser("config", help="validate or show a DeepSpeed-style JSON config",
                        description="Validate a DeepSpeed JSON config (every error at once, and the keys that have "
                        "no effect in fnzero as warnings), or show it with every default filled.")
    cp.add_argument("action", choices=["show", "validate"],
                    help="show: the resolved config as JSON; validate: every error at once, and warnings")
    cp.add_argument("file", help="path to the JSON config")
    cp.add_argument("--world-size", type=int, default=None,
                    help="the job's ranks, used to resolve the batch triad (default 1, or one tensor-parallel group)")
    cp.add_argument("--auto", default=None, metavar="NAME=VALUE,...",
                    help='fill the config\'s "auto" keys from the Hugging Face Trainer\'s numbers: the arguments '
                    "of fnzero.hf_auto_values, e.g. lr=3e-4,micro_batch_size=4,betas=[0.9,0.95],bf16=true,"
                    "hidden_size=4096,total_steps=1000 (world_size defaults to --world-size)")
    cp.set_defaults(func=_cmd_config)


def _cmd_config(args: argparse.Namespace) -> int:
    auto = None
    if args.auto is not None:
        try:
            auto = parse_auto(args.auto, args.world_size)
        except ValueError as e:  # a ConfigError from hf_auto_values lists each bad argument
            for line in getattr(e, "errors", None) or [str(e)]:
                print(f"fnzero config: --auto: {line}", file=sys.stderr)
            return 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config_or_report(args.file, args.world_size, auto=auto,
                                    auto_hint=None if auto is not None else _AUTO_HINT)
    if cfg is None:
        return 1
    notes = [str(w.message) for w in caught]
    if args.action == "show":
        print(cfg.to_json(indent=2))
    else:
        mesh = (f" = {cfg.world_size} data-parallel x {cfg.tensor_parallel.size} tensor-parallel"
                if cfg.tensor_parallel.size > 1 else "")
        tail = f", {len(notes)} warning(s)" if notes else ""
        print(f"{args.file}: valid (ZeRO stage {cfg.zero_optimization.stage}, world size {cfg.world_ranks}{mesh}){tail}")
    sys.stdout.flush()  # the verdict first, then what it warns about
    for note in notes:
        print(f"  - warning: {note}", file=sys.stderr)
    return 0


_AUTO_HINT = ('here, fill "auto" keys with --auto and the same arguments, e.g. '
              "--auto lr=3e-4,micro_batch_size=8,hidden_size=4096,total_steps=10_000")


def _split(text: str) -> list[str]:
    """`a=1,b=[2,3]` -> ["a=1", "b=[2,3]"]: commas inside brackets belong to the value."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def _value(text: str) -> Any:
    """A command-line value as JSON (3e-4, 10_000, true/True, [0.9,0.95], (0.9, 0.95), null), else the text."""
    spelled = {"true": True, "false": False, "none": None, "null": None}
    if text.lower() in spelled:
        return spelled[text.lower()]
    candidate = text.replace("_", "") if text[:1].isdigit() or text[:1] in "-." else text
    if candidate.startswith("(") and candidate.endswith(")"):
        candidate = "[" + candidate[1:-1] + "]"
    try:
        return json.loads(candidate)
    except ValueError:
        return text  # hf_auto_values names the argument and what it must be


def parse_auto(text: str, world_size: int | None) -> Any:
    """`lr=3e-4,micro_batch_size=4,...` -> `hf_auto_values(lr=3e-4, micro_batch_size=4, ...)`; a ValueError
    (a ConfigError for a bad value) naming the argument otherwise."""
    from ..config import hf_auto_values

    params = inspect.signature(hf_auto_values).parameters
    kwargs: dict[str, Any] = {}
    for item in _split(text):
        name, sep, raw = item.partition("=")
        name = name.strip()
        if not sep:
            raise ValueError(f"{item!r} is not NAME=VALUE; write e.g. lr=3e-4,micro_batch_size=4")
        if name not in params:
            close = difflib.get_close_matches(name, list(params), n=1)
            hint = f"did you mean `{close[0]}`? " if close else ""
            raise ValueError(f"`{name}` is not an argument of hf_auto_values; {hint}the arguments are "
                             f"{', '.join(params)}")
        if name in kwargs:
            raise ValueError(f"`{name}` is given twice; give it once")
        kwargs[name] = _value(raw.strip())
    missing = [n for n, p in params.items() if p.default is inspect.Parameter.empty and n not in kwargs]
    if missing:
        raise ValueError(f"{' and '.join(missing)} must be given (hf_auto_values has no default for "
                         f"{'it' if len(missing) == 1 else 'them'}), e.g. --auto lr=3e-4,micro_batch_size=4")
    kwargs.setdefault("world_size", world_size)
    return hf_auto_values(**kwargs)
