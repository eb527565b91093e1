"""`fnzero.generate` (`specs/generation.md`): tokens equal to transformers' `generate()` on the
unsharded model, greedy and seeded sampling, at stage 3 on 2 and 4 ranks, tensor-parallel, with
parameters offloaded to the host and to NVMe; generation between training steps changes nothing;
each bad input is one clear error.

Tokens are compared exactly: float32 models, so a sharded forward's logits differ from the
unsharded one's only by the order of sums (~1e-7), which flips an argmax or a multinomial draw only
on a near-tie; the prompts are fixed, and the same cases pass on every run.
"""

from __future__ import annotations

import functools

import pytest
import torch
import transformers

import fnzero
from fnzero.testing import GPT, assert_trees_equal, count_collectives, run_world, seeded, simulated_world

transformers.logging.set_verbosity_error()

VOCAB, NEW = 61, 8
# Two rows, the first left-padded (pad 0), the second whole.
IDS = torch.tensor([[0, 0, 5, 9, 11, 3], [7, 8, 9, 10, 11, 12]])
MASK = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
SAMPLING = {"do_sample": True, "temperature": 0.7, "top_k": 10, "top_p": 0.9}


def build(kind: str) -> torch.nn.Module:
    """A small float32 causal LM of `kind`, the same weights on every call and rank."""
    t = transformers
    with seeded(0):
        if kind == "llama":  # RoPE, GQA; pad 0 in its config
            c = t.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                              bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.5)  # fmt: skip
            return t.LlamaForCausalLM(c).eval()
        if kind == "gpt2":  # learned positions, fused q|k|v Conv1D, tied head; no pad token
            c = t.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=2, n_head=4, resid_pdrop=0,
                             embd_pdrop=0, attn_pdrop=0, bos_token_id=1, eos_token_id=2, initializer_range=0.5)  # fmt: skip
            return t.GPT2LMHeadModel(c).eval()
        if kind == "qwen2":  # biased q/k/v projections
            c = t.Qwen2Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                              bos_token_id=1, eos_token_id=2, initializer_range=0.5)  # fmt: skip
            return t.Qwen2ForCausalLM(c).eval()
    raise ValueError(kind)


@functools.lru_cache(maxsize=None)
def reference(kind: str, use_cache: bool = True) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """transformers' greedy tokens with two end-of-sequence ids (one that the second row emits
    early, so it is padded after), and its tokens sampled under torch.manual_seed(3)."""
    model = build(kind)
    free = model.generate(IDS, attention_mask=MASK, max_new_tokens=NEW, do_sample=False, use_cache=use_cache)
    eos = [int(free[1, IDS.shape[1] + 1]), VOCAB - 1]
    greedy = model.generate(IDS, attention_mask=MASK, max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
                            use_cache=use_cache)  # fmt: skip
    torch.manual_seed(3)
    sampled = model.generate(IDS, attention_mask=MASK, max_new_tokens=NEW, use_cache=use_cache, **SAMPLING)
    return eos, greedy, sampled


def config(world: int, stage: int = 3, zero: dict | None = None, tp: int = 1) -> fnzero.Config:
    return fnzero.load_config({
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **(zero or {})},
        **({"tensor_parallel": {"autotp_size": tp}} if tp > 1 else {}),
    }, world_size=world)  # fmt: skip


# (model, ranks, tensor-parallel size, zero_optimization extras, use_cache); a string: the parameters on
# NVMe, the optimizer where it says.
CASES = [
    ("llama", 2, 1, None, True), ("gpt2", 4, 1, None, True), ("qwen2", 2, 1, None, False),
    ("llama", 4, 2, None, True), ("llama", 2, 1, {"offload_param": {"device": "cpu"}}, True),
    ("gpt2", 2, 1, "nvme", True), ("llama", 2, 1, "cpu", True),
]  # fmt: skip


@pytest.mark.parametrize("kind,world,tp,zero,use_cache", CASES, ids=lambda v: str(v))
def test_tokens_equal_transformers_generate(kind, world, tp, zero, use_cache, tmp_path):
    """Stage 3 on 2 and 4 ranks, dp2 x tp2 (heads and the KV cache split, the LM head split over
    the vocabulary), offload_param cpu and nvme, and a run without a cache: greedy tokens with
    end-of-sequence padding, and sampled tokens (temperature, top-k, top-p) from a generator
    seeded as transformers' global one, equal on every rank to transformers' `generate()`."""
    if isinstance(zero, str):
        nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
        zero = {"offload_param": nvme, "offload_optimizer": nvme if zero == "nvme" else {"device": zero}}
    eos, want_greedy, want_sampled = reference(kind, use_cache)
    cfg = config(world, zero=zero, tp=tp)

    def rank(comm):
        sm = fnzero.shard(build(kind), config=cfg, comm=comm)
        state = sm.init_state()
        greedy = fnzero.generate(sm, state, IDS, MASK, max_new_tokens=NEW, eos_token_id=eos, use_cache=use_cache)
        sampled = fnzero.generate(sm, state.params, IDS, MASK, max_new_tokens=NEW, use_cache=use_cache,
                                  generator=torch.Generator().manual_seed(3), **SAMPLING)  # fmt: skip
        return greedy, sampled, sm.tp is not None and sm.tp.vocab_head is not None

    for r, (greedy, sampled, vocab_split) in enumerate(simulated_world(world).run(rank)):
        assert torch.equal(greedy, want_greedy), f"rank {r}: {greedy} != {want_greedy}"
        assert torch.equal(sampled, want_sampled), f"rank {r}: {sampled} != {want_sampled}"
        assert vocab_split == (tp > 1)
    # The second row ended early and was padded: with the config's pad token, else the first eos.
    pad = build(kind).generation_config.pad_token_id
    assert (want_greedy[1, IDS.shape[1] + 2:] == (eos[0] if pad is None else pad)).all()


def test_zero_inference_with_parameters_on_nvme_generates_transformers_tokens(tmp_path):
    """`init_inference(..., zero={stage 3, offload_param nvme})` on 2 ranks, a Llama whose embedding
    is frozen (a frozen unit beside the trainable ones): every shard is a placeholder over the
    parameter store, and the greedy and sampled tokens are transformers' (`specs/inference.md`
    §ZeRO-Inference)."""
    from fnzero.sharding.zero._param_store import is_placeholder

    eos, want_greedy, want_sampled = reference("llama")
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0,
            "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}

    def rank():
        model = build("llama")
        model.model.embed_tokens.weight.requires_grad_(False)
        engine = fnzero.init_inference(model, dtype=torch.float32, zero=zero)
        plan, state = engine.sharded.plan, engine.state
        held = [state.params[u.name] for u in plan.units] + [state.frozen[u.name] for u in plan.frozen_units]
        greedy = engine.generate(IDS, MASK, max_new_tokens=NEW, eos_token_id=eos)
        sampled = engine.generate(IDS, MASK, max_new_tokens=NEW, generator=torch.Generator().manual_seed(3), **SAMPLING)
        return greedy, sampled, bool(plan.frozen_units) and all(is_placeholder(t) for t in held)

    for r, (greedy, sampled, placeholders) in enumerate(simulated_world(2).run(rank)):
        assert torch.equal(greedy, want_greedy), f"rank {r}: {greedy} != {want_greedy}"
        assert torch.equal(sampled, want_sampled), f"rank {r}: {sampled} != {want_sampled}"
        assert placeholders


@pytest.mark.parametrize("offload", [False, True], ids=["in-memory", "params-on-nvme"])
def test_generation_between_training_steps_leaves_the_trajectory_bit_identical(offload, tmp_path):
    """fnzero's GPT (no cache: the sequence is re-run per token) at stage 3 on 2 ranks: training
    with a generation after the first step ends in bit-identical parameters and losses, and the
    tokens equal a plain greedy loop on the gathered model. Also with the parameters on NVMe and the
    optimizer on the CPU: the tokens come from the shards the step wrote into their files."""
    nvme = {"offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}, "offload_optimizer": {"device": "cpu"}}
    cfg = config(2, zero=nvme if offload else None)
    data = torch.randint(0, 37, (3, 4, 8), generator=torch.Generator().manual_seed(1))
    prompt = data[0, :2, :4]

    def make():
        with seeded(0):
            return GPT(vocab_size=37, seq_len=16, d_model=16, n_layer=2, n_head=2)

    def rank(comm, with_generation):
        sm = fnzero.shard(make(), config=cfg, comm=comm)
        state = sm.init_state()
        step = fnzero.train_step(lambda p, b: sm.cross_entropy(sm.apply(p, b[:, :-1]), b[:, 1:]), cfg)
        losses, tokens, want = [], None, None
        for s in range(3):
            state, m = step(state, data[s, comm.rank:comm.rank + 1])
            losses.append(m["loss"])
            if with_generation and s == 0:
                tokens = fnzero.generate(sm, state, prompt, max_new_tokens=6)
                want = sm.load_into(make(), state)
        return sm.gather(state), losses, tokens, want

    plain = simulated_world(2).run(lambda comm: rank(comm, False))
    mixed = simulated_world(2).run(lambda comm: rank(comm, True))
    model = mixed[0][3]
    seq = prompt
    with torch.no_grad():
        for _ in range(6):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=-1)
    for (p0, l0, *_), (p1, l1, tokens, _) in zip(plain, mixed):
        assert_trees_equal(p1, p0, what="params after generating between steps")
        assert l1 == l0
        assert torch.equal(tokens, seq)


def test_bad_input_is_one_clear_error():
    """Each before any token is generated, and on every rank alike: params of another plan (before
    any collective), a prompt past the model's positions, a mask of another shape, right padding,
    a setting fnzero does not implement, a bad temperature, and ranks given different prompts."""
    cfg = config(2)

    def rank(comm):
        sm = fnzero.shard(build("llama"), config=cfg, comm=comm)
        state = sm.init_state()
        other = fnzero.shard(build("llama"), config=config(2, stage=0), comm=comm).init_state()
        with count_collectives(sm) as c, pytest.raises(fnzero.ShardingError, match="do not fit this plan"):
            fnzero.generate(sm, other, IDS)
        assert c.calls() == 0
        bad = [
            (fnzero.ShardingError, "max_position_embeddings", dict(max_new_tokens=27)),
            (fnzero.ShardingError, r"attention_mask must have input_ids' shape \(2, 6\)", dict(attention_mask=MASK[:, 1:])),
            (fnzero.ShardingError, "right padding", dict(attention_mask=MASK.flip(-1))),
            (fnzero.ConfigError, "num_beams=2", dict(generation_config={"num_beams": 2})),
            (fnzero.ConfigError, "temperature", dict(do_sample=True, temperature=0.0)),
        ]
        for kind, match, kw in bad:
            with pytest.raises(kind, match=match):
                fnzero.generate(sm, state, IDS, **{"max_new_tokens": 4, **kw})
        with pytest.raises(fnzero.ShardingError, match=r"ranks \[1\]"):
            fnzero.generate(sm, state, IDS + comm.rank, max_new_tokens=4)
        return True

    assert all(simulated_world(2).run(rank))


def _generate_on_a_gloo_rank() -> tuple[torch.Tensor, torch.Tensor]:
    import torch.distributed as dist

    cfg = config(dist.get_world_size(), tp=2)
    sm = fnzero.shard(build("llama"), config=cfg)
    state = sm.init_state()
    eos, _, _ = reference("llama")
    greedy = fnzero.generate(sm, state, IDS, MASK, max_new_tokens=NEW, eos_token_id=eos)
    torch.manual_seed(3)  # each process' own generator: rank 0's draws the tokens
    return greedy, fnzero.generate(sm, state, IDS, MASK, max_new_tokens=NEW, **SAMPLING)


@pytest.mark.multiprocess
def test_tensor_parallel_stage_3_on_gloo_ranks():
    """dp2 x tp2 at stage 3 on four processes: the sub-group collectives of real ranks, and
    sampling from torch's global generator seeded as transformers' run."""
    _, want_greedy, want_sampled = reference("llama")
    for r, (greedy, sampled) in enumerate(run_world(_generate_on_a_gloo_rank, 4, timeout=240)):
        assert torch.equal(greedy, want_greedy), f"rank {r}"
        assert torch.equal(sampled, want_sampled), f"rank {r}"
