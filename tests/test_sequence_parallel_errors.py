"""Sequence parallelism's data and refusals (`specs/mesh.md` §Sequence): `shard_sequence` shifts the
labels across the cut as DeepSpeed's adapter does, pads on request, and refuses a batch it cannot
cut; each bad mesh, model, batch or call gets one line naming what is wrong."""

from __future__ import annotations

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

import _sp_models as M
import fnzero
from fnzero import ConfigError, ShardingError
from fnzero.sharding import SPLayout, make_mesh
from fnzero.testing import MLP, seeded, simulated_world


class _Rank:
    """The collectives of rank `rank` of `size`, for `SPLayout.shard_range` alone (no collective runs)."""

    def __init__(self, rank, size):
        self.rank, self.world_size = rank, size


@settings(max_examples=25, deadline=None, derandomize=True)
@given(sp=st.sampled_from([1, 2, 3, 4]), per=st.integers(1, 4), rows=st.integers(1, 3), pad=st.integers(0, 3))
def test_shards_joined_are_the_whole_batch_with_labels_shifted(sp, per, rows, pad):
    """Joined over the ranks, the shards are the batch; shift_labels are the next tokens' labels over
    the whole sequence (a run's last is the next run's first), -100 at the end, as DeepSpeed's
    UlyssesSPDataLoaderAdapter; position ids count the whole sequence."""
    s = sp * per
    ids = torch.arange(rows * s).reshape(rows, s) + 1
    labels = ids.clone()
    labels[:, s - min(pad, s - 1):] = -100
    parts = [fnzero.shard_sequence({"input_ids": ids, "labels": labels}, SPLayout(_Rank(r, sp))) for r in range(sp)]
    joined = {k: torch.cat([p[k] for p in parts], dim=1) for k in parts[0]}
    assert torch.equal(joined["input_ids"], ids) and torch.equal(joined["labels"], labels)
    assert torch.equal(joined["shift_labels"], torch.cat([labels[:, 1:], torch.full((rows, 1), -100)], dim=1))
    assert torch.equal(joined["position_ids"], torch.arange(s).expand(rows, -1))


def test_pad_to_multiple_pads_on_the_right_and_counts_on():
    ids = torch.arange(1, 8)[None]
    mask = torch.ones(1, 7, dtype=torch.long)
    parts = [fnzero.shard_sequence({"input_ids": ids, "attention_mask": mask, "labels": ids}, SPLayout(_Rank(r, 4)),
                                   pad_to_multiple=True, pad_id=9) for r in range(4)]
    last = parts[3]
    assert last["input_ids"].tolist() == [[7, 9]] and last["attention_mask"].tolist() == [[1, 0]]
    assert last["shift_labels"].tolist() == [[-100, -100]] and parts[2]["shift_labels"].tolist() == [[6, 7]]
    assert torch.cat([p["position_ids"] for p in parts], 1).tolist() == [list(range(8))]


@pytest.mark.parametrize("batch,match", [
    ({"input_ids": torch.ones(1, 7, dtype=torch.long)}, r"a sequence of 7 tokens does not divide over 2 "
                                                        r"sequence-parallel ranks; pad it to a multiple of 2"),
    ({"input_ids": torch.ones(2, 8, dtype=torch.long),
      "attention_mask": torch.tensor([[1] * 8, [1] * 3 + [0] * 5])}, r"sample 1: its tokens on sequence-parallel "
                                                                    r"rank 1 of 2 are all padding; trim the padding"),
    ({"input_ids": torch.ones(2, 8, dtype=torch.long), "labels": torch.ones(2, 6, dtype=torch.long)},
     r"the tensors disagree on the sequence length: input_ids 8, labels 6"),
    ({"input_ids": torch.ones(8, dtype=torch.long)}, r"'input_ids' must be a \(batch, tokens\) tensor, got a 1-D"),
    ([1, 2], r"item 0 of the list must be a \(batch, tokens\) tensor, got int"),
], ids=["length", "empty-run", "lengths", "1-D", "not-tensors"])
def test_a_batch_that_cannot_be_cut_is_refused_in_one_line(batch, match):
    with pytest.raises(ShardingError, match=match) as e:
        fnzero.shard_sequence(batch, SPLayout(_Rank(0, 2)))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kwargs,match", [
    ({"sp": 3}, r"sequence_parallel_size 3 must divide the data-parallel ranks: this mesh has 4"),
    ({"sp": 2, "mics": 2}, r"sequence_parallel_size 2 with MiCS shard size 2: fnzero's sequence parallelism "
                           r"composes with ZeRO stages 0-3, tensor, pipeline and expert parallelism, not yet with MiCS"),
    ({"sp": 2, "hpz": 2}, r"sequence_parallel_size 2 with hpZ partition size 2"),
    ({"sp": 2, "tp": 4}, r"sequence_parallel_size 2 must divide the data-parallel ranks: this mesh has 1"),
    ({"sp": 0}, r"the sequence-parallel size must be a positive integer, got 0"),
], ids=["divide", "mics", "hpz", "tp-divide", "zero"])
def test_a_mesh_the_sequence_axis_cannot_form_is_refused(kwargs, match):
    def rank(comm):
        with pytest.raises(ConfigError, match=match):
            make_mesh(comm, **kwargs)

    simulated_world(4).run(rank)


def test_a_config_whose_world_sp_does_not_divide_and_a_one_bit_optimizer_are_refused():
    with pytest.raises(ConfigError, match=r"`sequence_parallel_size` 4 does not divide the world size 6"):
        fnzero.load_config({"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 4}, world_size=6)
    with pytest.raises(ConfigError, match=r"OneBitAdam with `sequence_parallel_size`"):
        fnzero.load_config({"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 2,
                            "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}}}, world_size=2)


def _bloom():
    with seeded(0):
        return transformers.BloomForCausalLM(transformers.BloomConfig(n_layer=1, hidden_size=8, n_head=2, vocab_size=11))


@pytest.mark.parametrize("make,match", [
    (lambda: MLP([4, 4]), r"sequence parallelism cannot reach MLP's attention: it is neither a transformers model"),
    (_bloom, r"sequence parallelism cannot reach BloomForCausalLM's attention: transformers keeps it at 'eager'"),
], ids=["no-attention", "no-interface"])
def test_a_model_whose_attention_cannot_be_reached_is_refused_at_shard(make, match):
    world = 2

    def rank(comm):
        model = make()
        with pytest.raises(ShardingError, match=match) as e:
            fnzero.shard(model, config=M.sp_config(0, world, world, k=1), comm=comm)
        assert "\n" not in str(e.value)
        assert all(p.device.type != "meta" for p in model.parameters())  # refused before anything is released

    simulated_world(world).run(rank)


def test_calls_without_positions_or_shifted_labels_and_generate_are_refused():
    """The step raises before it changes anything: the same state trains afterwards."""
    ids = torch.randint(1, M.V, (2, M.S), generator=torch.Generator().manual_seed(2))

    def rank(comm):
        cfg = M.sp_config(0, 2, 2, k=1)
        sm = fnzero.shard(M.hf_model("llama"), config=cfg, comm=comm)
        state = sm.init_state()
        step = fnzero.train_step(lambda p, b: sm.apply(p, **b).loss, cfg)
        batch = fnzero.shard_sequence({"input_ids": ids, "labels": ids}, sm.sp)
        with pytest.raises(ShardingError, match=r"the call needs position_ids= \(the tokens' places in the whole "):
            step(state, {k: v for k, v in batch.items() if k != "position_ids"})
        with pytest.raises(ShardingError, match=r"pass shift_labels= too, as fnzero.shard_sequence makes them"):
            step(state, {k: v for k, v in batch.items() if k != "shift_labels"})
        with pytest.raises(ShardingError, match=r"generate: this model is sharded with a sequence axis"):
            fnzero.generate(sm, state, ids[:, :4], max_new_tokens=2)
        return step(state, batch)[1]["loss"]

    a, b = simulated_world(2).run(rank)
    assert a == b


def test_attention_dropout_on_a_ring_is_refused_at_the_call():
    """3 heads at sp 2 need the ring, which draws no dropout: one line naming the module."""
    ids = torch.randint(1, M.V, (1, 8), generator=torch.Generator().manual_seed(2))

    def rank(comm):
        model = M.hf_model("llama", kv=1, heads=3)
        for m in model.modules():  # as a config's attention_dropout sets it, read in training
            if hasattr(m, "attention_dropout"):
                m.attention_dropout = 0.1
        model.train()
        sm = fnzero.shard(model, config=M.sp_config(0, 2, 2, k=1), comm=comm)
        with pytest.raises(ShardingError, match=r"LlamaAttention has attention dropout 0.1, which fnzero's ring "):
            sm.apply(sm.init_state().params, **fnzero.shard_sequence({"input_ids": ids}, sm.sp))

    simulated_world(2).run(rank)
