"""`fnzero.checkpoint.load` of a DeepSpeed ZeRO stage-0 checkpoint built here without DeepSpeed
(specs/checkpoint-format.md §DeepSpeed, "Resuming in fnzero"): the one model file's `module` and
its `optimizer`, a torch AdamW `state_dict()` keyed by parameter index, land by name in a state of
another world size and stage; a parameter the optimizer was given but never stepped (frozen) is
skipped by index, and a state whose shapes do not fit the module is refused, named."""

from __future__ import annotations

import os

import pytest
import torch
from test_checkpoint_ds_resume import Net

import fnzero
from fnzero import CheckpointError
from fnzero.checkpoint import load
from fnzero.testing._threads import simulated_world

TAG = "global_step2"


def _stage0(root: str, frozen: bool) -> tuple[dict, dict]:
    """Two AdamW steps of `Net` in torch, saved as DeepSpeed's stage 0 saves them; (its weights,
    its optimizer state by name)."""
    model = Net()
    if frozen:
        model.b.requires_grad_(False)  # (still given to the optimizer, as model.parameters() gives it)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for i in range(2):
        sum(((p - i) ** 2).sum() for p in model.parameters() if p.requires_grad).backward()
        opt.step()
        opt.zero_grad()
    d = os.path.join(root, TAG)
    os.makedirs(d)
    torch.save({"module": model.state_dict(), "buffer_names": ["buf"], "optimizer": opt.state_dict(),
                "param_shapes": None, "frozen_param_shapes": None, "shared_params": None,
                "lr_scheduler": {"last_batch_iteration": 1}, "skipped_steps": 0, "global_steps": 2,
                "global_samples": 4, "dp_world_size": 1, "mp_world_size": 1, "ds_version": "0.19.8",
                "ds_config": {"optimizer": {"type": "AdamW"}}}, os.path.join(d, "mp_rank_00_model_states.pt"))
    with open(os.path.join(root, "latest"), "w") as f:
        f.write(TAG)
    names = [n for n, _ in model.named_parameters()]
    state = {m: {names[i]: s[m] for i, s in opt.state_dict()["state"].items()} for m in ("exp_avg", "exp_avg_sq")}
    return {n: p.detach().clone() for n, p in model.named_parameters()}, state


def _world(root: str, stage: int, world: int, frozen: bool):
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}

    def fn(comm):
        model = Net()
        if frozen:
            model.b.requires_grad_(False)
        return load(root, like=fnzero.shard(model, config=fnzero.load_config(cfg, world_size=world),
                                            comm=comm).init_state())[0]

    return simulated_world(world).run(fn)


@pytest.mark.parametrize("stage,world,frozen", [(3, 2, False), (1, 1, True), (2, 2, True)])
def test_a_stage0_checkpoint_resumes_by_name(tmp_path, stage, world, frozen):
    weights, moments = _stage0(str(tmp_path / "ds"), frozen)
    states = _world(str(tmp_path / "ds"), stage, world, frozen)
    s0, plan = states[0], states[0].sharding.plan
    assert (int(s0.step), int(s0.opt_state.count)) == (2, 2)
    for u in plan.units:
        for field, want in (("params", weights), *((m, moments[m]) for m in moments)):
            parts = [(s.params if field == "params" else getattr(s.opt_state, field))[u.name] for s in states]
            flat = parts[0] if parts[0].numel() == u.padded_numel else torch.cat(parts)
            for sl in u.slots:
                assert torch.equal(flat[sl.offset:sl.offset + sl.numel].view(sl.shape), want[sl.name]), (field, sl.name)
    if frozen:
        assert torch.equal(s0.frozen["b.weight"], weights["b.weight"])


def test_a_stage0_state_that_does_not_fit_the_module_is_refused(tmp_path):
    root = str(tmp_path / "ds")
    _stage0(root, frozen=False)
    p = os.path.join(root, TAG, "mp_rank_00_model_states.pt")
    sd = torch.load(p, weights_only=True)
    sd["optimizer"]["state"][1]["exp_avg"] = torch.zeros(4)
    torch.save(sd, p)
    like = fnzero.shard(Net(), config=fnzero.load_config({"train_micro_batch_size_per_gpu": 1,
                                                          "optimizer": {"type": "AdamW"}})).init_state()
    with pytest.raises(CheckpointError, match=r"optimizer state 1's 'exp_avg' is \(4,\), parameter 'a.bias'"):
        load(root, like=like)
