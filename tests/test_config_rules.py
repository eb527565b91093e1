"""One test per config rule in specs/config.md, asserting the important parts of each message."""

from __future__ import annotations

import base64
import json

import pytest

from fnzero._errors import ConfigError
from fnzero import config as fnzero_config
from fnzero.config import AdamParams, Config, ConfigWarning, load_config

BASE = {"train_batch_size": 8}


def fails(src, *needles, world_size=1, auto=None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(src, world_size=world_size, auto=auto)
    err = info.value
    assert isinstance(err, ValueError)
    for needle in needles:
        assert needle in str(err), f"{needle!r} not in:\n{err}"
    assert err.errors and all(isinstance(e, str) for e in err.errors)
    return err


def cfg(**extra) -> dict:
    return {**BASE, **extra}


# specs/config.md §Unknown keys
def test_unknown_top_level_key_suggests_nearest():
    fails(cfg(zero_optimisation={"stage": 2}), "`zero_optimisation`", "did you mean `zero_optimization`?")


@pytest.mark.parametrize("key", ["local_rank", "cuda_visible_devices", "monitor_config"])
def test_unknown_top_level_key_is_refused_saying_deepspeed_ignores_it(key):
    # DeepSpeed reads the top-level keys it knows and ignores the rest; fnzero refuses, and says why.
    fails(cfg(**{key: 0}), f"`{key}` is not a DeepSpeed config key", "DeepSpeed ignores top-level keys",
          "misspelt key is never lost silently", "start its name with `_`")


@pytest.mark.parametrize("section, near, meant, listing", [
    ("", "zero_optimizaton", "zero_optimization", "activation_checkpointing, aio, autotuning"),
    ("zero_optimization", "stag", "stage", "allgather_bucket_size, allgather_partitions"),
    ("activation_checkpointing", "partition_activation", "partition_activations", "contiguous_memory_optimization, cpu"),
])
def test_several_unknown_keys_in_one_object_list_the_valid_keys_once(section, near, meant, listing):
    # Two stray keys used to repeat the whole list of valid keys once each (2,420 characters at the top
    # level); each key is still named, a near one still with its suggestion.
    stray = {"foo_bar": 1, "qux_quux": 2, near: 3}
    err = fails(cfg(**{section: stray}) if section else cfg(**stray))
    text, at = str(err), f"{section}." if section else ""
    assert text.count(listing) == 1, text
    assert f"`{at}foo_bar` and `{at}qux_quux` are not" in text, text
    assert f"`{at}{near}` is not a" in text and f"did you mean `{meant}`?" in text, text
    assert len(err.errors) == 2  # the two keys with no near valid key share one line


def test_comment_keys_at_top_level_are_dropped_as_deepspeed_drops_them():
    # JSON has no comments; configs carry notes in "_comment"-style keys, which no DeepSpeed key resembles.
    noted = load_config(cfg(_comment="ZeRO-2 for 8 GPUs", _read_the_docs="https://www.deepspeed.ai/docs/config-json/"))
    assert noted == load_config(BASE) and "_comment" not in noted.to_json()
    # Inside a section DeepSpeed's pydantic models refuse extra keys, and so does fnzero.
    fails(cfg(zero_optimization={"_comment": "x"}), "`zero_optimization._comment` is not a known key")


def test_fnzero_own_fields_are_no_config_keys():
    # Config fields left out of to_json record load_config's arguments; a config cannot set them.
    own = [name for name, info in Config.model_fields.items() if info.exclude]
    assert own == ["world_size", "world_ranks"]
    for name in own:
        fails(cfg(**{name: 4}), f"`{name}` is not a DeepSpeed config key", "load_config(world_size=...)")
        fails(BASE, "is not a DeepSpeed config path", auto={name: 4})
    assert "world_ranks" not in str(fails(cfg(world_rank=4)))  # nor offered as the key meant


def test_unknown_nested_key_names_full_path_and_suggests():
    fails(cfg(zero_optimization={"stage3_prefetch_bucket": 1}),
          "`zero_optimization.stage3_prefetch_bucket`", "did you mean `stage3_prefetch_bucket_size`?")


def test_unknown_optimizer_param_suggests():
    fails(cfg(optimizer={"type": "Adam", "params": {"weight_decy": 0.1}}),
          "`optimizer.params.weight_decy`", "did you mean `weight_decay`?")


def test_max_grad_norm_outside_lamb_points_to_gradient_clipping():
    fails(cfg(optimizer={"type": "Adam", "params": {"max_grad_norm": 1.0}}), "gradient_clipping")
    assert load_config(cfg(optimizer={"type": "Lamb", "params": {"max_grad_norm": 1.0}})).optimizer.params.max_grad_norm == 1.0


def test_seed_is_not_a_deepspeed_key():
    fails(cfg(seed=1), "`seed`", "torch.manual_seed")


# specs/config.md §Syntax
def test_duplicate_keys_in_text():
    fails('{"train_batch_size": 8, "zero_optimization": {"stage": 1, "stage": 2}}', "duplicate key `stage`")


def test_comments_and_trailing_commas_accepted_strings_untouched():
    text = """{
      // line comment
      "train_batch_size": 8, /* block
      comment */
      "tensorboard": {"enabled": false, "output_path": "/tmp/a//b/*c*/,}", "job_name": "x, ]",},
    }"""
    c = load_config(text)
    assert c.tensorboard.output_path == "/tmp/a//b/*c*/,}"
    assert c.tensorboard.job_name == "x, ]"


def test_malformed_text_names_line_and_column():
    fails('{\n  "train_batch_size": 8\n  "steps_per_print": 1\n}', "line 3, column 3")


def test_unclosed_block_comment():
    fails('{"train_batch_size": 8 /* oops', "line 1, column 24", "never closed")


@pytest.mark.parametrize("text", ["", "   \n", "// only a comment\n"])
def test_empty_text(text):
    fails(text, "empty" if "//" not in text else "only comments", "JSON object")


def test_empty_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text("")
    fails(str(path), "empty", str(path))


@pytest.mark.parametrize("text,needle", [("[1, 2]", "got [1, 2]"), ("42", "got 42"), ('"x"', "top level")])
def test_non_object_top_level(text, needle):
    fails(text, "top level of a config must be a JSON object", needle)


@pytest.mark.parametrize("const", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_rejected(const):
    fails('{"train_batch_size": 8, "gradient_clipping": %s}' % const, f"`{const.lstrip('-')}`" if const != "-Infinity" else "Infinity")


def test_number_out_of_range():
    fails('{"train_batch_size": 8, "gradient_clipping": 1e400}', "1e400", "out of range")


def test_huge_integer_out_of_int64_range():
    fails(cfg(zero_optimization={"reduce_bucket_size": 10**30}), "`zero_optimization.reduce_bucket_size`", "64-bit")


def test_deep_nesting_never_recursion_error():
    fails("[" * 100_000 + "]" * 100_000, "nested")
    deep: dict = {}
    node = deep
    for _ in range(10_000):
        node["a"] = {}
        node = node["a"]
    fails(cfg(junk=deep), "nested")


def test_cyclic_dict_is_a_config_error():
    loop: dict = {"train_batch_size": 8}
    loop["tensorboard"] = loop
    fails(loop, "nested")


def test_missing_path():
    fails("/definitely/not/here/ds_config.json", "/definitely/not/here/ds_config.json", "does not exist")


def test_path_and_pathlike_and_base64(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg(steps_per_print=3)))
    assert load_config(path).steps_per_print == 3
    assert load_config(str(path)).steps_per_print == 3
    encoded = base64.urlsafe_b64encode(json.dumps(cfg(steps_per_print=4)).encode()).decode()
    assert load_config(encoded).steps_per_print == 4
    fails(tmp_path / "missing.json", "missing.json", "does not exist")


def test_unloadable_source_type():
    fails(3.5, "cannot load a config from 3.5")


# specs/config.md §Types
@pytest.mark.parametrize("value,needle", [("3", 'got "3" (a string); write it without quotes'),
                                          (True, "got the boolean true"), (2.5, "got 2.5"), (4, "<= 3")])
def test_stage_types(value, needle):
    fails(cfg(zero_optimization={"stage": value}), "`zero_optimization.stage`", needle)


def test_integral_float_accepted_for_int():
    c = load_config(cfg(zero_optimization={"reduce_bucket_size": 2e8, "stage3_prefetch_bucket_size": 5e7}))
    assert c.zero_optimization.reduce_bucket_size == 200_000_000
    assert type(c.zero_optimization.reduce_bucket_size) is int


def test_negative_size_rejected():
    fails(cfg(zero_optimization={"allgather_bucket_size": -1}), "`zero_optimization.allgather_bucket_size`", ">= 0")


def test_bool_field_rejects_string():
    fails(cfg(wall_clock_breakdown="true"), "`wall_clock_breakdown`", "true or false", "without quotes")


def test_section_must_be_object():
    fails(cfg(fp16=[]), "`fp16` must be a JSON object")


def test_several_problems_collected_in_one_error():
    err = fails(cfg(zero_optimisation={}, fp16={"loss_scale": -1}, wall_clock_breakdown=1))
    assert len(err.errors) == 3
    assert str(err).count("\n  - ") == 3


# specs/config.md §Batch triad
def test_triad_inconsistent_names_numbers():
    fails({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
          "train_batch_size 32 != 4 (micro) × 2 (gas) × 2 (world)", world_size=2)


@pytest.mark.parametrize("parallel", [{"tensor_parallel": {"autotp_size": 2}}, {"pipeline": {"stages": 2}}])
def test_triad_counted_over_every_rank_says_which_world_counts(parallel):
    # What DeepSpeed without an mpu (the HF Trainer's path) writes for 4 ranks: micro x gas x all ranks.
    trainer = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}
    fails({**trainer, **parallel}, "32 counts all 4 ranks", "the 2 data-parallel ranks", "world_size=2", world_size=4)
    hf = fnzero_config.hf_auto_values(lr=1e-4, micro_batch_size=4, gradient_accumulation_steps=2, world_size=2)
    auto = {**dict.fromkeys(trainer, "auto"), **parallel}
    assert load_config(auto, world_size=4, auto=hf).train_batch_size == 16
    # Any other mismatch is not explained as one of ranks.
    assert "counts all" not in str(fails({**trainer, "train_batch_size": 24, **parallel}, world_size=4))


def test_triad_not_divisible():
    fails({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, "30", "4 (micro)", "2 (world)", world_size=2)


def test_triad_none_given():
    fails({"gradient_accumulation_steps": 2}, "`train_batch_size` or `train_micro_batch_size_per_gpu`")


def test_triad_only_tbs_and_only_micro():
    c = load_config({"train_batch_size": 16}, world_size=4)
    assert (c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (4, 1)
    c = load_config({"train_micro_batch_size_per_gpu": 3}, world_size=4)
    assert (c.train_batch_size, c.gradient_accumulation_steps) == (12, 1)


def test_triad_zero_rejected():
    fails({"train_batch_size": 0}, "`train_batch_size` must be > 0")


def test_world_size_argument_validated():
    fails(BASE, "world_size", world_size=0)
    fails(BASE, "world_size", world_size=True)


# specs/config.md §Precision
def test_fp16_and_bf16_both_enabled():
    fails(cfg(fp16={"enabled": True}, bf16={"enabled": True}), "`fp16.enabled` and `bf16.enabled`")


def test_bfloat16_legacy_alias():
    c = load_config(cfg(bfloat16={"enabled": True}))
    assert c.bf16.enabled and c.precision == "bf16"
    fails(cfg(bfloat16={"enabled": True}, bf16={"enabled": False}), "`bfloat16`", "`bf16`")


def test_fp16_negative_loss_scale():
    fails(cfg(fp16={"enabled": True, "loss_scale": -1}), "`fp16.loss_scale`", ">= 0")


# specs/config.md §auto
def test_auto_unfilled_names_key_and_how_to_pass():
    err = fails(cfg(optimizer={"type": "AdamW", "params": {"lr": "auto"}}),
                '`optimizer.params.lr` is "auto"', "HuggingFace", 'auto={"optimizer.params.lr"')
    assert len(err.errors) == 1


def test_auto_filled():
    src = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "gradient_clipping": "auto", "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto",
           "eps": "auto", "weight_decay": "auto"}}, "scheduler": {"type": "WarmupDecayLR", "params": {
           "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto", "total_num_steps": "auto"}},
           "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
           "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                 "stage3_param_persistence_threshold": "auto"}}
    auto = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
            "gradient_clipping": 1.0, "optimizer.params.lr": 3e-4, "optimizer.params.betas": [0.9, 0.95],
            "optimizer.params.eps": 1e-6, "optimizer.params.weight_decay": 0.1, "scheduler.params.warmup_min_lr": 0,
            "scheduler.params.warmup_max_lr": 3e-4, "scheduler.params.warmup_num_steps": 10,
            "scheduler.params.total_num_steps": 100, "fp16.enabled": False, "bf16.enabled": True,
            "zero_optimization.reduce_bucket_size": 1048576, "zero_optimization.stage3_prefetch_bucket_size": 943718,
            "zero_optimization.stage3_param_persistence_threshold": 10240}
    c = load_config(src, world_size=2, auto=auto)
    assert c.optimizer.params.betas == (0.9, 0.95) and c.scheduler.params.total_num_steps == 100
    assert c.precision == "bf16" and c.zero_optimization.stage3_prefetch_bucket_size == 943718


def test_auto_conflict_names_both():
    fails(cfg(optimizer={"type": "Adam", "params": {"lr": 1e-3}}), "`optimizer.params.lr` is 0.001", "supplies 0.0003",
          auto={"optimizer.params.lr": 3e-4})


def test_auto_same_value_and_absent_key_are_fine():
    c = load_config(cfg(optimizer={"type": "Adam", "params": {"lr": 1e-3}}),
                    auto={"optimizer.params.lr": 0.001, "gradient_clipping": 0.5})
    assert c.gradient_clipping == 0.5  # an absent key is set by a plain dict (DeepSpeed's default would be 1.0)


def test_auto_invalid_path_suggests():
    fails(BASE, "`optimizer.params.lrr`" if False else "optimizer.params.lrr", "did you mean `optimizer.params.lr`",
          auto={"optimizer.params.lrr": 1.0})


# specs/config.md §Unsupported features
def test_unsupported_feature_enabled():
    fails(cfg(wandb={"enabled": True}),
          "`wandb` is a DeepSpeed feature fnzero does not implement; remove the block or set enabled: false")


def test_pipeline_block_is_read_and_its_inert_keys_warn():
    """DeepSpeed's defaults pass silently; `stages` sizes the mesh (the batch triad counts
    data-parallel ranks); keys DeepSpeed's engine reads but fnzero does not act on warn."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = load_config(cfg(pipeline={"stages": "auto", "partition": "best", "activation_checkpoint_interval": 0}))
        assert c.pipeline.size is None
        c = load_config({**cfg(pipeline={"stages": 2}), "train_batch_size": 8}, world_size=4)
        assert (c.world_ranks, c.world_size, c.train_micro_batch_size_per_gpu) == (4, 2, 4)
    with pytest.warns(ConfigWarning, match='`pipeline.partition` is "type:Block"'):
        load_config(cfg(pipeline={"partition": "type:Block"}))
    with pytest.warns(ConfigWarning, match="`pipeline.use_reentrant` is false"):
        load_config(cfg(pipeline={"use_reentrant": False}))


def test_pipeline_refuses_zero_2_and_a_world_its_stages_do_not_divide():
    fails(cfg(pipeline={"stages": 2}, zero_optimization={"stage": 2}),
          "`zero_optimization.stage` is 2 with `pipeline.stages` 2: ZeRO-2 and ZeRO-3 are incompatible", world_size=2)
    with pytest.raises(ConfigError, match="`pipeline.stages` 3 does not divide the world size 4"):
        load_config(cfg(pipeline={"stages": 3}), world_size=4)


@pytest.mark.parametrize("block", ["amp", "elasticity", "comet", "moe", "sparse_attention"])
def test_unsupported_feature_disabled_is_accepted(block):
    if block in ("amp", "elasticity", "sparse_attention"):  # DeepSpeed 0.19.8 refuses these in any form
        with pytest.warns(ConfigWarning, match=f"`{block}` is off.*DeepSpeed 0.19.8 refuses this key in any form"):
            load_config(cfg(**{block: {"enabled": False}}))
    else:
        load_config(cfg(**{block: {"enabled": False}}))
    fails(cfg(**{block: {"enabled": True}}), f"`{block}` is a DeepSpeed feature")


@pytest.mark.parametrize("key,value", [("zenflow", {}), ("zeropp_loco_param", {})])
def test_unsupported_zero_switches(key, value):
    fails(cfg(zero_optimization={"stage": 3, key: value}), f"`zero_optimization.{key}`", "does not implement")


def test_sparse_gradients_true():
    fails(cfg(sparse_gradients=True), "`sparse_gradients`", "does not implement")


# specs/config.md §Removed by DeepSpeed: keys DeepSpeed 0.19.8 no longer reads are errors; the ones
# it still reads as deprecated (runtime/zero/config.py) are read as it reads them, with a warning.
def test_removed_zero_key():
    fails(cfg(zero_optimization={"stage": 2, "cpu_offload_params": True}),
          "`zero_optimization.cpu_offload_params` was removed from DeepSpeed", "offload_param")


@pytest.mark.parametrize("key,value,new,want", [
    ("cpu_offload", True, "offload_optimizer", "cpu"), ("cpu_offload", False, "offload_optimizer", None),
    ("cpu_offload_param", True, "offload_param", "cpu"),
])
def test_deprecated_zero_keys_read_as_deepspeed_reads_them(key, value, new, want):
    with pytest.warns(ConfigWarning, match=f"`zero_optimization.{key}: {str(value).lower()}` is deprecated"):
        c = load_config(cfg(zero_optimization={"stage": 3, key: value}))
    block = getattr(c.zero_optimization, new)
    assert (block.device if block is not None else None) == want
    fails(cfg(zero_optimization={"stage": 3, key: True, new: {"device": "cpu"}}), f"give only `zero_optimization.{new}`")


def test_deprecated_pin_memory_key_warns_and_does_nothing():
    with pytest.warns(ConfigWarning, match="cpu_offload_use_pin_memory` is deprecated in DeepSpeed and has no effect"):
        load_config(cfg(zero_optimization={"stage": 2, "cpu_offload_use_pin_memory": True}))


def test_removed_fp32_allreduce_and_deprecated_bool_zero():
    fails(cfg(fp32_allreduce=True), "`fp32_allreduce` was removed", "communication_data_type")
    with pytest.warns(ConfigWarning, match=r'read as `zero_optimization: \{"stage": 1\}`'):
        assert load_config(cfg(zero_optimization=True)).zero_optimization.stage == 1


def test_fp16_weights_deprecated_spelling():
    # DeepSpeed 0.19.8 marks it deprecated (json_schema_extra new_param): read, with a warning; an error
    # beside the key it replaces, in either of that key's spellings.
    with pytest.warns(ConfigWarning, match="stage3_gather_fp16_weights_on_model_save: true` is deprecated"):
        c = load_config(cfg(zero_optimization={"stage": 3, "stage3_gather_fp16_weights_on_model_save": True}))
    assert c.zero_optimization.stage3_gather_16bit_weights_on_model_save
    for new in ("stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save"):
        fails(cfg(zero_optimization={"stage3_gather_fp16_weights_on_model_save": True, new: True}),
              "is the deprecated form of `zero_optimization.stage3_gather_16bit_weights_on_model_save`")


# specs/config.md §Cross-field rules
def test_offload_param_below_stage3():
    fails(cfg(zero_optimization={"stage": 2, "offload_param": {"device": "cpu"}}),
          "`zero_optimization.offload_param.device`", "stage 3")


def test_offload_optimizer_at_stage0():
    fails(cfg(zero_optimization={"stage": 0, "offload_optimizer": {"device": "cpu"}}),
          "`zero_optimization.offload_optimizer.device`", "stage 1, 2 or 3")


def test_nvme_without_path():
    fails(cfg(zero_optimization={"stage": 3, "offload_param": {"device": "nvme"}}), "`zero_optimization.offload_param.nvme_path`")


def test_nvme_params_beside_an_nvme_optimizer_need_its_path():
    # specs/offload.md §Parameters: with the optimizer on nvme its master file holds the shards.
    adam = {"type": "Adam", "params": {"lr": 1e-3}}
    fails(cfg(optimizer=adam, zero_optimization={"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/a"},
                                                 "offload_param": {"device": "nvme", "nvme_path": "/b"}}), "differs from")
    # The optimizer on the cpu, in memory, or absent (ZeRO-Inference): the shards get files of their own.
    for zero in ({"offload_optimizer": {"device": "cpu"}}, {}):
        for opt in ({"optimizer": adam}, {}):
            load_config(cfg(**opt, zero_optimization={"stage": 3, **zero,
                                                      "offload_param": {"device": "nvme", "nvme_path": "/nvme"}}))


def test_partial_offload_needs_stage3():
    fails(cfg(zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}), "ratio", "stage` 3")


def test_warmup_decay_needs_total_num_steps():
    fails(cfg(scheduler={"type": "WarmupDecayLR", "params": {}}), "`scheduler.params.total_num_steps` is required")


def test_warmup_cosine_needs_total_num_steps():
    fails(cfg(scheduler={"type": "WarmupCosineLR"}), "`scheduler.params.total_num_steps` is required")


def test_unimplemented_optimizer_and_scheduler_types():
    fails(cfg(optimizer={"type": "MuAdam"}), '`optimizer.type` "MuAdam" is not implemented', "AdamW")
    fails(cfg(scheduler={"type": "CosineAnnealing"}), "`scheduler.type`", "WarmupCosineLR")


def test_types_case_insensitive_and_canonical():
    c = load_config(cfg(optimizer={"type": "adamw"}, scheduler={"type": "warmupcosinelr", "params": {"total_num_steps": 5000}}))
    assert c.optimizer.type == "AdamW" and c.scheduler.type == "WarmupCosineLR"


def test_adamw_mode_false_with_adamw():
    fails(cfg(optimizer={"type": "AdamW", "params": {"adam_w_mode": False}}), "`optimizer.params.adam_w_mode`", "type Adam")


def test_amsgrad_rejected():
    fails(cfg(optimizer={"type": "Adam", "params": {"amsgrad": True}}), "`optimizer.params.amsgrad`", "not implemented")


def test_sgd_nesterov_rules():
    fails(cfg(optimizer={"type": "SGD", "params": {"nesterov": True}}), "`optimizer.params`", "momentum > 0")
    fails(cfg(optimizer={"type": "SGD", "params": {"nesterov": True, "momentum": 0.9, "dampening": 0.1}}), "dampening 0")
    load_config(cfg(optimizer={"type": "SGD", "params": {"nesterov": True, "momentum": 0.9}}))


def test_zero_step_sizes_rejected():
    fails(cfg(scheduler={"type": "LRRangeTest", "params": {"lr_range_test_step_size": 0}}),
          "`scheduler.params.lr_range_test_step_size` must be > 0")
    fails(cfg(scheduler={"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "cycle_first_step_size": 0}}),
          "`scheduler.params.cycle_first_step_size` must be > 0")
    fails(cfg(scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 0}}), "`scheduler.params.warmup_num_steps`")


def test_onecycle_requires_lrs():
    fails(cfg(scheduler={"type": "OneCycle"}), "`scheduler.params.cycle_min_lr` is required", "`scheduler.params.cycle_max_lr`")


def test_optimizer_params_are_kwargs():
    c = load_config(cfg(optimizer={"type": "Adam", "params": {"lr": 2e-4, "torch_adam": True}}))
    assert isinstance(c.optimizer.params, AdamParams)
    kwargs = c.optimizer.params.model_dump()
    assert kwargs["lr"] == 2e-4 and kwargs["betas"] == (0.9, 0.999) and kwargs["adam_w_mode"] is True


def test_warmuplr_max_lr_resolves_to_optimizer_lr():
    c = load_config(cfg(optimizer={"type": "Adam", "params": {"lr": 5e-4}}, scheduler={"type": "WarmupLR"}))
    assert c.scheduler.params.warmup_max_lr == 5e-4
    assert load_config(cfg(scheduler={"type": "WarmupLR"})).scheduler.params.warmup_max_lr is None


def test_overlap_comm_dynamic_default():
    assert load_config(cfg(zero_optimization={"stage": 3})).zero_optimization.overlap_comm is True
    # As DeepSpeed 0.19.8's overlap_comm_valid: null means stage == 3.
    for stage in (0, 1, 2):
        assert load_config(cfg(zero_optimization={"stage": stage})).zero_optimization.overlap_comm is False
    on = load_config(cfg(zero_optimization={"stage": 2, "overlap_comm": True}))
    assert on.zero_optimization.overlap_comm is True


def test_config_is_frozen_and_defaults_match_deepspeed():
    c = load_config(BASE)
    assert isinstance(c, Config) and c.world_size == 1
    with pytest.raises(Exception):
        c.steps_per_print = 3  # type: ignore[misc]
    z = c.zero_optimization
    assert (z.reduce_bucket_size, z.allgather_bucket_size, z.sub_group_size) == (500_000_000, 500_000_000, 1_000_000_000)
    assert (z.stage3_prefetch_bucket_size, z.stage3_param_persistence_threshold) == (50_000_000, 100_000)
    assert (c.fp16.initial_scale_power, c.fp16.loss_scale_window, c.fp16.hysteresis) == (16, 1000, 2)
    # DeepSpeed 0.19.8: STEPS_PER_PRINT_DEFAULT None, GRADIENT_CLIPPING_DEFAULT 1.0 (every key: test_config_defaults.py).
    assert (c.aio.block_size, c.aio.queue_depth, c.steps_per_print, c.gradient_clipping) == (1_048_576, 8, None, 1.0)
    assert c.precision == "fp32" and c.zero_stage == 0 and c.checkpoint.tag_validation == "Warn"


def test_steps_per_print_infinity_as_accelerate_writes_it_means_never():
    """Accelerate (and so the Trainer) sets `steps_per_print` to float("inf") to silence DeepSpeed,
    which accepts it; a DeepSpeed checkpoint's recorded ds_config carries it. In a dict it reads as
    null (no periodic line); any other non-finite number is refused (and JSON text's Infinity, as
    before: JSON has no such number)."""
    assert load_config(cfg(steps_per_print=float("inf"))).steps_per_print is None
    fails(cfg(steps_per_print=float("-inf")), "steps_per_print", "not a finite number")
    fails(cfg(gradient_clipping=float("inf")), "gradient_clipping", "not a finite number")
