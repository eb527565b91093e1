"""Every key spelling DeepSpeed 0.19.8's config models accept means the same in fnzero (specs/config.md §Keys).

`tests/data/deepspeed_0_19_8_config_keys.json` holds, for each field of each DeepSpeed config model
of the training config (its name, its alias, its deprecated spellings), whole configs with a sample
value and what DeepSpeed's own `DeepSpeedConfig` made of them: the resolved value, or a refusal. It
is written by `tests/scripts/deepspeed_config_table.py` where DeepSpeed is importable (DeepSpeed is
not in the `test` extra: its sdist takes about a minute to build); the last test here regenerates it
and compares when DeepSpeed 0.19.8 is importable.

For each case, fnzero must: resolve the same value at its own spelling of the key, or refuse the
config naming the key as a feature it does not implement (REFUSED, each with its reason), or accept
a block DeepSpeed's own way of switching it off leaves without effect (an unsupported block that is
off). A config DeepSpeed refuses, fnzero refuses. Two spellings of one key together: refused,
naming both.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys
import warnings

import pytest

from fnzero._errors import ConfigError
from fnzero.config import Config, ConfigWarning, load_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
TABLE_PATH = ROOT / "tests" / "data" / "deepspeed_0_19_8_config_keys.json"
TABLE = json.loads(TABLE_PATH.read_text())
CASES = TABLE["cases"]

# DeepSpeed keys fnzero refuses by name when set to this sample value: key -> why.
REFUSED = {
    "zero_optimization.zero_quantized_weights": "refused below the stage that moves what it quantizes (DeepSpeed ignores it)",
    "zero_optimization.zero_quantized_nontrainable_weights": "refused below the stage that moves what it quantizes (DeepSpeed ignores it)",
    "zero_optimization.zero_quantized_gradients": "refused below the stage that moves what it quantizes (DeepSpeed ignores it)",
    "zero_optimization.zenflow": "ZenFlow is not implemented ({} turns it on in DeepSpeed)",
    "tensor_parallel.vocab_parallel_ce_backend": "only the torch cross-entropy is implemented (not liger)",
    "tensor_parallel.replace_with_kernel_inject": "inference kernels are not implemented",
    "tensor_parallel.kernel_inject": "inference kernels are not implemented (the alias of the above)",
    "compile.deepcompile": "DeepCompile is not implemented (fnzero.jit compiles the step)",
    "hybrid_engine": "the hybrid engine is not implemented (accepted switched off)",
    "wandb": "the wandb monitor is not implemented (accepted switched off)",
    "comet": "the comet monitor is not implemented (accepted switched off)",
    "fp16.fp16_master_weights_and_grads": "fp16 master weights are not implemented",
    "bf16.bf16_master_weights_and_grads": "bf16 master weights are not implemented",
    "bf16.bf16_optimizer_states": "bf16 optimizer states are not implemented",
}
# fnzero sections whose DeepSpeed block has another path in fnzero's model.
SECTION = {"tensor_parallel.tp": "tensor_parallel.tensor_parallel"}
# Blocks fnzero accepts only switched off, and then drops: their keys resolve to nothing.
DROPPED_WHEN_OFF = ("wandb", "comet", "hybrid_engine")


def _fnzero_field(section: str, names: list[str]) -> str | None:
    """fnzero's dotted path of the DeepSpeed field spelt `names` (name, alias) in `section`, or None."""
    model: type = Config
    for part in SECTION.get(section, section).split("."):
        info = model.model_fields.get(part)
        if info is None:
            return None
        model = next((a for a in (info.annotation, *getattr(info.annotation, "__args__", ())) if isinstance(a, type)
                      and hasattr(a, "model_fields")), None)
        if model is None:
            return None
    found = [n for n in names if n and n in model.model_fields]
    return f"{SECTION.get(section, section)}.{found[0]}" if found else None


def _at(tree: dict, path: str):
    for part in path.split("."):
        tree = tree[part]
    return tree


def _same(ds, mine) -> bool:
    """DeepSpeed's JSON value equals fnzero's (a dict DeepSpeed keeps raw may lack the defaults fnzero fills)."""
    if isinstance(ds, dict) and isinstance(mine, dict):
        return all(k in mine and _same(v, mine[k]) for k, v in ds.items())
    if isinstance(ds, bool) or isinstance(mine, bool):
        return ds is mine
    return ds == mine


def _load(config: dict):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            cfg = load_config(config)
        except ConfigError as err:
            return None, err.errors, caught
    return cfg, None, caught


def _target(case: dict) -> str | None:
    """fnzero's path of the key whose value DeepSpeed recorded for this case."""
    field, alias = case["field"], case["alias"]
    if case["kind"] == "deprecated":
        new = case["new_param"]
        twin = next((c["alias"] for c in CASES if c["section"] == case["section"] and c["field"] == new), None)
        field, alias = new, twin
    return _fnzero_field(case["section"], [field, alias])


def _as_unknown(error: str) -> bool:
    """The error refuses a key as one fnzero does not know (nested, or at the top level)."""
    return "is not a known key" in error or "is not a DeepSpeed config key" in error


def _ids(cases):
    return [f"{c['kind']}:{c['key']}={json.dumps(c['value'])}" for c in cases]


SINGLE = [c for c in CASES if c["kind"] != "both"]
BOTH = [c for c in CASES if c["kind"] == "both"]


@pytest.mark.parametrize("case", SINGLE, ids=_ids(SINGLE))
def test_each_spelling_means_what_it_means_in_deepspeed(case):
    cfg, errors, caught = _load(case["config"])
    verdict = case["deepspeed"]
    if "error" in verdict:
        assert errors, f"DeepSpeed refuses this config ({verdict['error']}); fnzero accepted it"
        return
    if errors:
        key = case["key"]
        parts = key.split(".")
        named = {".".join(parts[:i]) for i in range(1, len(parts) + 1)} | {f"{case['section']}.{case['field']}"}
        assert named & set(REFUSED), \
            f"DeepSpeed accepts {key} = {case['value']!r} (resolving {verdict['value']!r}); fnzero refused it: {errors}"
        assert not any(_as_unknown(e) for e in errors), errors  # refused by name, not as a typo
        assert any(f"`{n}`" in e or f"`{n} " in e for n in named & set(REFUSED) for e in errors), errors
        return
    if case["kind"] == "deprecated":
        assert any(issubclass(w.category, ConfigWarning) and "deprecated" in str(w.message) for w in caught)
        if case["set_new_param"] is False:
            return  # DeepSpeed reads nothing from it (cpu_offload_use_pin_memory)
    target = _target(case)
    if target is None:
        assert case["section"].split(".")[0] in DROPPED_WHEN_OFF, f"fnzero has no key for {case['key']}"
        return
    assert _same(verdict["value"], _at(cfg.to_dict(), target)), \
        f"{case['key']} = {case['value']!r}: DeepSpeed resolves {verdict['value']!r}, fnzero's `{target}` " \
        f"{_at(cfg.to_dict(), target)!r}"


@pytest.mark.parametrize("case", BOTH, ids=_ids(BOTH))
def test_two_spellings_of_one_key_are_refused_naming_both(case):
    assert "error" in case["deepspeed"]  # DeepSpeed refuses both together (pydantic's extra_forbidden)
    _, errors, _ = _load(case["config"])
    assert errors, f"both spellings of {case['key']} were accepted"
    section = SECTION.get(case["section"], case["section"])
    names = [f"`{section}.{case['field']}`", f"`{section}.{case['alias']}`"]
    assert any(all(n in e for n in names) for e in errors), errors


def _has_json_default(case: dict) -> bool:
    want = case["default"].get("value")
    return not (isinstance(want, dict) and "python" in want)  # torch.float16, process groups


WITH_DEFAULT = [c for c in CASES if "default" in c and _has_json_default(c)]
DEFAULTS = {f"{c['section']}.{c['field']}": c for c in WITH_DEFAULT
            if _fnzero_field(c["section"], [c["field"], c["alias"]]) is not None}


@pytest.mark.parametrize("key", sorted(DEFAULTS))
def test_each_default_is_deepspeeds(key):
    case = DEFAULTS[key]
    want = case["default"]["value"]
    target = _fnzero_field(case["section"], [case["field"], case["alias"]])
    cfg, errors, _ = _load(case["default"]["config"])
    assert errors is None, errors
    assert _same(want, _at(cfg.to_dict(), target)), (want, _at(cfg.to_dict(), target))


def test_every_field_without_a_fnzero_key_is_refused_by_name_or_in_a_block_that_is_off():
    """A DeepSpeed field fnzero has no key for must be a feature REFUSED names (fnzero then accepts only
    its off value), or sit in a block fnzero accepts only switched off: never silently unknown."""
    missing = {f"{c['section']}.{c['field']}" for c in WITH_DEFAULT} - set(DEFAULTS)
    unexplained = {k for k in missing if not any(k == r or k.startswith(r + ".") for r in REFUSED)}
    assert not unexplained, f"DeepSpeed fields fnzero neither has nor refuses by name: {sorted(unexplained)}"


def test_the_table_covers_the_aliases_the_issue_names():
    keys = {c["key"] for c in CASES}
    for name in ("gather_16bit_weights_on_model_save", "max_live_parameters", "prefetch_bucket_size",
                 "param_persistence_threshold", "max_reuse_distance", "stage3_gather_fp16_weights_on_model_save"):
        assert f"zero_optimization.{name}" in keys
    assert {m["section"] for m in TABLE["models"]} >= {"zero_optimization", "fp16", "bf16", "compile"}


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="DeepSpeed is not importable here (not in the test extra: its sdist builds for about a "
                    "minute); the checked-in table is what the tests above read")
def test_the_table_is_what_deepspeed_says_now():
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "scripts" / "deepspeed_config_table.py"), "--check"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr


# -- What DeepSpeed decides outside its pydantic models (runtime/engine.py, runtime/config.py) ----------

BASE = {"train_batch_size": 8}


def _refused(config: dict, *needles: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config({**BASE, **config})
    for needle in needles:
        assert needle in str(info.value), f"{needle!r} not in:\n{info.value}"
    return info.value.errors


@pytest.mark.parametrize("kind,params,want", [
    # runtime/engine.py get_optimizer_configuration: torch_adam builds torch.optim.AdamW when decay is
    # decoupled (type AdamW, or Adam with adam_w_mode true, its default): AdamW's weight_decay is 0.01.
    ("Adam", {"torch_adam": True}, 0.01),
    ("AdamW", {"torch_adam": True}, 0.01),
    ("adamw", {"torch_adam": True, "lr": 3e-4}, 0.01),
    # ... and torch.optim.Adam (weight_decay 0) for Adam with adam_w_mode false.
    ("Adam", {"torch_adam": True, "adam_w_mode": False}, 0.0),
    # An explicit value is the value; without torch_adam, FusedAdam's / DeepSpeedCPUAdam's 0.
    ("AdamW", {"torch_adam": True, "weight_decay": 0.0}, 0.0),
    ("AdamW", {"torch_adam": False}, 0.0),
    ("AdamW", {}, 0.0),
])
def test_torch_adam_weight_decay_follows_deepspeed(kind, params, want):
    cfg = load_config({**BASE, "optimizer": {"type": kind, "params": params}})
    assert cfg.optimizer.params.weight_decay == want
    assert load_config(cfg.to_json()) == cfg  # the resolved value is written out, and reads back the same


def test_torch_adam_weight_decay_from_hf_auto():
    from fnzero.config import hf_auto_values

    opt = {"type": "AdamW", "params": {"torch_adam": True, "lr": "auto", "weight_decay": "auto"}}
    cfg = load_config({**BASE, "optimizer": opt}, auto=hf_auto_values(lr=1e-4, micro_batch_size=8, weight_decay=0.0))
    assert cfg.optimizer.params.weight_decay == 0.0  # the Trainer's value fills the "auto"


def test_torch_adam_refuses_bias_correction_false():
    # torch.optim.AdamW/Adam have no bias_correction: DeepSpeed fails with a TypeError building it.
    _refused({"optimizer": {"type": "Adam", "params": {"torch_adam": True, "bias_correction": False}}},
             "`optimizer.params.bias_correction` is false with `torch_adam: true`")


@pytest.mark.parametrize("value", [1e-10, 0.5, 2.5])
def test_fractional_min_loss_scale_is_refused(value):
    # runtime/precision_config.py: `min_loss_scale: int`; pydantic refuses a float with a fraction.
    _refused({"fp16": {"enabled": True, "min_loss_scale": value}}, "`fp16.min_loss_scale` must be an integer")
    assert load_config({**BASE, "fp16": {"enabled": True, "min_loss_scale": 2.0}}).fp16.min_loss_scale == 2


def test_compile_switched_off_as_openrlhf_writes_it():
    cfg = load_config({**BASE, "compile": {"deepcompile": False}})
    assert cfg.compile.deepcompile is False
    load_config({**BASE, "compile": {"deepcompile": False, "offload_parameters": True, "passes": ["z3"]}})
    errors = _refused({"compile": {"deepcompile": True}}, "`compile.deepcompile`", "fnzero.jit")
    assert len(errors) == 1
    _refused({"compile": {"deepcompile": False, "deep_compile": True}}, "`compile.deep_compile` is not a known key")


@pytest.mark.parametrize("block", [{"wandb": {"project": "p"}}, {"comet": {"project": "p", "enabled": False}},
                                   {"hybrid_engine": {"max_out_tokens": 1024}}, {"autotuning": {"fast": True}},
                                   {"expert_parallel": {"autoep_size": 2}}, {"datastates_ckpt": False}])
def test_blocks_deepspeed_leaves_off_are_accepted(block):
    # Each block's `enabled` defaults to false in DeepSpeed 0.19.8 (datastates_ckpt: on unless false).
    load_config({**BASE, **block})


@pytest.mark.parametrize("block,name", [({"wandb": {"enabled": True}}, "`wandb`"),
                                        ({"datastates_ckpt": {}}, "`datastates_ckpt`"),
                                        ({"graph_harvesting": True}, "`graph_harvesting`"),
                                        ({"zero_optimization": {"zenflow": {}}}, "`zero_optimization.zenflow`")])
def test_blocks_deepspeed_turns_on_are_refused_by_name(block, name):
    errors = _refused(block, name, "does not implement")
    assert not any(_as_unknown(e) for e in errors)


def test_compute_grad_norm_false_only_where_deepspeed_allows_it():
    # runtime/zero/config.py compute_grad_norm_valid: stage 1 or 2; stage_1_and_2.py: gradient_clipping 0.
    _refused({"zero_optimization": {"stage": 3, "compute_grad_norm": False}}, "stage` is 3", "stage 1 or 2")
    _refused({"zero_optimization": {"stage": 2, "compute_grad_norm": False}}, "`gradient_clipping` is 1.0")
    cfg = load_config({**BASE, "gradient_clipping": 0, "zero_optimization": {"stage": 2, "compute_grad_norm": False}})
    assert cfg.zero_optimization.compute_grad_norm is False


def test_unprefixed_stage3_keys_take_hf_auto_values():
    from fnzero.config import hf_auto_values

    zero = {"stage": 3, "prefetch_bucket_size": "auto", "param_persistence_threshold": "auto",
            "max_live_parameters": 1e9, "gather_16bit_weights_on_model_save": True}
    cfg = load_config({**BASE, "zero_optimization": zero}, auto=hf_auto_values(lr=1e-4, micro_batch_size=8,
                                                                                 hidden_size=100))
    z = cfg.zero_optimization
    assert (z.stage3_prefetch_bucket_size, z.stage3_param_persistence_threshold) == (9000, 1000)
    assert z.stage3_max_live_parameters == 10**9 and z.stage3_gather_16bit_weights_on_model_save is True


# What DeepSpeed versions before the removal wrote to switch each removed feature off.
REMOVED_OFF_FORM = {"sparse_gradients": False, "graph_harvesting": False, "zero_optimization.mics_shard_size": -1,
                    "zero_optimization.mics_hierarchical_params_gather": False, "zero_optimization.zeropp_loco_param": None}


@pytest.mark.parametrize("key", TABLE["removed_keys"])
def test_keys_deepspeed_removed_load_when_off_warning_that_deepspeed_refuses_them(key):
    # DeepSpeed 0.19.8 refuses these keys whatever their value (openfold's "amp": {"enabled": false} among
    # real configs); fnzero reads the off form as off, and says that DeepSpeed would not load the file.
    *parents, leaf = key.split(".")
    config = {leaf: REMOVED_OFF_FORM.get(key, {"enabled": False})}
    for part in reversed(parents):
        config = {part: config}
    cfg, errors, caught = _load({**BASE, **config})
    assert errors is None, errors
    said = [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]
    assert any(f"`{key}` is off" in m and "DeepSpeed 0.19.8 refuses this key in any form" in m for m in said), said



def _holding(path: str, key: str) -> dict:
    """A config with `key` inside the object at `path` ("" = the top level)."""
    leaf: dict = {key: 1}
    if path in ("optimizer", "scheduler"):
        leaf = {"type": "Adam" if path == "optimizer" else "WarmupLR", **leaf}
    if path == "optimizer.params":
        return {**BASE, "optimizer": {"type": "Adam", "params": leaf}}
    for part in reversed(path.split(".") if path else []):
        leaf = {part: leaf}
    return {**BASE, **leaf}


IGNORING = TABLE["unknown_keys_ignored_in"]


def test_fnzero_knows_where_deepspeed_ignores_unknown_keys():
    from fnzero.config._schema import IGNORED_BY_DEEPSPEED

    assert IGNORED_BY_DEEPSPEED == set(IGNORING)


@pytest.mark.parametrize("path", IGNORING)
def test_unknown_key_where_deepspeed_ignores_it_is_refused_saying_so_and_a_comment_is_dropped(path):
    # DeepSpeed reads these objects key by key (or not at all, the top level's unknown keys) and ignores
    # what it does not know: fnzero refuses a key that may be misspelt, saying so, and drops a note.
    errors = _refused(_holding(path, "bogus_key"), "is not a DeepSpeed config key", "DeepSpeed ignores",
                      "never lost silently")
    assert len(errors) == 1
    noted = _holding(path, "_comment")
    plain = json.loads(json.dumps(noted))
    node = plain
    for part in path.split(".") if path else []:
        node = node[part]
    del node["_comment"]
    assert load_config(noted) == load_config(plain)


@pytest.mark.parametrize("path", ["zero_optimization", "fp16", "tensor_parallel", "optimizer.params"])
def test_unknown_key_where_deepspeed_refuses_it_is_refused_as_unknown(path):
    with pytest.raises(ConfigError) as info:
        load_config(_holding(path, "_comment"))
    assert "is not a known key" in str(info.value) and "DeepSpeed ignores" not in str(info.value)
