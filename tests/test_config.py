"""Property tests of fnzero.config: round trip, typos, arbitrary junk, batch triad (specs/config.md)."""

from __future__ import annotations

import json
import string

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from fnzero._errors import ConfigError
from fnzero.config import Config, load_config
from fnzero.config._schema import all_paths

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

small_pos = st.integers(1, 16)
lr = st.floats(1e-6, 1.0, allow_nan=False)


@st.composite
def optimizers(draw):
    kind = draw(st.sampled_from(["Adam", "AdamW", "SGD", "Adagrad", "Lamb", "Lion"]))
    params = {"lr": draw(lr)}
    if kind in ("Adam", "AdamW", "Lamb", "Lion"):
        params["betas"] = [draw(st.floats(0, 0.99)), draw(st.floats(0, 0.999))]
        params["weight_decay"] = draw(st.floats(0, 0.5))
    if kind == "SGD" and draw(st.booleans()):
        params.update(momentum=0.9, nesterov=True)
    spelled = draw(st.sampled_from([kind, kind.lower(), kind.upper()]))
    return {"type": spelled, "params": params}


@st.composite
def schedulers(draw):
    kind = draw(st.sampled_from(["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"]))
    warm = draw(st.integers(1, 100))
    if kind == "WarmupLR":
        params = {"warmup_num_steps": warm, "warmup_type": draw(st.sampled_from(["log", "linear"]))}
    elif kind in ("WarmupDecayLR", "WarmupCosineLR"):
        params = {"warmup_num_steps": warm, "total_num_steps": warm + draw(st.integers(0, 1000))}
    elif kind == "OneCycle":
        params = {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_momentum": False}
    else:
        params = {"lr_range_test_step_size": warm}
    return {"type": kind, "params": params}


@st.composite
def valid_configs(draw):
    micro, gas, world = draw(small_pos), draw(small_pos), draw(st.integers(1, 8))
    stage = draw(st.integers(0, 3))
    src: dict = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
                 "gradient_clipping": draw(st.sampled_from([0, 1.0, 0.5])),
                 "zero_optimization": {"stage": stage, "reduce_bucket_size": draw(st.sampled_from([5e8, 2e8, 12345]))}}
    precision = draw(st.sampled_from(["fp32", "fp16", "bf16"]))
    if precision != "fp32":
        src[precision] = {"enabled": True}
    if stage > 0 and draw(st.booleans()):
        src["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": draw(st.booleans())}
    if stage == 3 and draw(st.booleans()):
        # Parameters on NVMe, beside the optimizer wherever it is; with the optimizer on nvme in one
        # directory (its master file holds them: specs/offload.md §Parameters).
        if draw(st.booleans()):
            src["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": "/local_nvme"}
        src["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": "/local_nvme"}
    if draw(st.booleans()):
        src["optimizer"] = draw(optimizers())
    if draw(st.booleans()):
        src["scheduler"] = draw(schedulers())
    if draw(st.booleans()):
        src["train_batch_size"] = micro * gas * world
    return src, world


# specs/config.md §Round trip
@SETTINGS
@given(valid_configs())
def test_round_trip(drawn):
    src, world = drawn
    cfg = load_config(src, world_size=world)
    text = cfg.to_json()
    again = load_config(text, world_size=cfg.world_size)
    assert again == cfg
    assert again.to_json() == text
    assert json.loads(text)["train_batch_size"] == cfg.train_batch_size


def _dict_paths(tree: dict, prefix: tuple = ()) -> list[tuple]:
    out = []
    for key, value in tree.items():
        out.append(prefix + (key,))
        if isinstance(value, dict):
            out.extend(_dict_paths(value, prefix + (key,)))
    return out


@st.composite
def typos(draw, word: str) -> str:
    i = draw(st.integers(0, len(word)))
    op = draw(st.sampled_from(["insert", "delete", "replace", "swap"]))
    letter = draw(st.sampled_from(string.ascii_lowercase + "_"))
    if op == "insert":
        return word[:i] + letter + word[i:]
    if op == "delete" and i < len(word):
        return word[:i] + word[i + 1:]
    if op == "swap" and i < len(word) - 1:
        return word[:i] + word[i + 1] + word[i] + word[i + 2:]
    return word[:i] + letter + word[i + 1:]


# specs/config.md §Unknown keys
@SETTINGS
@given(valid_configs(), st.data())
def test_typo_in_any_key_names_its_dotted_path(drawn, data):
    src, world = drawn
    full = json.loads(load_config(src, world_size=world).to_json())
    path = data.draw(st.sampled_from(_dict_paths(full)))
    *head, leaf = path
    parent = full
    for key in head:
        parent = parent[key]
    bad = data.draw(typos(leaf))
    assume(bad not in parent and bad != leaf)
    sibling_names = {p.rsplit(".", 1)[-1] for p in all_paths()}
    assume(bad not in sibling_names)  # an edit that lands on another real key is not a typo
    parent[bad] = parent.pop(leaf)
    dotted = ".".join([*head, bad])
    try:
        load_config(full, world_size=world)
    except ConfigError as err:
        assert f"`{dotted}`" in str(err)
    else:
        raise AssertionError(f"typo {dotted} was accepted")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


# specs/config.md §Errors (junk may set a key that has no effect in fnzero: that warns, and is not the point here)
@pytest.mark.filterwarnings("ignore::fnzero.config.ConfigWarning")
@SETTINGS
@given(valid_configs(), st.sampled_from(sorted(all_paths())), json_values)
def test_junk_at_any_key_is_config_or_config_error(drawn, path, value):
    src, world = drawn
    node = src
    *head, leaf = path.split(".")
    for key in head:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    node[leaf] = value
    for source in (src, json.dumps(src)):
        try:
            result = load_config(source, world_size=world)
        except ConfigError as err:
            assert isinstance(err, ValueError) and err.errors
        else:
            assert isinstance(result, Config)


@pytest.mark.filterwarnings("ignore::fnzero.config.ConfigWarning")
@SETTINGS
@given(st.text(max_size=60) | st.binary(max_size=40).map(lambda b: b.decode("latin-1")))
def test_arbitrary_text_is_config_or_config_error(text):
    try:
        load_config(text)
    except ConfigError:
        pass


# specs/config.md §Batch triad
@SETTINGS
@given(small_pos, small_pos, st.integers(1, 8), st.sampled_from(["train_batch_size", "train_micro_batch_size_per_gpu",
                                                                  "gradient_accumulation_steps"]))
def test_batch_triad_derives_the_dropped_member(micro, gas, world, dropped):
    full = {"train_batch_size": micro * gas * world, "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": gas}
    del full[dropped]
    cfg = load_config(full, world_size=world)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (
        micro * gas * world, micro, gas)
