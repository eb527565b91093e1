"""`sm.causal_lm_loss` (`specs/mesh.md` §Sequence, Tiled loss): a transformers causal LM's loss from
its decoder and then its head a few tokens at a time, each tile recomputed in backward. Training with
it equals plain torch on whole logits (float64, ZeRO-3, with and without a sequence axis, with a
vocabulary-split head); the logits are never saved whole; models whose logits are more than the
head's output, and bad tile counts, are refused."""

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


def _train(world, sp, stage, tiles, extra=None):
    def rank(comm):
        cfg = M.sp_config(stage, world, sp, extra=extra) if sp > 1 else W.config(stage, k=2, micro=2, world=world,
                                                                                  clip=0.5, extra=extra)
        sm = fnzero.shard(M.hf_model("llama"), config=cfg, comm=comm)
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


@pytest.mark.parametrize("world,sp,stage,tiles,tp", [
    (1, 1, 3, 3, 1), (2, 2, 3, "auto", 1), (4, 2, 3, 5, 1), (4, 2, 1, 2, 2),
], ids=lambda v: str(v))
def test_training_on_the_tiled_loss_equals_whole_logits(world, sp, stage, tiles, tp):
    """Tiles of 3, 'auto' (51 entries over 16 hidden: 4), 5 (uneven) and 2 with a vocabulary-split
    head (tp 2): every rank's parameters and loss are plain torch's on whole logits."""
    ref, ref_losses = M.reference("llama", 2, 2, world // (sp * tp), 2)
    extra = {"tensor_parallel": {"autotp_size": 2, "vocab_parallel_lm_head": True}} if tp > 1 else None
    for params, losses in _train(world, sp, stage, tiles, extra):
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
