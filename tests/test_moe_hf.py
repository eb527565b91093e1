"""Hugging Face MoE models train under `fnzero.shard` with their experts split over expert-parallel
ranks (AutoEP, `specs/mesh.md §Expert parallelism`) as in plain PyTorch.

The model's own router, shared experts and router aux loss are kept; only where each expert runs
changes. Routing is per forward (the aux loss is a batch statistic), so the reference runs each
(dp rank, micro-batch) chunk as its own forward, weighted as DDP weighs it, with torch's AdamW and
clip_grad_norm_. float64 at 1e-9 (the routers' float32 softmax sees inputs equal to ~1e-16 in both
runs; measured over three steps: 2.5e-12 relative at worst).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

import fnzero
from fnzero.sharding import TPRule
from fnzero.testing import seeded, simulated_world
from test_autoep import FAMILIES, _model
from test_autoep_layouts import tiny_model

VOCAB, SEQ, ACCUM, LR, CLIP, STEPS = 64, 8, 2, 1e-2, 0.5, 2


_SMALL = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
              max_position_embeddings=32)
# MoE models no preset names: AutoEP finds their blocks by their layout (stacked experts beside a
# router), whatever the blocks and routers are called, with no warning.
UNNAMED = {
    "glm4_moe": lambda: transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(
        **_SMALL, intermediate_size=16, moe_intermediate_size=8, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, head_dim=8)),
    "ernie4_5_moe": lambda: transformers.Ernie4_5_MoeForCausalLM(transformers.Ernie4_5_MoeConfig(
        **_SMALL, intermediate_size=16, moe_intermediate_size=8, moe_num_experts=4, moe_k=2, moe_layer_start_index=0)),
    "hunyuan_v1_moe": lambda: transformers.HunYuanMoEV1ForCausalLM(transformers.HunYuanMoEV1Config(
        **_SMALL, intermediate_size=8, num_experts=4, moe_topk=2, head_dim=8)),
    "minimax": lambda: transformers.MiniMaxForCausalLM(transformers.MiniMaxConfig(
        **_SMALL, intermediate_size=8, num_local_experts=4, num_experts_per_tok=2, head_dim=8,
        layer_types=["full_attention", "full_attention"])),
}


# Built as tests/test_autoep_layouts.py builds them (tiny, float64), in training mode but PhiMoE,
# whose router samples its experts in training from the process's one generator, which the ranks
# (threads) would draw from in turn: in eval mode it routes as the plain model does.
BY_LAYOUT = ("phimoe", "granitemoe", "qwen3_next", "dots1", "gpt_oss", "llama4")


def _build(family: str):
    if family not in UNNAMED and family not in BY_LAYOUT:
        return _model(family)
    with seeded(0):
        if family in UNNAMED:
            model = UNNAMED[family]().to(torch.float64)
        else:  # one dtype for fnzero.shard: dots1's router weight is made float32
            model = tiny_model(family).to(torch.float64).train(family != "phimoe")
        for name, m in model.named_modules():
            if name.endswith(("mlp.gate", ".router")) and getattr(m, "weight", None) is not None:
                m.weight.data.normal_(0.0, 1.0)  # routers wide enough that tokens pick different experts
    model.set_experts_implementation("eager")
    return model


def _chunk(step: int, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + i)
    return torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)


def _loss(out, chunk):
    loss = F.cross_entropy(out.logits.flatten(0, 1), chunk[:, 1:].flatten())
    return loss + 0.1 * out.aux_loss if getattr(out, "aux_loss", None) is not None else loss


def _reference(family: str, world: int) -> dict[str, torch.Tensor]:
    model = _build(family)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for s in range(STEPS):
        opt.zero_grad()
        for i in range(world * ACCUM):
            chunk = _chunk(s, i)
            (_loss(model(input_ids=chunk[:, :-1]), chunk) / (world * ACCUM)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _config(stage: int, world: int, ep: int, **more):
    return fnzero.load_config({
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": ACCUM, "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "expert_parallel": {"enabled": True, "autoep_size": ep}, **more,
    }, world_size=world)


# Tensor parallelism on attention only (Mixtral has no built-in AutoTP plan: its MLP is the MoE block).
ATTENTION_TP = [TPRule(r".*self_attn\.(q|k|v)_proj", "column"), TPRule(r".*self_attn\.o_proj", "row")]


def _sharded(family: str, stage: int, world: int, ep: int, tp: int = 1) -> list[dict[str, torch.Tensor]]:

    return simulated_world(world).run(lambda comm: train_on_rank(comm, family, stage, ep, tp))


def train_on_rank(comm, family: str, stage: int, ep: int, tp: int = 1) -> dict[str, torch.Tensor]:
    """This rank's run (simulated or spawned): the consolidated parameters after STEPS steps."""
    world = comm.world_size
    cfg = _config(stage, world, ep, **({"tensor_parallel": {"autotp_size": tp}} if tp > 1 else {}))
    sm = fnzero.shard(_build(family), config=cfg, comm=comm, tp_plan=ATTENTION_TP if tp > 1 else None)
    assert (sm.ep is not None, sm.tp is not None) == (ep > 1, tp > 1) and (ep == 1 or sm.ep.stacked)
    state = sm.init_state()
    step = fnzero.train_step(lambda p, chunk: _loss(sm.apply(p, input_ids=chunk[:, :-1]), chunk), cfg)
    d = comm.rank // tp  # the tp ranks of a group take the same chunks
    for s in range(STEPS):
        state, _ = step(state, [_chunk(s, d * ACCUM + i) for i in range(ACCUM)])
    return sm.gather(state)


def _assert_close(results, want):
    """Every trainable parameter (`gather` also names a tied head under its own name)."""
    for got in results:
        assert set(want) <= set(got) and len(got) <= len(want) + 1
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.parametrize("family, stage, world, ep", [
    ("mixtral", 3, 2, 2), ("mixtral", 1, 4, 2), ("qwen3_moe", 3, 2, 1), ("qwen3_moe", 2, 4, 4), ("deepseek_v3", 3, 4, 2),
    ("qwen2_moe", 0, 2, 2), ("olmoe", 3, 4, 4), ("deepseek_v2", 1, 2, 2), ("qwen3_5_moe", 3, 2, 2),
])
def test_hugging_face_moe_trains_as_plain_torch(family, stage, world, ep):
    _assert_close(_sharded(family, stage, world, ep), _reference(family, world))


@pytest.mark.parametrize("stage", [1, 3])
def test_hugging_face_moe_with_tensor_parallel_attention(stage):
    """Mixtral at tp 2 x dp 2, ep 2: attention heads split over tp, experts over the ep ranks."""
    _assert_close(_sharded("mixtral", stage, 4, ep=2, tp=2), _reference("mixtral", 2))


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3", "gpt_oss"])  # gpt-oss: stacked biases too
def test_meta_construction_initialises_each_ranks_experts_as_the_unsplit_model(family):
    """Built on the meta device, each rank initialises its rows of the stacked expert tensors as the
    whole tensor's (initialised whole, then cut, as tensor-parallel slices are): the consolidated
    weights are the bits of the model built at ep 1, at ep 2 and 4."""

    def run(world: int, ep: int):
        cfg = _config(3, world, ep) if ep > 1 else _config(3, world, 1)

        def rank(comm):
            with torch.device("meta"):
                model = (FAMILIES[family]() if family in FAMILIES else tiny_model(family)).to(torch.float64)
            sm = fnzero.shard(model, config=cfg, comm=comm, init_seed=3)
            return sm.gather(sm.init_state())

        return simulated_world(world).run(rank)

    (want,) = run(1, 1)
    assert all(not t.isnan().any() for t in want.values())
    for world, ep in [(2, 2), (4, 4)]:
        for got in run(world, ep):
            assert got.keys() == want.keys()
            assert [n for n in want if not torch.equal(got[n], want[n])] == [], (world, ep)


@pytest.mark.parametrize("family, stage, world, ep", [
    ("glm4_moe", 3, 2, 2), ("ernie4_5_moe", 1, 4, 2), ("hunyuan_v1_moe", 2, 2, 2), ("minimax", 3, 4, 4),
    ("phimoe", 1, 2, 2), ("granitemoe", 3, 2, 2), ("qwen3_next", 2, 2, 2), ("dots1", 0, 2, 2), ("gpt_oss", 3, 2, 2),
    ("llama4", 1, 2, 2),
])
def test_moe_models_without_a_preset_train_as_plain_torch(family, stage, world, ep):
    """Found by their layout (warnings are errors here): GraniteMoE's `block_sparse_moe.router`, PhiMoE's
    `router`, Llama 4's `feed_forward` with experts every token meets (its own call), gpt-oss's experts
    with biases and their own gate, Qwen3-Next and dots1."""
    _assert_close(_sharded(family, stage, world, ep), _reference(family, world))


@pytest.mark.parametrize("stage", [0, 1])
def test_hugging_face_moe_in_pipeline_stages(stage):
    """Mixtral cut by `hf_causal_lm` into pp 2 stages (its loss the model's causal-LM loss, no router
    aux loss: that is gathered across layers, which a stage does not see), dp 2 per stage, ep 2:
    each stage's MoE blocks' experts split over its dp ranks. Equal to plain torch, 1F1B."""
    from fnzero.pipeline import causal_lm_loss, hf_causal_lm

    def build():
        model = _build("mixtral")
        model.config.output_router_logits = False
        return model

    cfg = _config(stage, 4, 2, pipeline={"stages": 2})

    def rank(comm):
        sm = fnzero.shard(hf_causal_lm(build(), num_stages=2), config=cfg, comm=comm)
        assert sm.ep is not None and sm.ep.size == 2 and len(sm.ep.modules) == 1  # one MoE block per stage
        state = sm.init_state()
        step = fnzero.train_step(fnzero.pipeline_loss(sm, "1f1b"), cfg)
        dp_rank = comm.rank % 2  # rank = stage * 2 + dp rank
        for s in range(STEPS):
            ids = torch.cat([_chunk(s, dp_rank * ACCUM + i) for i in range(ACCUM)])[:, :-1]
            state, _ = step(state, (ids, ids))
        return sm.gather(state)

    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for s in range(STEPS):
        opt.zero_grad()
        for i in range(2 * ACCUM):
            ids = _chunk(s, i)[:, :-1]
            (causal_lm_loss(model(input_ids=ids).logits, ids) / (2 * ACCUM)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    want = {n: p.detach() for n, p in model.named_parameters()}
    for got in simulated_world(4).run(rank):
        assert got and set(got) <= set(want)
        for name in got:
            torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-12, msg=name)
