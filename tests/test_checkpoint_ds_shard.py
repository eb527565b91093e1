"""Each rank resuming a DeepSpeed checkpoint reads only what its shard needs (specs/checkpoint-format.md
§DeepSpeed, "Memory and files"): it opens only the optimizer files whose partitions overlap the
element ranges its leaves hold, and copies only those elements out of them. Counted, not timed: the
files each simulated rank opens (every open goes through `_ds_pickle.open_file`) and the elements
its read copies, against the ranks and the share computed here from DeepSpeed's layout (the ZeRO-2
checkpoint `test_checkpoint_ds_resume._zero2` builds, without DeepSpeed)."""

from __future__ import annotations

import itertools
import math
import threading

import pytest
import torch
from test_checkpoint_ds_resume import FIELDS, SHAPES, Net, _by_name, _zero2

import fnzero
from fnzero import CheckpointError
from fnzero.checkpoint import _ds_pickle, _ds_shard, load
from fnzero.testing._threads import simulated_world


def record_reads(monkeypatch) -> tuple[dict, dict]:
    """(thread -> names of the optimizer files it opened, thread -> elements its shard read copied)."""
    opened: dict[int, list[str]] = {}
    copied: dict[int, int] = {}
    open_file, read = _ds_pickle.open_file, _ds_shard.ShardRead.read

    def counting_open(name, *args, **kwargs):
        if "optim_states" in name:
            opened.setdefault(threading.get_ident(), []).append(name)
        return open_file(name, *args, **kwargs)

    def counting_read(self):
        read(self)
        copied[threading.get_ident()] = copied.get(threading.get_ident(), 0) + self.elements

    monkeypatch.setattr(_ds_pickle, "open_file", counting_open)
    monkeypatch.setattr(_ds_shard.ShardRead, "read", counting_read)
    return opened, copied


def shard_ranges(plan, rank: int, sharded: bool) -> dict[str, tuple[int, int]]:
    """Parameter name -> the element range [a, b) of it that `rank` holds (all of it unless `sharded`)."""
    out = {}
    for u in plan.units:
        lo, hi = u.real_range(rank) if sharded else (0, u.numel)
        for s in u.slots:
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            if a < b:
                out[s.name] = (a - s.offset, b - s.offset)
    return out


def zero2_ranks(ranges: dict, world: int) -> set[int]:
    """The DeepSpeed ranks whose ZeRO-2 partitions hold `ranges` (SHAPES end to end, the group padded
    to 2 x world elements and cut in `world` equal partitions)."""
    offsets = dict(zip(SHAPES, [0, *itertools.accumulate(math.prod(s) for s in SHAPES.values())]))
    part = math.ceil(sum(math.prod(s) for s in SHAPES.values()) / (2 * world)) * 2
    return {r for n, (a, b) in ranges.items() for r in range((offsets[n] + a) // part, (offsets[n] + b - 1) // part + 1)}


@pytest.mark.parametrize("stage", [3, 2])
def test_a_rank_opens_only_the_optimizer_files_its_shard_overlaps(tmp_path, monkeypatch, stage):
    full = _zero2(str(tmp_path / "ds"), world=4, dp_world_size=4)  # 26 elements in partitions of 8: [0, 8) ... [24, 26)
    opened, copied = record_reads(monkeypatch)
    threads = {}

    def fn(comm):
        threads[comm.rank] = threading.get_ident()
        cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"},
                                  "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}},
                                 world_size=2)  # (no threshold: stage 3 shards these small weights too)
        like = fnzero.shard(Net(), config=cfg, comm=comm).init_state()
        return load(str(tmp_path / "ds"), like=like)[0]

    states = simulated_world(2).run(fn)
    for f in FIELDS:  # (what was read is right)
        got = _by_name(states, f)
        assert all(got[n].equal(full[f][n]) for n in SHAPES), f
    plan, missed = states[0].sharding.plan, {}
    for rank, ident in threads.items():
        mine = shard_ranges(plan, rank, sharded=True)  # (the moments, and at stage 3 the weights)
        weights = mine if stage == 3 else shard_ranges(plan, rank, sharded=False)
        want = zero2_ranks(weights, 4) | zero2_ranks(mine, 4)
        # (+ rank 0's: `describe` reads its small fields, zero_stage and the like, at ZeRO-1/2, no tensor)
        files = sorted(set(opened.get(ident, [])))
        assert files == [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in sorted(want | {0})], (rank, files)
        share = sum(b - a for a, b in mine.values())
        assert copied[ident] == sum(b - a for a, b in weights.values()) + 2 * share, rank
        missed[rank] = 4 - len(want | {0})
    assert (missed[0] > 0) == (stage == 3)  # (at stage 3 rank 0 skips rank 3's file: the count says something)


@pytest.mark.parametrize("case,match", [
    ("short", r"zero_pp_rank_1_mp_rank_00_optim_states.pt: group 0's weights holds 5 elements where param_shapes "
              r"and the world size 4 put 8"),
    ("step", r"the ranks' optimizer files are at different steps \(5 in .*zero_pp_rank_0.*, 6 in .*zero_pp_rank_1"),
])
def test_an_opened_file_that_disagrees_with_the_layout_is_refused_and_named(tmp_path, case, match):
    root = str(tmp_path / "ds")
    _zero2(root, world=4, dp_world_size=4)
    p = str(tmp_path / "ds" / "global_step5" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    sd = torch.load(p, weights_only=True)
    osd = sd["optimizer_state_dict"]
    if case == "short":
        osd["single_partition_of_fp32_groups"][0] = osd["single_partition_of_fp32_groups"][0][:5].clone()
    else:
        osd["base_optimizer_state"]["state"][0]["step"] = torch.tensor(6.0)
    torch.save(sd, p)
    like = fnzero.shard(Net(), config=fnzero.load_config({"train_micro_batch_size_per_gpu": 1,
                                                          "optimizer": {"type": "AdamW"},
                                                          "zero_optimization": {"stage": 2}})).init_state()
    with pytest.raises(CheckpointError, match=match):
        load(root, like=like)
