"""The Hugging Face files beside an export, `config.json` and `generation_config.json`
(`specs/checkpoint-format.md` §Export, Hugging Face config). transformers is never imported here:
a config is anything with `to_json_string` and `model_type` (transformers' `PretrainedConfig`).
"""

from __future__ import annotations

import json
import os

import torch

from .._errors import CheckpointError
from ._io import write_atomic

__all__ = ["hf_source", "module_source", "write_hf_files"]

CONFIG, GENERATION = "config.json", "generation_config.json"


def _is_config(x) -> bool:
    return callable(getattr(x, "to_json_string", None)) and isinstance(getattr(x, "model_type", None), str)


def hf_source(x):
    """`hf_config=` checked: None; a config; a model holding one (`model.config`; its
    `generation_config` too); or a path: a `save_pretrained` directory or a config JSON file."""
    if x is None or x is False:
        return None
    if isinstance(x, (str, os.PathLike)):
        return os.fspath(x)
    if _is_config(x) or _is_config(getattr(x, "config", None)):
        return x
    raise CheckpointError(
        f"hf_config= must be a Hugging Face config (model.config), the model itself, or a directory holding its "
        f"config.json; got a {type(x).__name__}")


def module_source(module):
    """The model `export_live` writes the config of: the sharded module when it holds a Hugging
    Face config (a transformers model), else None."""
    return module if _is_config(getattr(module, "config", None)) else None


def _config_dict(source) -> tuple[dict, object | None]:
    """The config as `save_pretrained` writes it (only what differs from the defaults), and the
    generation config to write beside it (None when there is none)."""
    if isinstance(source, str):
        path = os.path.join(source, CONFIG) if os.path.isdir(source) else source
        try:
            with open(path) as f:
                return json.load(f), None
        except FileNotFoundError:
            raise CheckpointError(f"hf_config={source!r}: there is no {path} (give a save_pretrained directory, "
                                  "which holds config.json, or a config JSON file)") from None
        except (OSError, ValueError) as e:
            raise CheckpointError(f"hf_config={source!r}: cannot read {path} as JSON ({e})") from None
    model = None if _is_config(source) else source
    d = json.loads((source if model is None else model.config).to_json_string(use_diff=True))
    if model is not None and not d.get("architectures"):
        d["architectures"] = [type(model).__name__]  # as save_pretrained records it
    gen = getattr(model, "generation_config", None) if model is not None else None
    return d, gen


def write_hf_files(source, directory: str, dtype: torch.dtype | None) -> list[str]:
    """Write `config.json` (the dtype field set to the exported `dtype` when one was asked for) and
    `generation_config.json` where the source has one, into `directory`; the paths written."""
    if source is None:
        return []
    d, gen = _config_dict(source)
    if dtype is not None:  # as save_pretrained records the weights' dtype (older transformers: torch_dtype)
        d["torch_dtype" if "torch_dtype" in d else "dtype"] = str(dtype).removeprefix("torch.")
    out = [os.path.join(directory, CONFIG)]
    write_atomic(out[0], (json.dumps(d, indent=2, sort_keys=True) + "\n").encode())
    gen_json = None
    if gen is not None:
        gen_json = gen.to_json_string(use_diff=True)
    elif isinstance(source, str) and os.path.isdir(source) and os.path.isfile(os.path.join(source, GENERATION)):
        with open(os.path.join(source, GENERATION)) as f:
            gen_json = f.read()
    if gen_json is not None:
        out.append(os.path.join(directory, GENERATION))
        write_atomic(out[1], gen_json.encode())
    return out
