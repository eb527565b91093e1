"""AutoEP (specs/mesh.md §Expert parallelism): Hugging Face MoE models with their experts modules
replaced by `HFExpertGroup` and split over simulated expert-parallel worlds compute what the
unsplit Hugging Face model computes, batch by batch.

Each rank runs the same model on its own batch. Its logits and its dense parameters' gradients
are the unsplit model's on that batch; its slice of each layer's experts holds the gradient the
unsplit model gives those experts summed over every rank's batch (the all-to-all brings every
rank's tokens to the experts' rank). float64 throughout; the routers' float32 parts (softmax,
DeepSeek's gate) run on the same inputs in both, so 1e-12 of the largest value holds."""

from __future__ import annotations

import copy
import doctest
import types

import pytest
import torch
import torch.nn.functional as F
from transformers import (DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig,
                          LlamaForCausalLM, MixtralConfig, MixtralForCausalLM, OlmoeConfig, OlmoeForCausalLM,
                          Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig,
                          Qwen3MoeConfig, Qwen3MoeForCausalLM)

from fnzero._errors import ConfigError
from fnzero.sharding.comm._observed import RecordingCollectives
from fnzero.sharding.ep import _autoep
from fnzero.sharding.ep import AUTOEP_PRESETS, ExpertGroup, HFExpertGroup, autoep_replace, resolve_autoep_preset
from fnzero.testing import seeded, simulated_world
from test_autoep_layouts import tiny_model

VOCAB, SEQ, TOL = 64, 8, 1e-12
_COMMON = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
               num_experts_per_tok=2, max_position_embeddings=32, attn_implementation="eager")
FAMILIES = {
    # Two key/value heads: tests/test_moe_hf.py splits its attention over 2 tensor-parallel ranks.
    "mixtral": lambda: MixtralForCausalLM(MixtralConfig(**{**_COMMON, "num_key_value_heads": 2}, intermediate_size=8,
                                                        num_local_experts=4, output_router_logits=True,
                                                        router_aux_loss_coef=0.1)),
    "qwen3_moe": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(
        **_COMMON, head_dim=8, intermediate_size=16, moe_intermediate_size=8, num_experts=4, norm_topk_prob=True,
        output_router_logits=True)),
    "qwen2_moe": lambda: Qwen2MoeForCausalLM(Qwen2MoeConfig(
        **_COMMON, intermediate_size=16, moe_intermediate_size=8, shared_expert_intermediate_size=8, num_experts=4,
        output_router_logits=True)),
    "olmoe": lambda: OlmoeForCausalLM(OlmoeConfig(**_COMMON, intermediate_size=8, num_experts=4, eos_token_id=2,
                                                  output_router_logits=True)),
    "qwen3_5_moe": lambda: Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(
        **_COMMON, head_dim=8, moe_intermediate_size=8, shared_expert_intermediate_size=8, num_experts=4,
        linear_num_value_heads=2, linear_num_key_heads=1, linear_key_head_dim=8, linear_value_head_dim=8,
        layer_types=["linear_attention", "full_attention"], use_cache=False)),
    "deepseek_v2": lambda: DeepseekV2ForCausalLM(DeepseekV2Config(
        **{**_COMMON, "num_key_value_heads": 2}, intermediate_size=16, moe_intermediate_size=8, n_routed_experts=4,
        n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=8, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=4, topk_method="group_limited_greedy", n_group=2, topk_group=1)),
    # Grouped sigmoid routing (2 groups, 1 kept), a shared expert, and a dense first layer the
    # preset's pattern matches but which has no experts.
    "deepseek_v3": lambda: DeepseekV3ForCausalLM(DeepseekV3Config(
        **{**_COMMON, "num_key_value_heads": 2}, intermediate_size=16, moe_intermediate_size=8, n_routed_experts=4,
        n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
        q_lora_rank=8, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4)),
}


def _model(family: str):
    with seeded(0):
        model = FAMILIES[family]().to(torch.float64)
        for name, m in model.named_modules():
            if name.endswith("mlp.gate"):  # routers wide enough that each token picks its own experts
                m.weight.data.normal_(0.0, 1.0)
            if hasattr(m, "e_score_correction_bias"):  # DeepSeek's selection bias: nonzero, used in the grouping
                m.e_score_correction_bias.uniform_(-0.1, 0.1)
    model.set_experts_implementation("eager")
    return model


def _batch(r: int):
    g = torch.Generator().manual_seed(100 + r)
    return torch.randint(VOCAB, (2, SEQ), generator=g), torch.randint(VOCAB, (2, SEQ), generator=g)


def _loss_and_grads(model, r: int):
    """Logits and each parameter's gradient (None kept) of a float64 loss on batch r."""
    ids, labels = _batch(r)
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids)
    loss = F.cross_entropy(out.logits.flatten(0, 1), labels.flatten())
    if getattr(out, "aux_loss", None) is not None:  # the router's aux loss: the model's own, kept
        loss = loss + 0.1 * out.aux_loss
    loss.backward()
    return out.logits.detach(), {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _close(got, want, what):
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= TOL * max(scale, 1e-300), f"{what}: error {err:.3e} against a largest value {scale:.3e}"


@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_split_experts_equal_the_unsplit_model(family, ep):
    reference = _model(family)
    copies = [copy.deepcopy(reference) for _ in range(ep)]
    want = [_loss_and_grads(reference, r) for r in range(ep)]

    def rank(comm):
        model = copies[comm.rank]
        paths = autoep_replace(model)
        for path in paths:
            model.get_submodule(path).split_experts(comm, where=path)
        held = {path: (model.get_submodule(path).expert_lo, model.get_submodule(path).expert_hi) for path in paths}
        return (*_loss_and_grads(model, comm.rank), held)

    for r, (logits, grads, held) in enumerate(simulated_world(ep).run(rank)):
        assert len(held) == (1 if family.startswith("deepseek") else 2)  # DeepSeek's first layer is dense
        _close(logits, want[r][0], f"rank {r} logits")
        for name, g in grads.items():
            path, _, leaf = name.rpartition(".")
            if path in held:  # this rank's experts: every rank's tokens reached them
                lo, hi = held[path]
                assert hi - lo == 4 // ep and g.shape[0] == hi - lo
                _close(g, sum(w[1][name] for w in want)[lo:hi], f"rank {r} {name}")
            elif want[r][1][name] is None:
                assert g is None, name
            else:
                _close(g, want[r][1][name], f"rank {r} {name}")


def test_replacing_assigns_no_class(monkeypatch):
    """The replacement is made as the class it is (HFExpertGroup and the source's experts class);
    no module's `__class__` is assigned afterwards."""
    model = _model("qwen2_moe")
    assigned = []
    setattr_ = torch.nn.Module.__setattr__

    def spy(self, name, value):
        if name == "__class__":
            assigned.append(f"{type(self).__name__} -> {value.__name__}")
        setattr_(self, name, value)

    monkeypatch.setattr(torch.nn.Module, "__setattr__", spy)
    paths = autoep_replace(model)
    assert assigned == [] and len(paths) == 2


def test_replacing_keeps_names_shapes_dtypes_values_and_the_result():
    reference = _model("qwen2_moe")
    model = copy.deepcopy(reference)
    source_class = type(model.model.layers[0].mlp.experts)
    before = {k: (v.shape, v.dtype, v.data_ptr()) for k, v in model.state_dict().items()}
    paths = autoep_replace(model)
    assert paths == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert {k: (v.shape, v.dtype, v.data_ptr()) for k, v in model.state_dict().items()} == before
    experts = model.get_submodule(paths[0])
    # Hugging Face's _init_weights (and fnzero's meta construction through it) still recognises it.
    assert isinstance(experts, HFExpertGroup) and isinstance(experts, source_class)
    assert isinstance(experts, ExpertGroup) and experts.ep_comm is None
    _close(_loss_and_grads(model, 0)[0], _loss_and_grads(reference, 0)[0], "unsplit logits")
    with pytest.raises(ConfigError, match="already"):
        autoep_replace(model)

    def split_names(comm):
        m = copy.deepcopy(model)
        for path in paths:
            m.get_submodule(path).split_experts(comm)
        return {k: tuple(v.shape) for k, v in m.state_dict().items()}

    shapes = simulated_world(2).run(split_names)[1]
    assert shapes.keys() == before.keys()  # the names every rank holds are the whole model's
    assert shapes[paths[0] + ".gate_up_proj"] == (2, 16, 16) and shapes[paths[0] + ".down_proj"] == (2, 16, 8)


def test_presets_follow_deepspeeds_names_and_patterns():
    assert {"mixtral", "qwen3_moe", "qwen3_5_moe", "deepseek_v2", "deepseek_v3", "minimax_m3"} <= set(AUTOEP_PRESETS)
    assert {n for n, p in AUTOEP_PRESETS.items() if p.origin == "fnzero"} == {"qwen2_moe", "olmoe"}
    model = _model("mixtral")
    # A preset named explicitly, and patterns that override it (DeepSpeed's semantics).
    assert autoep_replace(copy.deepcopy(model), preset_model="qwen3_moe") == [
        "model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert autoep_replace(copy.deepcopy(model), moe_layer_pattern=r"model\.layers\.1\.mlp") == [
        "model.layers.1.mlp.experts"]
    # No preset and no moe_layer_pattern: the blocks are found by layout, and given child names must match.
    granite = tiny_model("granitemoe")
    want = ["model.layers.0.block_sparse_moe.experts", "model.layers.1.block_sparse_moe.experts"]
    assert autoep_replace(copy.deepcopy(granite), router_pattern="router", expert_pattern="experts") == want
    with pytest.raises(ConfigError, match=r"\['model.layers.0.block_sparse_moe.experts', .* hold stacked experts, but "
                                          r"no module beside them routes to them .*, named 'gate'"):
        autoep_replace(copy.deepcopy(granite), router_pattern="gate")
    with pytest.raises(ConfigError, match="model_type 'granitemoe' has no AutoEP preset, and no module"):
        autoep_replace(copy.deepcopy(granite), expert_pattern="routed_experts")
    # DeepSpeed's minimax_m3: its clamped SwiGLU is the experts' own _apply_gate, which AutoEP runs.
    minimax_m3 = tiny_model("minimax_m3_vl")
    assert resolve_autoep_preset(minimax_m3) == AUTOEP_PRESETS["minimax_m3"]
    assert autoep_replace(minimax_m3) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    result = doctest.testmod(_autoep)  # autoep_replace's example
    assert result.attempted and not result.failed


def _llama():
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=8, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1))


def test_bad_presets_patterns_and_splits_are_config_errors_naming_them():
    mixtral = _model("mixtral")
    with pytest.raises(ConfigError, match="unknown preset_model 'mixtrall'.*known presets"):
        autoep_replace(mixtral, preset_model="mixtrall")
    with pytest.raises(ConfigError, match="model_type 'llama' has no AutoEP preset, and no module of the model holds "
                                          "transformers 5's stacked experts.*known presets"):
        autoep_replace(_llama())
    for composite, text in (("qwen3_5_moe", "qwen3_5_moe_text"), ("minimax_m3_vl", "minimax_m3_vl_text")):
        with pytest.raises(ConfigError, match=f"model_type '{composite}' has no AutoEP preset.*'{text}'"):
            autoep_replace(types.SimpleNamespace(config=types.SimpleNamespace(model_type=composite)))
    with pytest.raises(ConfigError, match=r"moe_layer_pattern 'model\\\\.blocks\\\\.\\\\d\+' matches no MoE block"):
        autoep_replace(mixtral, moe_layer_pattern=r"model\.blocks\.\d+")
    with pytest.raises(ConfigError, match="matches no MoE block"):  # the pattern matches dense MLPs only
        autoep_replace(_llama(), moe_layer_pattern=r"model\.layers\.\d+\.mlp")
    with pytest.raises(ConfigError, match="expert_pattern='mlp.experts'.*no dots"):
        autoep_replace(mixtral, expert_pattern="mlp.experts")
    experts = mixtral.model.layers[1].mlp.experts
    experts.has_bias = True  # says it has biases, holds none: refused, the model untouched
    with pytest.raises(ConfigError, match=r"model\.layers\.1\.mlp\.experts: MixtralExperts holds \['down_proj', "
                                          r"'gate_up_proj'\], not the stacked experts .*has_bias=True"):
        autoep_replace(mixtral)
    assert not isinstance(mixtral.model.layers[0].mlp.experts, HFExpertGroup)
    experts.has_bias = False
    experts.norm = torch.nn.LayerNorm(16, dtype=torch.float64)  # a weight every expert shares: not split
    with pytest.raises(ConfigError, match=r"holds \['norm.weight', 'norm.bias'\], shared by all its experts"):
        autoep_replace(mixtral)
    del experts.norm
    experts.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj.detach()[:, :15])  # [4, 15, 16]: no gate and up
    with pytest.raises(ConfigError, match=r"stacked weights \[4, 15, 16\] and \[4, 16, 8\] are not \[E, 2I, H\]"):
        autoep_replace(mixtral)
    mixtral = _model("mixtral")
    paths = autoep_replace(mixtral)
    with pytest.raises(ConfigError, match="4 experts do not divide over 3 expert-parallel ranks"):
        mixtral.get_submodule(paths[0]).split_experts(types.SimpleNamespace(world_size=3, rank=0), where=paths[0])


def test_each_moe_layer_sends_its_rows_out_and_back_once_each_way():
    """The all-to-all bytes of specs/mesh.md §Expert parallelism, per rank and layer: one exchange
    of E int64 counts, then forward and backward each send (rows leaving for other ranks' experts +
    rows returning to other ranks) x hidden x dtype size."""
    ep, hidden, experts = 2, 16, 4
    model = _model("mixtral")
    copies = [copy.deepcopy(model) for _ in range(ep)]

    def rank(comm):
        m, chosen = copies[comm.rank], []
        for path in autoep_replace(m):
            m.get_submodule(path).split_experts(comm)
            m.get_submodule(path).register_forward_pre_hook(lambda _, args: chosen.append(args[1].flatten()))
        _loss_and_grads(m, comm.rank)
        return [(rec.dtype, rec.bytes) for rec in comm.records], chosen

    out = simulated_world(ep, wrap_comm=RecordingCollectives).run(rank)
    for r, (records, chosen) in enumerate(out):
        assert [d for d, _ in records] == [torch.int64, torch.float64, torch.float64] * 2 + [torch.float64] * 4
        counts_bytes = (experts - experts // ep) * 8
        rows = 0
        for layer in range(2):
            mine = lambda ids: ((ids // (experts // ep)) == r).sum().item()  # noqa: E731 rows for rank r's experts
            leaving = chosen[layer].numel() - mine(chosen[layer])
            returning = sum(mine(out[s][1][layer]) for s in range(ep) if s != r)
            rows += leaving + returning
        assert sum(b for d, b in records if d == torch.int64) == 2 * counts_bytes
        assert sum(b for d, b in records if d == torch.float64) == 2 * rows * hidden * 8  # forward + backward


def test_every_deepspeed_autoep_key_is_read_or_said_to_have_no_effect():
    deepspeed_keys = {"enabled", "autoep_size", "expert_tensor_parallel_size", "validate_folding_routing",
                      "async_split_plan", "preset_model", "moe_layer_pattern", "expert_pattern", "router_pattern",
                      "use_grouped_mm", "disable_triton_grouped_mm", "route_norm", "route_scale", "score_apply",
                      "combine_impl", "row_weighting_impl", "gate_up_impl", "comm_backend", "comm_num_sm",
                      "comm_qp_margin", "comm_max_tokens_per_rank", "num_expert_groups", "num_limited_groups",
                      "score_func", "top_k", "load_balance_coeff", "routed_scaling_factor", "expert_w1", "expert_w2",
                      "expert_w3", "num_experts_attr", "top_k_attr", "has_shared_experts", "shared_experts_pattern",
                      "shared_experts_gate_pattern", "expert_activation"}  # parse_autoep_config's keys
    mesh_keys = {"enabled", "autoep_size", "expert_tensor_parallel_size"}
    assert not set(_autoep.AUTOEP_KEYS_READ) & set(_autoep.AUTOEP_KEYS_NO_EFFECT)
    assert set(_autoep.AUTOEP_KEYS_READ) | set(_autoep.AUTOEP_KEYS_NO_EFFECT) | mesh_keys == deepspeed_keys
