"""`fnzero.checkpoint.load` of a DeepSpeed MoE checkpoint built here without DeepSpeed
(specs/checkpoint-format.md §DeepSpeed, "Weights" and "Resuming in fnzero"): ZeRO-2 on 4 ranks with
6 experts over 2 expert-parallel ranks, so the expert group is partitioned over the 2
expert-data-parallel ranks (`partition_count` 2, the cut inside an expert) while the other group
is over all 4; each rank names its experts locally (`deepspeed_experts.0` ... `.2`), the expert
files by global id. The weights
and both Adam moments land by global id in fnzero's own MoE layer, without expert parallelism and
with it."""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
from test_checkpoint_deepspeed import _by_saved_name

import fnzero
from fnzero.checkpoint import load
from fnzero.moe import MoE
from fnzero.testing._threads import simulated_world

TAG = "global_step7"
FIELDS = ("fp32", "exp_avg", "exp_avg_sq")
H, WORLD, EP = 4, 4, 2
DENSE = {"inp.weight": (H, H), "inp.bias": (H,), "moe.deepspeed_moe.gate.wg.weight": (6, H), "out.weight": (H, H),
         "out.bias": (H,)}  # 64 elements: partitions of 16 at 4 ranks
EXPERT = "moe.deepspeed_moe.experts.deepspeed_experts"
LOCAL = {f"{EXPERT}.{i}.{p}": s for i in range(3) for p, s in (("weight", (H, H)), ("bias", (H,)))}  # 60: 2 x 30


class Net(torch.nn.Module):
    def __init__(self, ep: int):
        super().__init__()
        self.inp = torch.nn.Linear(H, H)
        self.moe = MoE(hidden_size=H, expert=torch.nn.Linear(H, H), num_experts=6, ep_size=ep, k=1, min_capacity=1)
        self.out = torch.nn.Linear(H, H)


def _global(name: str, e: int) -> str:
    i, rest = name[len(EXPERT) + 1:].split(".", 1)
    return f"{EXPERT}.{3 * e + int(i)}.{rest}"


def _partition(flat: dict, names: list[str], parts: int, p: int, step: float) -> tuple[dict, int]:
    """Partition `p` of `parts` of the group `names` (each field end to end, padded to 2 x parts)."""
    total = sum(flat["fp32"][n].numel() for n in names)
    size = math.ceil(total / (2 * parts)) * 2
    cut = {f: torch.cat([*(flat[f][n].reshape(-1) for n in names), torch.zeros(size * parts - total)])
           [p * size:(p + 1) * size].clone() for f in FIELDS}
    pad = max(0, min(size, (p + 1) * size - total))
    return {"fp32": cut["fp32"][:size - pad], "state": {"step": torch.tensor(step), "exp_avg": cut["exp_avg"],
                                                         "exp_avg_sq": cut["exp_avg_sq"]}}, pad


def _moe_zero2(root: str) -> dict[str, dict[str, torch.Tensor]]:
    """The checkpoint's files; the whole tensors they hold by field and global name."""
    g = torch.Generator().manual_seed(2)
    names = list(DENSE) + [_global(n, e) for e in range(EP) for n in LOCAL]
    shapes = {**DENSE, **{_global(n, e): s for e in range(EP) for n, s in LOCAL.items()}}
    full = {f: {n: torch.randn(shapes[n], generator=g).abs() for n in names} for f in FIELDS}
    d = os.path.join(root, TAG)
    os.makedirs(d)
    for r in range(WORLD):
        e, p = r % EP, r // EP  # (expert-parallel rank, expert-data-parallel rank)
        flat = {f: {**full[f], **{n: full[f][_global(n, e)] for n in LOCAL}} for f in FIELDS}  # (named locally)
        dense, pad0 = _partition(flat, list(DENSE), WORLD, r, 7.0)
        experts, pad1 = _partition(flat, list(LOCAL), WORLD // EP, p, 7.0)
        osd = {"zero_stage": 2, "single_partition_of_fp32_groups": [dense["fp32"], experts["fp32"]],
               "base_optimizer_state": {"state": {0: dense["state"], 1: experts["state"]},
                                        "param_groups": [{"params": [0]}, {"params": [1], "moe": True}]},
               "group_paddings": [pad0, pad1], "partition_count": [WORLD, WORLD // EP],
               "param_alignment_paddings": [[0] * len(DENSE), [0] * len(LOCAL)]}
        torch.save({"optimizer_state_dict": osd}, os.path.join(d, f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))
    for i in range(6):
        torch.save({n: full["fp32"][n] for n in names if n.startswith(f"{EXPERT}.{i}.")},
                   os.path.join(d, f"layer_0_expert_{i}_mp_rank_00_model_states.pt"))
    torch.save({"module": {n: full["fp32"][n] for n in DENSE}, "buffer_names": [], "optimizer": None,
                "param_shapes": [dict(DENSE), dict(LOCAL)], "frozen_param_shapes": {}, "shared_params": {},
                "lr_scheduler": {"last_batch_iteration": 6}, "skipped_steps": 0, "global_steps": 7,
                "dp_world_size": WORLD, "mp_world_size": 1, "num_experts": [6],
                "ds_config": {"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW"}}},
               os.path.join(d, "mp_rank_00_model_states.pt"))
    with open(os.path.join(root, "latest"), "w") as f:
        f.write(TAG)
    return full


@pytest.mark.parametrize("stage,world,ep", [(1, 1, 1), (3, 2, 2), (2, 4, 2), (0, 6, 6)])
def test_experts_land_by_global_id_with_and_without_expert_parallelism(tmp_path, stage, world, ep):
    full = _moe_zero2(str(tmp_path / "ds"))
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Net(ep)  # (built once, copied by each rank: the simulated ranks are threads sharing one RNG)

    def fn(comm):
        cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"},
                                  "zero_optimization": {"stage": stage}}, world_size=world // ep)
        sm = fnzero.shard(copy.deepcopy(model), config=cfg, comm=comm, mesh=fnzero.make_mesh(comm, ep=ep))
        state, client = load(str(tmp_path / "ds"), like=sm.init_state())
        assert client == {} and int(state.step) == 7
        return state

    states = simulated_world(world).run(fn)
    for f, field in zip(FIELDS, ("params", "exp_avg", "exp_avg_sq")):
        got = _by_saved_name(states, field)
        assert sorted(got) == sorted(full[f]), f
        assert all(torch.equal(got[n], full[f][n]) for n in got), f
