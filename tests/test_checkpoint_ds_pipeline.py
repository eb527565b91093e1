"""`fnzero.checkpoint.load` of a DeepSpeed pipeline checkpoint built here without DeepSpeed
(specs/checkpoint-format.md §DeepSpeed, "Resuming in fnzero"): a two-stage PipelineModule whose
weights are in `layer_XX-model_states.pt` files and whose optimizer state is per stage, in
`zero_pp_rank_{dp}_mp_rank_{stage:02d}_optim_states.pt` (ZeRO-1, each stage's group partitioned
over its 2 data-parallel ranks) or in each stage's model file (stage 0). It lands by name in
fnzero's PipelineModule of the same layers, in one stage or two, and a rank of a two-stage state
opens only its stage's optimizer files."""

from __future__ import annotations

import copy
import math
import os
import threading

import pytest
import torch
from test_checkpoint_ds_shard import record_reads

import fnzero
from fnzero import CheckpointError
from fnzero.checkpoint import load
from fnzero.testing._threads import simulated_world

TAG = "global_step5"
FIELDS = ("fp32", "exp_avg", "exp_avg_sq")
# DeepSpeed's stages: layers 0-1 (Linear(5, 3), Tanh) and 2-3 (Linear(3, 4), Linear(4, 2, bias=False)):
# 18 and 24 elements, padded to 20 and 24 at 2 data-parallel ranks (partitions of 10 and 12).
STAGES = [{"0.weight": (3, 5), "0.bias": (3,)}, {"2.weight": (4, 3), "2.bias": (4,), "3.weight": (2, 4)}]
LAYER_OF = {0: 0, 1: 0, 2: 1, 3: 1}


def _layers() -> list:
    with torch.no_grad():
        layers = [torch.nn.Linear(5, 3), torch.nn.Tanh(), torch.nn.Linear(3, 4), torch.nn.Linear(4, 2, bias=False)]
        for p in (p for layer in layers for p in layer.parameters()):
            p.zero_()
    return layers


def _meta(stage: int, dp: int, zero: int) -> dict:
    return {"module": None, "buffer_names": [], "optimizer": None,
            "param_shapes": [dict(STAGES[stage])] if zero else None, "frozen_param_shapes": None,
            "shared_params": None, "lr_scheduler": {"last_batch_iteration": 4}, "skipped_steps": 0,
            "global_steps": 5, "global_samples": 40, "dp_world_size": dp, "mp_world_size": 2,
            "checkpoint_parallel_dimensions": {"pp_degree": 2, "tp_degree": 1},
            "ds_config": {"zero_optimization": {"stage": zero}, "optimizer": {"type": "AdamW"}}, "ds_version": "0.19.8"}


def _zero1_stage(d: str, stage: int, full: dict, dp: int) -> None:
    """Stage `stage`'s optimizer files as ZeRO-1 writes them (rigid moments with the padding)."""
    names = list(STAGES[stage])
    total = sum(math.prod(STAGES[stage][n]) for n in names)
    part = math.ceil(total / (2 * dp)) * 2
    flat = {f: torch.cat([*(full[f][n].reshape(-1) for n in names), torch.zeros(part * dp - total)]) for f in FIELDS}
    for r in range(dp):
        pad = max(0, min(part, (r + 1) * part - total))
        cut = {f: flat[f][r * part:(r + 1) * part].clone() for f in FIELDS}
        base = {"state": {0: {"step": torch.tensor(5.0), "exp_avg": cut["exp_avg"], "exp_avg_sq": cut["exp_avg_sq"]}},
                "param_groups": [{"lr": 1e-3, "params": [0]}]}
        osd = {"zero_stage": 1, "single_partition_of_fp32_groups": [cut["fp32"][:part - pad]],
               "base_optimizer_state": base, "group_paddings": [pad], "partition_count": [dp],
               "param_alignment_paddings": [[0] * len(names)]}
        name = f"zero_pp_rank_{r}_mp_rank_{stage:02d}_optim_states.pt"
        torch.save({"optimizer_state_dict": osd}, os.path.join(d, name))


def _pipeline(root: str, zero: int = 1, dp: int = 2) -> dict[str, dict[str, torch.Tensor]]:
    """A float32 two-stage pipeline checkpoint as DeepSpeed lays it out at ZeRO `zero` (1, or 0: each
    stage's torch Adam state in its model file); the whole tensors it holds by field and name."""
    g = torch.Generator().manual_seed(3)
    full = {f: {n: torch.randn(s, generator=g).abs() for st in STAGES for n, s in st.items()} for f in FIELDS}
    d = os.path.join(root, TAG)
    os.makedirs(d)
    for layer in range(4):  # (the Tanh's file holds nothing; an fp32 run's module weights are its masters)
        sd = {n.split(".", 1)[1]: full["fp32"][n] for n in STAGES[LAYER_OF[layer]] if n.startswith(f"{layer}.")}
        torch.save(sd, os.path.join(d, f"layer_{layer:02d}-model_states.pt"))
    for stage in range(2):
        meta = _meta(stage, dp, zero)
        if zero:
            _zero1_stage(d, stage, full, dp)
        else:
            meta["optimizer"] = {"state": {i: {"step": torch.tensor(5.0), "exp_avg": full["exp_avg"][n],
                                               "exp_avg_sq": full["exp_avg_sq"][n]}
                                           for i, n in enumerate(STAGES[stage])},
                                 "param_groups": [{"lr": 1e-3, "params": list(range(len(STAGES[stage])))}]}
        torch.save(meta, os.path.join(d, f"mp_rank_{stage:02d}_model_states.pt"))
    with open(os.path.join(root, "latest"), "w") as f:
        f.write(TAG)
    return full


def _resume(root: str, stages: int, dp: int, zero: int, threads: dict | None = None) -> list:
    layers = _layers()

    def fn(comm):
        if threads is not None:
            threads[comm.rank] = threading.get_ident()
        cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"},
                                  "zero_optimization": {"stage": zero}, "pipeline": {"stages": stages}},
                                 world_size=stages * dp)
        sm = fnzero.shard(fnzero.PipelineModule(copy.deepcopy(layers), torch.nn.functional.mse_loss), config=cfg,
                          comm=comm)
        state, client = load(root, like=sm.init_state())
        assert client == {} and int(state.step) == int(state.opt_state.count) == 5
        return state

    return simulated_world(stages * dp).run(fn)


def _one_stage_like():
    cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"}}, world_size=1)
    return fnzero.shard(fnzero.PipelineModule(_layers(), torch.nn.functional.mse_loss), config=cfg).init_state()


def _by_name(states: list, field: str) -> dict[str, torch.Tensor]:
    """{name: whole tensor} of `field`, each unit's shards joined over the ranks of its stage."""
    out = {}
    for st in states:
        for u in st.sharding.plan.units:
            t = (st.params if field == "fp32" else getattr(st.opt_state, field))[u.name]
            lo = 0 if t.numel() == u.padded_numel else u.shard_range(st.sharding.rank)[0]
            buf = out.setdefault(u.name, (u, torch.zeros(u.padded_numel)))[1]
            buf[lo:lo + t.numel()] = t
    return {s.name: buf[s.offset:s.offset + s.numel].view(s.shape) for u, buf in out.values() for s in u.slots}


@pytest.mark.parametrize("zero,stages,dp,stage", [(1, 2, 1, 0), (1, 2, 2, 1), (1, 1, 1, 3), (0, 2, 1, 1),
                                                  (0, 1, 2, 2)])
def test_a_pipeline_checkpoint_lands_by_name_in_one_stage_or_two(tmp_path, zero, stages, dp, stage):
    full = _pipeline(str(tmp_path / "ds"), zero=zero)
    states = _resume(str(tmp_path / "ds"), stages, dp, stage)
    for f in FIELDS:
        got = _by_name(states, f)
        assert sorted(got) == sorted(full[f]), f
        assert all(torch.equal(got[n], full[f][n]) for n in got), f
    if stages == 2:  # each rank holds its stage's layers only
        assert sorted(s.name for u in states[0].sharding.plan.units for s in u.slots) == ["0.bias", "0.weight"]


def test_a_pipeline_stage_opens_only_its_stages_optimizer_files(tmp_path, monkeypatch):
    """fnzero's stages cut the layers as DeepSpeed's did: each rank of a two-stage state opens the
    optimizer files of its stage only (plus data-parallel rank 0's of the first stage, whose small
    fields `describe` reads at ZeRO-1/2; no tensor of it) and copies its layers' weights and
    moments out of them, nothing more."""
    _pipeline(str(tmp_path / "ds"))
    opened, copied = record_reads(monkeypatch)
    threads: dict[int, int] = {}
    states = _resume(str(tmp_path / "ds"), 2, 1, 1, threads)
    describe_reads = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    for rank, ident in threads.items():
        stage = states[rank].sharding.pp.stage_index
        mine = [f"zero_pp_rank_{r}_mp_rank_{stage:02d}_optim_states.pt" for r in range(2)]
        assert sorted(set(opened[ident]) - {describe_reads}) == sorted(set(mine) - {describe_reads}), rank
        assert copied[ident] == 3 * sum(math.prod(s) for s in STAGES[stage].values()), rank


def test_a_stage0_pipeline_whose_optimizers_miss_parameters_is_refused(tmp_path):
    """Which layers a stage ran is not recorded: the stages' optimizers must account for every
    parameter of the layer files, in order."""
    _pipeline(str(tmp_path / "ds"), zero=0)
    p = str(tmp_path / "ds" / TAG / "mp_rank_01_model_states.pt")
    sd = torch.load(p, weights_only=True)
    sd["optimizer"]["param_groups"][0]["params"] = [0, 1]
    del sd["optimizer"]["state"][2]
    torch.save(sd, p)
    with pytest.raises(CheckpointError, match=r"the pipeline stages' optimizers hold 4 parameters, the layer files 5"):
        load(str(tmp_path / "ds"), like=_one_stage_like())


def test_a_tensor_parallel_checkpoint_is_refused_by_name(tmp_path):
    _pipeline(str(tmp_path / "ds"))
    for stage in range(2):
        p = str(tmp_path / "ds" / TAG / f"mp_rank_{stage:02d}_model_states.pt")
        sd = torch.load(p, weights_only=True)
        sd["checkpoint_parallel_dimensions"] = {"pp_degree": 1, "tp_degree": 2}
        torch.save(sd, p)
    with pytest.raises(CheckpointError, match=r"resuming from a tensor-parallel DeepSpeed checkpoint \(tp degree 2\) "
                                              r"is not implemented yet"):
        load(str(tmp_path / "ds"), like=_one_stage_like())
