"""Tiling along the sequence (`specs/mesh.md` §Sequence, Tiled loss, Tiled MLP): `sm.causal_lm_loss`
computes a transformers causal LM's loss from its decoder and then its head a few tokens at a time,
and `fnzero.tile_mlp` runs its MLPs so, each tile recomputed in backward. Training with them equals
plain torch on the untiled model (float64, ZeRO-3, with and without a sequence axis, with a
vocabulary-split head); the logits and the MLPs' intermediates are never saved whole; models whose
logits are more than the head's output, MoE blocks, and bad tile counts, are refused."""

from __future__ import annotations

import pytest
import torch
import transformers

import _sp_models as M
import _worlds as W
import fnzero
from fnzero import ShardingError
from fnzero.sharding.sp import tiled_causal_lm_loss
from fnzero.testing import count_saved_bytes, seeded, simulated_world

RTOL = 1e-9


def _train(world, sp, stage, tiles, extra=None, mlp_tiles=None):
    def rank(comm):
        cfg = M.sp_config(stage, world, sp, extra=extra) if sp > 1 else W.config(stage, k=2, micro=2, world=world,
                                                                                  clip=0.5, extra=extra)
        model = M.hf_model("llama")
        if mlp_tiles is not None:
            assert fnzero.tile_mlp(model, mlp_tiles) == ["model.layers.0.mlp", "model.layers.1.mlp"]
        sm = fnzero.shard(model, config=cfg, comm=comm)
        state = sm.init_state()
        step = fnzero.train_step(lambda p, b: sm.causal_lm_loss(p, b, tiles=tiles), cfg)
        tp = cfg.tensor_parallel.size
        d, losses = comm.rank // (tp * sp), []
        for ids, mask, labels in M.token_batches(2, 2, world // (tp * sp) * 2):
            mine = slice(d * 2, (d + 1) * 2)
            micro = [fnzero.shard_sequence({"input_ids": ids[i, mine], "attention_mask": mask[i, mine],
                                            "labels": labels[i, mine]}, sm.sp) for i in range(2)]
            state, m = step(state, micro)
            losses.append(m["loss"])
        return sm.gather(state), losses

    return simulated_world(world).run(rank)


@pytest.mark.parametrize("world,sp,stage,tiles,tp,mlp", [
    (1, 1, 3, 3, 1, 3), (2, 2, 3, "auto", 1, None), (4, 2, 3, 5, 1, 2), (4, 2, 1, 2, 2, None),
], ids=lambda v: str(v))
def test_training_on_tiles_equals_the_untiled_model(world, sp, stage, tiles, tp, mlp):
    """Loss tiles of 3, 'auto' (51 entries over 16 hidden: 4), 5 (uneven) and 2 with a
    vocabulary-split head (tp 2); MLP tiles of 3 and 2 (ZeRO-3 re-gathers each layer's weights
    for every tile's recomputation): every rank's parameters and loss are plain torch's."""
    ref, ref_losses = M.reference("llama", 2, 2, world // (sp * tp), 2)
    extra = {"tensor_parallel": {"autotp_size": 2, "vocab_parallel_lm_head": True}} if tp > 1 else None
    for params, losses in _train(world, sp, stage, tiles, extra, mlp):
        W.assert_close_tree(params, ref, rtol=RTOL, atol=1e-12, what=f"tiled w{world} sp{sp} z{stage} tiles {tiles}")
        assert losses == pytest.approx(ref_losses, rel=RTOL)


def test_the_logits_are_never_saved_whole():
    """What autograd keeps for backward: the model's own loss keeps (b, s, vocab) logits; the tiled
    loss keeps each tile's input only, so at least 3/4 of the whole logits' bytes are not kept."""
    model = M.hf_model("llama")
    params = list(model.parameters())
    ids = torch.randint(1, M.V, (2, M.S), generator=torch.Generator().manual_seed(0))
    with count_saved_bytes(params) as whole:
        M.causal_lm_loss(model(input_ids=ids).logits, ids)
    with count_saved_bytes(params) as tiled:
        tiled_causal_lm_loss(model, tiles=4, layout=None, labels=ids, input_ids=ids,
                             cross_entropy=lambda lg, y: torch.nn.functional.cross_entropy(
                                 lg.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum"))
    logits = 2 * M.S * M.V * 8
    assert whole.bytes - tiled.bytes >= 0.75 * logits, (whole.bytes, tiled.bytes, logits)


def _gemma2():
    with seeded(0):
        return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            vocab_size=M.V, hidden_size=16, intermediate_size=22, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, head_dim=4)).double()


@pytest.mark.parametrize("make,tiles,match", [
    (_gemma2, 2, r"Gemma2ForCausalLM applies final_logit_softcapping=30.0 to its logits, which causal_lm_loss's "),
    (lambda: W.make_model("gpt"), 2, r"GPT has no get_decoder\(\)/get_output_embeddings\(\) pair"),
    (lambda: M.hf_model("llama"), 0, r"tiles must be a positive integer or 'auto', got 0"),
], ids=["softcap", "no-decoder", "tiles"])
def test_what_the_tiles_cannot_do_is_refused(make, tiles, match):
    sm = fnzero.shard(make(), config=W.config(0))
    ids = torch.randint(1, 30, (1, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ShardingError, match=match):
        sm.causal_lm_loss(sm.init_state().params, {"input_ids": ids, "labels": ids}, tiles=tiles)


def test_tiled_mlps_keep_their_names_and_save_one_tile_of_intermediates():
    """The tiled copies hold the same parameters under the same names (the state dict is the same
    dict of tensors), the model given is otherwise as it was, outputs and gradients equal the
    untiled model's to the last bit of float64 reassociation, and autograd keeps at least 3/4 fewer
    bytes of the MLPs' (tokens × width) intermediates."""
    plain, tiled = M.hf_model("llama"), M.hf_model("llama")
    before, keys = dict(tiled.named_parameters()), tiled.state_dict().keys()
    old_mlp = tiled.model.layers[0].mlp
    fnzero.tile_mlp(tiled, 4)
    after = dict(tiled.named_parameters())
    assert tiled.state_dict().keys() == keys and after.keys() == before.keys()
    assert all(after[k] is before[k] for k in before)
    assert type(tiled.model.layers[0].mlp).__name__ == "TiledLlamaMLP" and type(old_mlp).__name__ == "LlamaMLP"
    assert isinstance(tiled.model.layers[0].mlp, type(old_mlp))
    ids = torch.randint(1, M.V, (2, M.S), generator=torch.Generator().manual_seed(0))
    counts = []
    for model in (plain, tiled):
        with count_saved_bytes(list(model.parameters())) as saved:
            loss = M.causal_lm_loss(model(input_ids=ids).logits, ids)
        loss.backward()
        counts.append(saved.bytes)
    for (name, a), b in zip(plain.named_parameters(), tiled.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-12, atol=1e-14, msg=name)
    intermediates = 2 * 3 * 2 * M.S * 22 * 8  # layers x (gate, up, act) x tokens x width x float64
    assert counts[0] - counts[1] >= 0.75 * intermediates * 3 / 4, counts


def test_tile_mlp_refuses_a_model_without_mlps_and_bad_tiles():
    with pytest.raises(ShardingError, match=r"tile_mlp found no MLP to tile in MixtralForCausalLM"):
        fnzero.tile_mlp(M.hf_model("mixtral"))
    with pytest.raises(ShardingError, match=r"tiles must be a positive integer or 'auto', got 0"):
        fnzero.tile_mlp(M.hf_model("llama"), 0)
