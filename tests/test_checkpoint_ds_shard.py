"""Each rank resuming a DeepSpeed checkpoint reads only what its shard needs (specs/checkpoint-format.md
§DeepSpeed, "Memory and files"): it opens only the optimizer files whose partitions overlap the
element ranges its leaves hold, and copies only those elements out of them. Counted, not timed: the
files each simulated rank opens (every open goes through `_ds_pickle.open_file`) and the elements
its read copies, against the ranks and the share computed here from DeepSpeed's layout (the ZeRO-2
checkpoint `test_checkpoint_ds_resume._zero2` builds, without DeepSpeed)."""

from __future__ import annotations

import itertools
import math
import os
import threading
from collections import OrderedDict

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


class FrozenNet(torch.nn.Module):
    """A trainable layer and a frozen one (a LoRA base's part), and a buffer."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(5, 3)
        self.b = torch.nn.Linear(7, 3, bias=False).requires_grad_(False)
        self.register_buffer("buf", torch.zeros(3))
        with torch.no_grad():  # the same initial weights on every simulated rank (threads share one RNG)
            for i, p in enumerate(self.parameters()):
                p.copy_(torch.linspace(-1, 1, p.numel()).view(p.shape) * (i + 1))


def _zero3(root: str, world: int) -> dict[str, torch.Tensor]:
    """A float32 ZeRO-3 checkpoint as DeepSpeed lays it out, frozen `b.weight` included: each
    parameter padded to a multiple of `world`, rank r's files holding slice r of each (trainable
    ones in its optimizer file, frozen ones in its model file's frozen_param_fragments). Returns
    the whole tensors by "field/name"."""
    g = torch.Generator().manual_seed(3)
    trainable = {"a.weight": (3, 5), "a.bias": (3,)}
    full = {f"{f}/{n}": torch.randn(s, generator=g) for f in ("fp32", "exp_avg", "exp_avg_sq")
            for n, s in trainable.items()}
    full["frozen/b.weight"] = torch.randn(3, 7, generator=g)

    def piece(t: torch.Tensor, r: int) -> torch.Tensor:
        ps = -(-t.numel() // world)
        return torch.cat([t.reshape(-1), torch.zeros(ps * world - t.numel())])[r * ps: (r + 1) * ps]

    d = os.path.join(root, "global_step4")
    os.makedirs(d)
    for r in range(world):
        flat = {f: torch.cat([piece(full[f"{f}/{n}"], r) for n in trainable]) for f in ("fp32", "exp_avg", "exp_avg_sq")}
        inner = {"state": {0: {"step": torch.tensor(4.0), "exp_avg": flat["exp_avg"], "exp_avg_sq": flat["exp_avg_sq"]}},
                 "param_groups": [{"lr": 1e-3, "params": [0]}]}
        torch.save({"optimizer_state_dict": {"zero_stage": 3, "fp32_flat_groups": [flat["fp32"]],
                                             "optimizer_state_dict": inner}},
                   os.path.join(d, f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))
        module = OrderedDict([("a.weight", torch.empty(0)), ("a.bias", torch.empty(0)), ("b.weight", torch.empty(0)),
                              ("buf", torch.arange(3.0))])
        torch.save({"module": module, "buffer_names": ["buf"], "optimizer": None,
                    "param_shapes": [OrderedDict((n, torch.Size(s)) for n, s in trainable.items())],
                    "frozen_param_shapes": OrderedDict([("b.weight", torch.Size([3, 7]))]),
                    "frozen_param_fragments": {"b.weight": piece(full["frozen/b.weight"], r)},
                    "shared_params": {}, "lr_scheduler": None, "skipped_steps": 0, "global_steps": 4,
                    "global_samples": 8, "dp_world_size": world, "mp_world_size": 1, "ds_version": "0.19.8",
                    "ds_config": {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                                  "optimizer": {"type": "AdamW"}}},
                   os.path.join(d, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"))
    with open(os.path.join(root, "latest"), "w") as f:
        f.write("global_step4")
    return full


@pytest.mark.parametrize("world", [2, 1])
def test_frozen_weights_of_a_zero3_checkpoint_are_read_by_share(tmp_path, monkeypatch, world):
    """Resumed at ZeRO-3, each rank copies only its share of the frozen weights out of the model
    files' frozen_param_fragments (with its share of the trainable weights and both moments), and
    what every rank holds is the whole checkpoint: bit for bit, frozen, trainable and moments."""
    root = str(tmp_path / "ds")
    full = _zero3(root, world=3)  # (saved at 3: a rank's share at 2 spans two DeepSpeed ranks' slices)
    opened, copied = record_reads(monkeypatch)
    threads = {}

    def fn(comm):
        threads[comm.rank] = threading.get_ident()
        cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"},
                                  "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}},
                                 world_size=world)
        like = fnzero.shard(FrozenNet(), config=cfg, comm=comm).init_state()
        return load(root, like=like)[0]

    states = simulated_world(world).run(fn)
    plan = states[0].sharding.plan
    [fu] = plan.frozen_units
    frozen = torch.cat([s.frozen[fu.name] for s in states])
    assert torch.equal(frozen[:21].view(3, 7), full["frozen/b.weight"])
    for f, key in (("fp32", None), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
        for u in plan.units:
            got = torch.cat([s.params[u.name] if key is None else getattr(s.opt_state, key)[u.name] for s in states])
            for s in u.slots:
                assert torch.equal(got[s.offset:s.offset + s.numel].view(s.shape), full[f"{f}/{s.name}"]), (f, s.name)
    for rank, ident in threads.items():
        share = sum(hi - lo for u in plan.units for lo, hi in [u.real_range(rank)])
        frozen_share = (lambda lo, hi: hi - lo)(*fu.real_range(rank))
        assert copied[ident] == 3 * share + frozen_share, rank
