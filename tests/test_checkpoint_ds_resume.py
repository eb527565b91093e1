"""`fnzero.checkpoint.load` of a DeepSpeed ZeRO-2 checkpoint built here without DeepSpeed
(specs/checkpoint-format.md §DeepSpeed, "Resuming in fnzero"): the fp32 weights, both Adam moments
(cut from each rank's padded partition), the step counts and the client state land by parameter
name in a state of another world size and stage, and what does not fit is refused, named."""

from __future__ import annotations

import math
import os
from collections import OrderedDict

import pytest
import torch

import fnzero
from fnzero import CheckpointError
from fnzero.checkpoint import load
from fnzero.testing._threads import simulated_world

SHAPES = {"a.weight": (3, 5), "a.bias": (3,), "b.weight": (2, 4)}  # 26 elements: padded to 28 at W=2
TAG = "global_step5"
FIELDS = ("fp32", "exp_avg", "exp_avg_sq")


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(5, 3)
        self.b = torch.nn.Linear(4, 2, bias=False)
        self.register_buffer("buf", torch.zeros(3))
        with torch.no_grad():  # the same initial weights on every simulated rank (threads share one RNG)
            for i, p in enumerate(self.parameters()):
                p.copy_(torch.linspace(-1, 1, p.numel()).view(p.shape) * (i + 1))


def _cfg(world: int = 1) -> fnzero.Config:
    return fnzero.load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"}},
                              world_size=world)


def _model_states(shapes=SHAPES, **extra) -> dict:
    module = OrderedDict((n, torch.zeros(s)) for n, s in shapes.items())
    module["buf"] = torch.arange(3.0)
    return {"module": module, "buffer_names": ["buf"], "optimizer": None,
            "param_shapes": [OrderedDict((n, torch.Size(s)) for n, s in shapes.items())],
            "frozen_param_shapes": None, "shared_params": {}, "lr_scheduler": {"last_batch_iteration": 4},
            "skipped_steps": 0, "global_steps": 5, "global_samples": 10, "dp_world_size": 2, "mp_world_size": 1,
            "ds_config": {"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW"}},
            "ds_version": "0.19.8", "epoch": 3, **extra}


def _zero2(root: str, world: int = 2, step=5.0, **meta) -> dict[str, dict[str, torch.Tensor]]:
    """A float32 ZeRO-2 checkpoint as DeepSpeed lays it out (rigid optimizer state: each moment is
    the rank's whole partition, padding included; the fp32 partition without it); the whole
    tensors it holds by field and name."""
    g = torch.Generator().manual_seed(1)
    full = {f: {n: torch.randn(s, generator=g).abs() for n, s in SHAPES.items()} for f in FIELDS}
    total = sum(math.prod(s) for s in SHAPES.values())
    padded_len = math.ceil(total / (2 * world)) * 2 * world
    part = padded_len // world
    flat = {f: torch.cat([*(t.reshape(-1) for t in full[f].values()), torch.zeros(padded_len - total)]) for f in FIELDS}
    d = os.path.join(root, TAG)
    os.makedirs(d)
    for r in range(world):
        pad = max(0, min(part, (r + 1) * part - total))
        cut = {f: flat[f][r * part: (r + 1) * part].clone() for f in FIELDS}
        base = {"state": {0: {"step": torch.tensor(step), "exp_avg": cut["exp_avg"], "exp_avg_sq": cut["exp_avg_sq"]}},
                "param_groups": [{"lr": 1e-3, "params": [0]}]}
        osd = {"zero_stage": 2, "single_partition_of_fp32_groups": [cut["fp32"][: part - pad]],
               "base_optimizer_state": base, "group_paddings": [pad], "partition_count": [world],
               "param_alignment_paddings": [[0] * len(SHAPES)]}
        torch.save({"optimizer_state_dict": osd, "ds_version": "0.19.8"},
                   os.path.join(d, f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))
    torch.save(_model_states(**meta), os.path.join(d, "mp_rank_00_model_states.pt"))
    with open(os.path.join(root, "latest"), "w") as f:
        f.write(TAG)
    return full


def _by_name(states, field: str) -> dict[str, torch.Tensor]:
    """{name: whole tensor} of `field` gathered from every rank's state by its plan."""
    plan, out = states[0].sharding.plan, {}
    for u in plan.units:
        parts = [(s.params if field == "fp32" else getattr(s.opt_state, field))[u.name] for s in states]
        flat = parts[0] if parts[0].numel() == u.padded_numel else torch.cat(parts)
        for s in u.slots:
            out[s.name] = flat[s.offset:s.offset + s.numel].reshape(s.shape)
    return out


@pytest.mark.parametrize("stage,world", [(1, 1), (3, 2), (2, 2), (0, 1)])
def test_weights_moments_and_steps_land_by_name(tmp_path, stage, world):
    full = _zero2(str(tmp_path / "ds"))

    def fn(comm):
        like = fnzero.shard(Net(), stage=stage, config=_cfg(world), comm=comm).init_state()
        return load(str(tmp_path / "ds"), like=like)

    results = simulated_world(world).run(fn)
    states = [s for s, _ in results]
    for f in FIELDS:
        got = _by_name(states, f)
        assert set(got) == set(SHAPES) and all(torch.equal(got[n], full[f][n]) for n in SHAPES), f
    s = states[0]
    assert int(s.step) == 5 and int(s.opt_state.count) == 5 and s.opt_state.count.dtype == torch.int64
    assert torch.equal(s.buffers["buf"], torch.arange(3.0))
    assert results[0][1] == {"epoch": 3}  # the client state save_checkpoint was given


def test_the_tag_directory_loads_too(tmp_path):
    full = _zero2(str(tmp_path / "ds"))
    like = fnzero.shard(Net(), stage=2, config=_cfg()).init_state()
    s, _ = load(str(tmp_path / "ds" / TAG), like=like)
    assert torch.equal(_by_name([s], "exp_avg")["a.bias"], full["exp_avg"]["a.bias"])


class WithRotary(Net):
    """A buffer registered persistent=False (as a Llama's rotary `inv_freq`): DeepSpeed's files never
    hold it (its `state_dict` and `buffer_names` leave it out), so the state keeps the model's own."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", torch.linspace(1.0, 0.1, 4), persistent=False)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_non_persistent_buffer_keeps_the_models_value(tmp_path, stage):
    full = _zero2(str(tmp_path / "ds"))
    like = fnzero.shard(WithRotary(), stage=stage, config=_cfg()).init_state()
    s, _ = load(str(tmp_path / "ds"), like=like)
    assert torch.equal(s.buffers["inv_freq"], torch.linspace(1.0, 0.1, 4))
    assert torch.equal(s.buffers["buf"], torch.arange(3.0))
    assert torch.equal(_by_name([s], "exp_avg")["a.weight"], full["exp_avg"]["a.weight"])


class Other(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(5, 4)
        self.c = torch.nn.Linear(4, 2, bias=False)
        self.register_buffer("buf", torch.zeros(3))


@pytest.mark.parametrize("case,match", [
    ("model", r"does not hold the model.*'c\.weight'.*'b\.weight'.*'a\.weight'"),
    ("optimizer", r"optimizer is Lamb; only Adam and AdamW"),
    ("steps", r"optimizer's step 5 is not global_steps 7 less skipped_steps 0"),
    ("schedule", r"last_batch_iteration 2 is not the optimizer's step 5 less one"),
    ("sgd_state", r"zero_pp_rank_1_mp_rank_00_optim_states.pt: optimizer state of group 0 has no flat 'exp_avg'.*only Adam and AdamW"),
    ("like_optimizer", r"into an Adam or AdamW state only; the state you are loading into holds"),
])
def test_what_does_not_fit_is_refused_and_named(tmp_path, case, match):
    root = str(tmp_path / "ds")
    meta = {"optimizer": {"ds_config": {"optimizer": {"type": "Lamb"}}}, "steps": {"global_steps": 7},
            "schedule": {"lr_scheduler": {"last_batch_iteration": 2}}}.get(case, {})
    _zero2(root, **meta)
    if case == "sgd_state":
        p = os.path.join(root, TAG, "zero_pp_rank_1_mp_rank_00_optim_states.pt")
        sd = torch.load(p, weights_only=True)
        sd["optimizer_state_dict"]["base_optimizer_state"]["state"][0] = {"step": torch.tensor(5.0),
                                                                         "momentum_buffer": torch.zeros(14)}
        torch.save(sd, p)
    model = Other() if case == "model" else Net()
    cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": {
        "type": "SGD" if case == "like_optimizer" else "AdamW", "params": {"lr": 0.1}}})
    like = fnzero.shard(model, stage=2, config=cfg).init_state()
    with pytest.raises(CheckpointError, match=match):
        load(root, like=like)
