"""`sequence_parallel_size` (alias `sp_size`) and what it changes in the config (specs/config.md §Top level,
§Batch triad): the data-parallel world the batch triad counts, and the gradient reduction dtype.

DeepSpeed 0.19.8, read at its source (deepspeed/): runtime/config.py `DeepSpeedConfig.__init__` counts
`world / config["sequence_parallel_size"]` ranks in the triad when it has no mpu; runtime/engine.py, with a
sequence-parallel world > 1, sets `self.communication_data_type = self._config.seq_parallel_communication_data_type`,
the dtype its gradient all-reduce and ZeRO's reduce use, whatever `communication_data_type` says (the setter
overwrites it). DeepSpeed is not imported here; what it says was recorded by running its `DeepSpeedConfig` with
`dist.get_world_size` giving 8: micro 2, gas 1, sequence_parallel_size 2 -> world 4.0, train_batch_size 8.0;
train_batch_size 8, sequence_parallel_size 4 -> micro 4.0, gas 1 (fnzero's are the same, as integers). It
accepts `seq_parallel_communication_data_type: null` and ignores `sp_size`.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from fnzero._errors import ConfigError
from fnzero.config import ConfigWarning, load_config
from fnzero.state import step_policy

BASE = {"train_micro_batch_size_per_gpu": 2}


def _refused(src: dict, *needles: str, world_size: int | None = 8) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(src, world_size=world_size)
    errors = info.value.errors
    assert len(errors) == 1, errors
    for needle in needles:
        assert needle in errors[0], f"{needle!r} not in {errors[0]!r}"
    return errors


def _warnings_of(src: dict, world_size: int = 8) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(src, world_size=world_size)
    return [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]


# specs/config.md §Top level: sequence_parallel_size
def test_absent_is_one_and_is_written_back():
    cfg = load_config(BASE, world_size=8)
    assert cfg.sequence_parallel_size == 1 and cfg.train_batch_size == 16
    assert json.loads(cfg.to_json())["sequence_parallel_size"] == 1


@pytest.mark.parametrize("key", ["sequence_parallel_size", "sp_size"])
def test_key_and_accelerate_alias_resolve_alike(key):
    cfg = load_config({**BASE, key: 2}, world_size=8)
    assert cfg.sequence_parallel_size == 2
    written = json.loads(cfg.to_json())
    assert written["sequence_parallel_size"] == 2 and "sp_size" not in written
    assert load_config(cfg.to_json(), world_size=cfg.world_ranks) == cfg


def test_both_spellings_equal_are_one_key():
    assert load_config({**BASE, "sp_size": 2, "sequence_parallel_size": 2}, world_size=8).sequence_parallel_size == 2


def test_both_spellings_different_are_refused_naming_both():
    _refused({**BASE, "sp_size": 2, "sequence_parallel_size": 4}, "`sp_size`", "`sequence_parallel_size`", "2", "4")


@pytest.mark.parametrize("value,says", [
    (0, "must be > 0, got 0"), (-1, "must be > 0, got -1"), (2.5, "must be an integer, got 2.5"),
    (True, "must be an integer, got the boolean true"), ("2", 'must be an integer, got "2"'), (None, "null"),
])
@pytest.mark.parametrize("key", ["sequence_parallel_size", "sp_size"])
def test_bad_values_are_one_line_naming_the_key(key, value, says):
    # The alias is reported under the key it was renamed to; the message is about the one key either way.
    _refused({**BASE, key: value}, "`sequence_parallel_size`", says)


def test_integral_float_is_an_integer():
    assert load_config({**BASE, "sequence_parallel_size": 2.0}, world_size=8).train_batch_size == 8


# specs/config.md §Batch triad: world / (tensor-parallel x pipeline stages x sequence-parallel)
def test_triad_counts_data_parallel_ranks():
    cfg = load_config({**BASE, "gradient_accumulation_steps": 1, "sequence_parallel_size": 2}, world_size=8)
    assert (cfg.train_batch_size, cfg.world_size, cfg.world_ranks) == (8, 4, 8)


def test_triad_with_tensor_parallel_and_sequence_parallel():
    cfg = load_config({**BASE, "sequence_parallel_size": 2, "tensor_parallel": {"autotp_size": 2}}, world_size=8)
    assert (cfg.world_size, cfg.train_batch_size) == (2, 4)


def test_triad_derives_micro_from_train_batch_size():
    cfg = load_config({"train_batch_size": 8, "sequence_parallel_size": 4}, world_size=8)
    assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (4, 1)


def test_train_batch_size_counting_every_rank_is_refused_with_the_hint():
    _refused({**BASE, "train_batch_size": 16, "gradient_accumulation_steps": 1, "sequence_parallel_size": 2},
             "16 counts all 8 ranks", "sequence-parallel", "world_size=4")


def test_world_not_divided_by_sequence_parallel_is_refused():
    _refused({**BASE, "sequence_parallel_size": 4}, "`sequence_parallel_size` 4", "world size 6", "multiple of 4",
             world_size=6)


def test_world_not_divided_by_sequence_and_tensor_parallel_names_both():
    _refused({**BASE, "sequence_parallel_size": 2, "tensor_parallel": {"autotp_size": 2}},
             "`tensor_parallel.autotp_size` 2", "`sequence_parallel_size` 2", "world size 6", "multiple of 4",
             world_size=6)


def test_without_a_world_one_data_parallel_rank():
    cfg = load_config({**BASE, "sequence_parallel_size": 4})
    assert (cfg.world_size, cfg.world_ranks, cfg.train_batch_size) == (1, 4, 2)


def test_tensor_parallel_size_as_integral_float_counts_too():
    # autotp_size 2.0 validates as 2, so the triad must divide by 2 as well.
    cfg = load_config({**BASE, "tensor_parallel": {"autotp_size": 2.0}}, world_size=8)
    assert (cfg.tensor_parallel.size, cfg.world_size) == (2, 4)


# specs/config.md §Top level: seq_parallel_communication_data_type
@pytest.mark.parametrize("top,want", [
    ({}, torch.float32),  # DeepSpeed's default seq_parallel_communication_data_type
    ({"seq_parallel_communication_data_type": "bf16"}, torch.bfloat16),
    ({"communication_data_type": "fp16"}, torch.float32),  # replaced, not consulted
    ({"communication_data_type": "fp16", "seq_parallel_communication_data_type": "bf16"}, torch.bfloat16),
    # null: DeepSpeed's communication_data_type property then falls back to the precision's dtype
    ({"communication_data_type": "fp16", "seq_parallel_communication_data_type": None}, None),
])
def test_sequence_parallel_reduces_gradients_in_its_dtype(top, want):
    cfg = load_config({**BASE, "bf16": {"enabled": True}, "sequence_parallel_size": 2, **top}, world_size=8)
    assert step_policy(cfg).comm_dtype == want


@pytest.mark.parametrize("top,want", [
    ({}, None),  # null: the training dtype
    ({"seq_parallel_communication_data_type": "bf16"}, None),
    ({"communication_data_type": "fp16", "seq_parallel_communication_data_type": "bf16"}, torch.float16),
])
def test_without_sequence_parallel_communication_data_type_decides(top, want):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)  # seq_parallel_communication_data_type has no effect here
        cfg = load_config({**BASE, "sequence_parallel_size": 1, **top}, world_size=8)
    assert step_policy(cfg).comm_dtype == want


def test_seq_dtype_warns_only_without_sequence_parallel():
    src = {**BASE, "seq_parallel_communication_data_type": "bf16"}
    [message] = _warnings_of(src)
    assert "`seq_parallel_communication_data_type`" in message and "sequence_parallel_size > 1" in message
    assert _warnings_of({**src, "sequence_parallel_size": 2}) == []
    assert _warnings_of({**BASE, "seq_parallel_communication_data_type": "fp32"}) == []
