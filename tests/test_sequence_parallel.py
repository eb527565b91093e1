"""Sequence parallelism (Ulysses, `specs/mesh.md` §Sequence): sp x dp meshes at ZeRO stages 0-3
equal plain single-process torch on the whole sequence in float64 (2 steps, AdamW, accumulation 2,
clipping), on fnzero's GPT and on transformers' Llama, Qwen2, Mistral (sliding window), Gemma and
GPT-NeoX, with grouped-query attention replicated when the kv heads are fewer than sp, padding,
packed documents and gradient checkpointing; the attention core and exchange against torch's SDPA
for drawn shapes; offload and checkpoints at sp (real gloo ranks and jit: test_zero_multiprocess.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import _sp_models as M
import _worlds as W
import fnzero
from fnzero.sharding import SPLayout
from fnzero.sharding.sp._attention import sequence_attention
from fnzero.testing import GPT, seeded, simulated_world

RTOL = 1e-9


@pytest.mark.parametrize("world,sp,stage,mesh", [(2, 2, 0, False), (4, 4, 3, True), (4, 2, 1, False), (4, 2, 3, True)],
                         ids=lambda v: str(v))
def test_gpt_at_sp_equals_the_unsharded_step(world, sp, stage, mesh):
    """The config's sequence_parallel_size or make_mesh(sp=) alike: every rank's parameters and loss
    are plain torch's on the whole sequence."""
    ref = W.train_reference("gpt_tp", 2, world // sp, k=2, clip=0.5)
    for params, losses in M.run_gpt(world, sp, stage, mesh=mesh):
        W.assert_close_tree(params, ref["params"], rtol=RTOL, atol=1e-12, what=f"gpt w{world} sp{sp} z{stage}")
        assert losses == pytest.approx(ref["losses"], rel=RTOL)


@pytest.mark.parametrize("kind,world,sp,stage,kv", [
    ("llama", 2, 2, 0, 2), ("llama", 4, 4, 3, 2), ("qwen2", 4, 4, 2, 1), ("qwen2", 2, 2, 3, 2),
    ("mistral", 2, 2, 1, 2), ("gemma", 2, 2, 2, 1), ("neox", 4, 4, 0, 4),
], ids=lambda v: str(v))
def test_transformers_models_at_sp_equal_the_unsharded_step(kind, world, sp, stage, kv):
    """Grouped-query attention with kv heads dividing sp or replicated up to it (kv 1 and 2 at sp 4),
    Mistral's sliding window (5 of 16 tokens), a right-padded row: the model's own `labels=` loss,
    made each rank's share, equals the whole sequence's. Gemma's RMSNorm multiplies by its weight in
    float32, so that weight's gradient is a float32 sum over the tokens, split differently at sp:
    float32-level agreement there (every other model's is float64)."""
    rtol, atol = (1e-5, 1e-8) if kind == "gemma" else (RTOL, 1e-12)
    ref, ref_losses = M.reference(kind, 2, 2, world // sp, 2, kv)
    for params, losses in M.run_hf(kind, world, sp, stage, kv=kv):
        W.assert_close_tree(params, ref, rtol=rtol, atol=atol, what=f"{kind} w{world} sp{sp} z{stage}")
        assert losses == pytest.approx(ref_losses, rel=rtol)


@pytest.mark.parametrize("kind,world,sp,stage,heads,kv,length", [
    ("llama", 3, 3, 1, 4, 2, 18), ("qwen2", 4, 4, 3, 6, 2, 16), ("mistral", 2, 2, 2, 3, 1, 16),
], ids=lambda v: str(v))
def test_heads_that_sp_does_not_divide_run_ring_attention(kind, world, sp, stage, heads, kv, length):
    """4 heads at sp 3 (a ring of 3), 6 heads at sp 4 (Ulysses groups of 2, rings of 2), 3 heads at
    sp 2 with Mistral's window: the whole sequence's step, with a right-padded row."""
    ref, ref_losses = M.reference(kind, 2, 2, world // sp, 2, kv, heads=heads, length=length)
    for params, losses in M.run_hf(kind, world, sp, stage, kv=kv, heads=heads, length=length):
        W.assert_close_tree(params, ref, rtol=RTOL, atol=1e-12, what=f"{kind} {heads} heads sp{sp} z{stage}")
        assert losses == pytest.approx(ref_losses, rel=RTOL)


@pytest.mark.parametrize("stage,vocab", [(1, True), (3, None)], ids=lambda v: str(v))
def test_sp_x_tp(stage, vocab):
    """sp 2 x tp 2: each tensor-parallel group holds one run of the tokens for its heads (2 heads and
    1 kv head per rank, repeated for Ulysses); with a vocabulary-split head the loss share is the
    vocabulary-parallel cross-entropy's sum."""
    ref, ref_losses = M.reference("llama", 2, 2, 1, 2)
    tp = {"tensor_parallel": {"autotp_size": 2, "vocab_parallel_lm_head": vocab}}
    for params, losses in M.run_hf("llama", 4, 2, stage, extra=tp):
        W.assert_close_tree(params, ref, rtol=RTOL, atol=1e-12, what=f"llama sp2 tp2 z{stage}")
        assert losses == pytest.approx(ref_losses, rel=RTOL)


def test_sp_x_ep_on_mixtral():
    """sp 2 x ep 2 (world 4, dp 4: the expert groups are the sequence groups): each rank routes its
    run of the tokens to its experts (dropless, as transformers' MoE), at ZeRO-2."""
    ref, ref_losses = M.reference("mixtral", 2, 2, 2, 2)
    ep = {"expert_parallel": {"enabled": True, "autoep_size": 2}}
    for params, losses in M.run_hf("mixtral", 4, 2, 2, extra=ep):
        W.assert_close_tree(params, ref, rtol=RTOL, atol=1e-12, what="mixtral sp2 ep2 z2")
        assert losses == pytest.approx(ref_losses, rel=RTOL)


def test_sp_x_dp_at_zero3_with_gradient_checkpointing_and_left_padding():
    """sp 2 x dp 2 at ZeRO-3, transformers' gradient checkpointing recomputing each layer's exchange
    in backward, and a left-padded row (queries with no key to attend to, as transformers' mask)."""
    ref, ref_losses = M.reference("llama", 2, 2, 2, 2, padding="left")
    for params, losses in M.run_hf("llama", 4, 2, 3, padding="left", checkpointing=True):
        W.assert_close_tree(params, ref, rtol=RTOL, atol=1e-12, what="llama sp2 dp2 z3 checkpointed")
        assert losses == pytest.approx(ref_losses, rel=RTOL)


def test_packed_documents_attend_within_their_own():
    """Position ids that restart mark packed documents, kept apart as transformers keeps them
    without a mask and a cache (`use_cache=False`, as in training): logits at sp 2 equal the whole
    sequence's, which differ from the same positions in one document."""
    model = M.hf_model("llama")
    ids = torch.randint(1, M.V, (2, M.S), generator=torch.Generator().manual_seed(5))
    pos = torch.cat([torch.arange(6), torch.arange(M.S - 6)]).expand(2, -1)
    whole = model(input_ids=ids, position_ids=pos, use_cache=False).logits.detach()
    assert not torch.allclose(whole, model(input_ids=ids, position_ids=pos).logits)  # with a cache: one document

    def rank(comm):
        sm = fnzero.shard(M.hf_model("llama"), config=M.sp_config(0, 2, 2, k=1), comm=comm)
        batch = fnzero.shard_sequence({"input_ids": ids, "position_ids": pos}, sm.sp)
        return sm.apply(sm.init_state().params, **batch).logits

    for r, logits in enumerate(simulated_world(2).run(rank)):
        torch.testing.assert_close(logits, whole[:, r * 8:(r + 1) * 8], rtol=1e-12, atol=1e-12)


@settings(max_examples=24, deadline=None, derandomize=True)
@given(sp=st.sampled_from([2, 3, 4, 6]), heads=st.sampled_from([1, 2, 3, 4, 6, 8]), group=st.sampled_from([1, 2, 3]),
       per=st.integers(1, 3), b=st.integers(1, 2), window=st.sampled_from([None, 2, 5]),
       masks=st.sampled_from(["causal", "padding", "left", "documents"]), dv=st.sampled_from([3, 5]))
def test_sequence_attention_equals_sdpa_on_the_whole_sequence(sp, heads, group, per, b, window, masks, dv):
    """Drawn head counts (dividing sp: Ulysses; not: rings; partly: Ulysses groups whose rings pass
    keys around; kv heads fewer than sp: repeated), lengths, windows, right padding and packed
    documents, left padding (queries with no key: 0, as SDPA gives them); values' head size apart from the keys' (as multi-head latent attention's): outputs and
    q, k, v gradients equal torch's SDPA with transformers' mask on the whole sequence."""
    kv = max(1, heads // group) if heads % max(1, heads // group) == 0 else heads
    s, d = sp * per, 3
    g = torch.Generator().manual_seed(sp * 1000 + heads * 10 + per)
    q, k, v = (torch.randn(b, n, s, e, generator=g, dtype=torch.float64) for n, e in ((heads, d), (kv, d), (kv, dv)))
    i = torch.arange(s)
    mask = (i[:, None] >= i[None, :]).expand(b, 1, s, s)
    padding = positions = None
    if masks in ("padding", "left"):
        padding = torch.ones(b, s, dtype=torch.bool)
        cut = min(2, per)  # never a whole run
        padding[0, s - cut:] = False if masks == "padding" else True
        padding[0, :cut] = True if masks == "padding" else False  # left: queries with no key at all
        mask = mask & padding[:, None, None, :]
    if masks == "documents":
        positions = torch.cat([torch.arange(s // 2), torch.arange(s - s // 2)]).expand(b, -1)
        docs = (i >= s // 2).long()
        mask = mask & (docs[:, None] == docs[None, :])
    if window is not None:
        mask = mask & (i[:, None] - i[None, :] < window)
    dout = torch.randn(b, heads, s, dv, generator=g, dtype=torch.float64)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    want = F.scaled_dot_product_attention(*leaves, attn_mask=mask, enable_gqa=heads != kv)
    want.backward(dout)

    def rank(comm):
        part = slice(comm.rank * per, (comm.rank + 1) * per)
        mine = [x[:, :, part].clone().requires_grad_() for x in (q, k, v)]
        local = lambda t: t[:, part] if t is not None else None  # noqa: E731
        out = sequence_attention(*mine, SPLayout(comm), padding=local(padding), position_ids=local(positions),
                                 sliding_window=window)
        out.backward(dout[:, :, part])
        return out.detach(), [x.grad for x in mine]

    for r, (out, grads) in enumerate(simulated_world(sp).run(rank)):
        part = slice(r * per, (r + 1) * per)
        torch.testing.assert_close(out, want[:, :, part].detach(), rtol=1e-12, atol=1e-12)
        for got, leaf in zip(grads, leaves):
            torch.testing.assert_close(got, leaf.grad[:, :, part], rtol=1e-12, atol=1e-12)


def test_offload_at_sp():
    """The CPU optimizer (the float32 host Adam: compared with sp 1's float32 run, to float32's
    precision) takes sp 2's gradients as any others."""
    off = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    (want, want_losses), = M.run_gpt(1, 1, 2, extra=off, dtype=torch.float32)
    for params, losses in M.run_gpt(2, 2, 2, extra=off, dtype=torch.float32):
        W.assert_close_tree(params, want, rtol=1e-4, atol=1e-5, what="offload sp2")
        assert losses == pytest.approx(want_losses, rel=1e-5)


def test_a_checkpoint_saved_at_sp_2_loads_without_sp(tmp_path):
    """The state holds nothing of the sequence axis: sp 2 x dp 2's checkpoint is a 4-rank ZeRO-3 one
    and loads into one rank without sp, equal to the gathered parameters."""
    cfg = M.sp_config(3, 4, 2)

    def save(comm):
        sm = fnzero.shard(M.hf_model("llama"), config=cfg, comm=comm)
        state = sm.init_state()
        step = fnzero.train_step(lambda p, b: sm.apply(p, **b).loss, cfg)
        ids, mask, labels = M.token_batches(1, 2, 4)[0]
        d = comm.rank // 2
        micro = [fnzero.shard_sequence({"input_ids": ids[i, 2 * d:2 * d + 2], "labels": labels[i, 2 * d:2 * d + 2]},
                                       sm.sp) for i in range(2)]
        state, _ = step(state, micro)
        fnzero.checkpoint.save(tmp_path, state, tag="t")
        return sm.gather(state)

    saved = simulated_world(4).run(save)[0]
    sm = fnzero.shard(M.hf_model("llama"), config=M.sp_config(3, 1, 1, k=2, rows=4))
    state, _ = fnzero.checkpoint.load(tmp_path, sm.init_state(), tag="t")
    W.assert_close_tree(sm.gather(state), saved, rtol=0, atol=0, what="loaded without sp")


# t = 8 tokens on a rank, d = 4, 2 layers, sp 2; forward and backward alike for Ulysses.
ULYSSES = 2 * 2 * (8 * 4 * (4 + 2 * 4) // 2 + 8 * 4 * 4 // 2)  # q|k|v out t·d·(h+2kv)/2, output t·d·h/2
RING = 2 * ((2 - 1) * 2 * 3 * 4 * 8 + (2 - 1) * 4 * 3 * 4 * 8 + 2 * 3 * 4 * 8)  # k|v; k|v|dk|dv; dk|dv home


@pytest.mark.parametrize("heads,want", [(4, ULYSSES), (3, RING)], ids=["ulysses", "ring"])
def test_exchange_traffic_is_the_formula(heads, want):
    """Elements each rank sends by all-to-all in one step of fnzero's GPT (2 rows of 8 tokens, 2
    layers, head size 4) at sp 2, as `specs/mesh.md` §Sequence, Traffic counts them: 4 heads run
    Ulysses, 3 a ring of 2."""
    def rank(comm):
        cfg = W.config(0, k=1, micro=2, world=2, clip=0.5, extra={"sequence_parallel_size": 2, **M.SP_WIRE,
                                                                  "comms_logger": {"enabled": True}})
        with seeded(0):
            model = GPT(vocab_size=37, seq_len=8, d_model=4 * heads, n_layer=2, n_head=heads).double()
        sm = fnzero.shard(model, config=cfg, comm=comm)
        step = fnzero.train_step(lambda p, b: sm.sp.loss_share(
            F.cross_entropy(sm.apply(p, b[0], position_ids=b[2]).flatten(0, 1), b[1].flatten(), reduction="sum"),
            b[1].numel()), cfg)
        x = torch.randint(0, 37, (2, 8), generator=torch.Generator().manual_seed(0))
        step(sm.init_state(), fnzero.shard_sequence((x, x), sm.sp))
        return sum(r.numel for r in sm.sp.comm.records if r.op == "all_to_all")

    assert simulated_world(2).run(rank) == [want, want]


@pytest.mark.parametrize("kind", ["gpt_tp", "gpt"], ids=["ulysses", "ring"])
def test_bf16_at_sp_follows_sp_1(kind):
    """bf16 compute (fp32 master weights): Ulysses (4 heads) and the ring (3 heads) follow sp 1's bf16
    losses to bf16's precision (parameters are not compared: Adam turns bf16's rounding of
    near-zero gradients into whole steps of lr)."""
    bf16 = {"bf16": {"enabled": True}, "seq_parallel_communication_data_type": "fp32"}

    def run(world, sp):
        def rank(comm):
            return M._gpt_rank(comm, world, sp, 2, extra=bf16, dtype=torch.float32, kind=kind, mesh=sp == 1)
        return simulated_world(world).run(rank)

    (_, want_losses), = run(1, 1)
    for _, losses in run(2, 2):
        assert losses == pytest.approx(want_losses, rel=3e-2)


def test_a_bf16_ring_is_as_accurate_as_bf16_sdpa():
    """The ring's blocks run in float32 (as SDPA's kernels accumulate): on bf16 inputs its output is
    no further from float64's than torch's bf16 SDPA on the whole sequence."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 64, 8, generator=g, dtype=torch.float64) for _ in range(3))
    exact = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    sdpa = F.scaled_dot_product_attention(*(x.bfloat16() for x in (q, k, v)), is_causal=True)

    def rank(comm):
        part = slice(comm.rank * 32, (comm.rank + 1) * 32)
        return sequence_attention(*(x[:, :, part].bfloat16() for x in (q, k, v)), SPLayout(comm))

    ring = torch.cat(simulated_world(2).run(rank), dim=2)
    assert ring.dtype == torch.bfloat16
    err = lambda x: (x.double() - exact).abs().max().item()  # noqa: E731
    assert err(ring) <= err(sdpa) * 1.01, (err(ring), err(sdpa))


def _pipe_sp_run(make_pipe, batches, to_batch, stage=1, k=4):
    """sp 2 x pp 2 (world 4, one data-parallel replica): each rank's stage parameters and losses."""
    def rank(comm):
        cfg = fnzero.load_config({
            "train_micro_batch_size_per_gpu": 8 // k, "gradient_accumulation_steps": k, "gradient_clipping": 0.5,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
            "zero_optimization": {"stage": stage}, "pipeline": {"stages": 2}, "sequence_parallel_size": 2,
            **M.SP_WIRE}, world_size=4)
        sm = fnzero.shard(make_pipe(), config=cfg, comm=comm)
        state = sm.init_state()
        step = fnzero.train_step(fnzero.pipeline_loss(sm, "1f1b"), cfg)
        losses = []
        for batch in batches:
            state, m = step(state, to_batch(batch, sm.sp))
            losses.append(m["loss"])
        return sm.gather(state), losses

    return simulated_world(4).run(rank)


def test_sp_x_pp_on_fnzeros_gpt_layers():
    """fnzero's GPT as pipeline layers at sp 2 x pp 2, 1F1B over 4 micro-batches: the embedding
    counts positions from the rank's run, the loss_fn's mean becomes the rank's share; each stage
    equals plain torch on the whole model and sequence."""
    import copy

    from fnzero.pipeline import PipelineModule

    batches = W.pipe_gpt_batches(2)
    ref, ref_losses = W.train_pipe_reference(W.pipe_gpt_layers(), W.lm_loss, batches, 4)
    cut = lambda b, sp: tuple(fnzero.shard_sequence(b, sp)[:2])  # noqa: E731  (inputs, labels)
    results = _pipe_sp_run(lambda: PipelineModule(copy.deepcopy(W.pipe_gpt_layers()), W.lm_loss), batches, cut)
    for params, losses in results:
        W.assert_close_tree(params, ref, rtol=RTOL, atol=1e-12, what="gpt layers sp2 pp2")
        assert losses == pytest.approx(ref_losses, rel=RTOL)
    assert {n for p, _ in results for n in p} == set(ref)  # both stages' layers


def test_sp_x_pp_on_a_transformers_llama():
    """hf_causal_lm's Llama at sp 2 x pp 2 with labels shifted before the cut
    (`shifted_causal_lm_loss`): the stages' layers route their attention over the sequence axis
    through their config, and equal plain torch on the whole sequence."""
    from fnzero.pipeline import hf_causal_lm, shifted_causal_lm_loss

    g = torch.Generator().manual_seed(4)
    batches = [torch.randint(1, M.V, (8, M.S), generator=g) for _ in range(2)]
    model = M.hf_model("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_losses = []
    for ids in batches:
        opt.zero_grad()
        total = 0.0
        for part in ids.chunk(4):
            loss = M.causal_lm_loss(model(input_ids=part).logits, part) / 4
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        ref_losses.append(total)

    def cut(ids, sp):
        d = fnzero.shard_sequence({"input_ids": ids, "labels": ids}, sp)
        return d["input_ids"], d["shift_labels"]

    results = _pipe_sp_run(lambda: hf_causal_lm(M.hf_model("llama"), loss_fn=shifted_causal_lm_loss), batches, cut)
    want = {n: p.detach() for n, p in model.named_parameters()}
    for params, losses in results:
        W.assert_close_tree(params, want, rtol=RTOL, atol=1e-12, what="llama pipeline sp2 pp2")
        assert losses == pytest.approx(ref_losses, rel=RTOL)
