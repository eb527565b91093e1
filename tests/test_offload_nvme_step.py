"""ZeRO-Infinity in the training step (specs/offload.md §Step): with offload_optimizer device nvme
the master weights and moments live in files, and the run equals the CPU-offload run bit for bit
(the same C kernel, streamed in sub-groups)."""

import pytest
import torch

import _worlds as W
import fnzero
from fnzero.memory import model_state_bytes
from fnzero.testing._threads import simulated_world


def _zero(stage, offload, path, sub_group=1000):
    """The zero_optimization block: offload "cpu", "nvme", or "nvme+params" (optimizer state and
    stage-3 parameter shards on NVMe)."""
    oo = {"device": offload.split("+")[0]}
    z = {"stage": stage, "stage3_param_persistence_threshold": 0, "sub_group_size": sub_group, "offload_optimizer": oo}
    if offload.startswith("nvme"):
        oo["nvme_path"] = str(path)
    if offload == "nvme+params":
        z["offload_param"] = {"device": "nvme", "nvme_path": str(path)}
    return {"zero_optimization": z}


def _run(stage, precision, offload, tmp_path, world=2, steps=3, sub_group=1000, keep_state=False):
    extra = _zero(stage, offload, tmp_path, sub_group)
    def rank_fn(comm):
        r = W.train_fnzero("gpt", stage, steps, comm, k=2, dtype=torch.float32, precision=precision,
                           extra=extra, donate=True, return_state=True)
        # The compute parameters (a CPU-offload run also keeps an fp32 master in memory; NVMe on disk).
        r["compute_params"] = r["sm"].gather(r["state"].params)
        if not keep_state:
            del r["state"], r["sm"]
        return r

    return simulated_world(world).run(rank_fn)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_nvme_offload_equals_cpu_offload_bit_for_bit(stage, precision, tmp_path):
    cpu = _run(stage, precision, "cpu", tmp_path)[0]
    nvme = _run(stage, precision, "nvme", tmp_path)[0]
    assert nvme["losses"] == cpu["losses"]
    W.assert_close_tree(nvme["compute_params"], cpu["compute_params"], rtol=0, atol=0, what=f"nvme stage {stage} {precision}")


def test_nvme_state_holds_no_optimizer_tensors_in_memory(tmp_path):
    (r0, _) = _run(3, "bf16", "nvme", tmp_path, steps=1, keep_state=True)
    state = r0["state"]
    counted = model_state_bytes(state)
    assert counted.master == 0 and counted.optimizer == 0  # 12Ψ/N moved to disk
    assert state.opt_state.store.bytes_on_disk >= 12 * sum(u.shard_numel for u in state.plan.units)


def test_an_old_state_cannot_step_again(tmp_path):
    def rank_fn(comm):
        cfg = W.config(2, world=1, extra={"zero_optimization": {"stage": 2, "offload_optimizer": {
            "device": "nvme", "nvme_path": str(tmp_path)}}})
        model = W.make_model("mlp:3,4,2", torch.float32)
        sm = fnzero.shard(model, config=cfg, comm=comm)
        s0 = sm.init_state()
        step = fnzero.train_step(lambda p, b: W.loss_of("mlp", sm.apply(p, b[0]), b[1]), cfg)
        batch = (torch.randn(2, 3), torch.randn(2, 2))
        s1, _ = step(s0, batch)
        with pytest.raises(fnzero.ShardingError, match="only the newest state"):
            step(s0, batch)
        step(s1, batch)

    simulated_world(1).run(rank_fn)


def _resume_run(tmp_path, stage, precision, save_with, load_with, world=2, k=2):
    """Rank function: 2k steps straight with `save_with` offload; and k steps, save, then a fresh
    run with `load_with` offload that loads the checkpoint and takes the other k steps."""
    def extra(offload, sub):
        return _zero(stage, offload, tmp_path / sub)

    def rank_fn(comm):
        def run(offload, sub, steps, start=0, ckpt_in=None, ckpt_out=None):
            cfg = W.config(stage, 2, 2, world, 1.0, precision, extra(offload, sub))
            model = W.make_model("gpt", torch.float32).float()
            sm = fnzero.shard(model, config=cfg, comm=comm)
            state = sm.init_state()
            if ckpt_in is not None:
                state, _ = fnzero.checkpoint.load(ckpt_in, like=state)
            step = fnzero.train_step(lambda p, b: W.loss_of("gpt", sm.apply(p, b[0]), b[1]), cfg, donate=True)
            losses = []
            for s in range(start, start + steps):
                x, y = W.global_batch("gpt", s, world, 2, 2, torch.float32)
                state, m = step(state, (x[:, comm.rank].flatten(0, 1), y[:, comm.rank].flatten(0, 1)))
                losses.append(m["loss"])
            if ckpt_out is not None:
                fnzero.checkpoint.save(ckpt_out, state)
            return losses, sm.gather(state.params)

        straight = run(save_with, "a", 2 * k)
        first = run(save_with, "b", k, ckpt_out=str(tmp_path / "ckpt"))
        resumed = run(load_with, "c", k, start=k, ckpt_in=str(tmp_path / "ckpt"))
        return straight, first, resumed

    return simulated_world(world).run(rank_fn)


@pytest.mark.parametrize("save_with,load_with,stage,precision", [
    (a, b, stage, precision)
    for stage, precision in [(2, "fp32"), (3, "bf16")]
    for a, b in [("nvme", "nvme"), ("nvme", "cpu"), ("cpu", "nvme")]
] + [("nvme+params", "cpu", 3, "fp32"), ("cpu", "nvme+params", 3, "bf16"), ("nvme+params", "nvme+params", 3, "bf16")])
def test_nvme_runs_checkpoint_and_resume_bit_for_bit(tmp_path, stage, precision, save_with, load_with):
    # The store's master and moments go into an ordinary checkpoint (the CPU-offload layout), and
    # come back into a new run's store: resuming equals training straight through, bit for bit.
    (straight, first, resumed), _ = _resume_run(tmp_path, stage, precision, save_with, load_with)
    assert first[0] + resumed[0] == straight[0]
    W.assert_close_tree(resumed[1], straight[1], rtol=0, atol=0, what=f"{save_with}->{load_with}")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_nvme_param_offload_equals_in_memory_params_bit_for_bit(precision, tmp_path):
    # specs/offload.md §Parameters: shards read from the master file, rounded to the compute dtype,
    # are the bits the fused copy-out would have kept in memory.
    held = _run(3, precision, "nvme", tmp_path / "a")[0]
    (r0, _) = _run(3, precision, "nvme+params", tmp_path / "b", keep_state=True)
    assert r0["losses"] == held["losses"]
    W.assert_close_tree(r0["compute_params"], held["compute_params"], rtol=0, atol=0, what=f"params on nvme {precision}")
    state, plan = r0["state"], r0["state"].sharding.plan
    sharded = [u for u in plan.units if plan.params_sharded(u)]
    assert sharded and all(state.params[u.name].untyped_storage().nbytes() <= 4 for u in sharded)
    assert model_state_bytes(state).params <= 4 * len(plan.units)  # the 2-4Ψ/N of parameters left memory
    assert state.opt_state.holds_params


@pytest.mark.parametrize("zero,match", [
    ({"offload_optimizer": {"device": "cpu"}}, "offload_optimizer.device` is 'cpu'"),
    ({}, "offload_optimizer.device` is not set"),
    ({"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/elsewhere"}}, "differs from"),
])
def test_param_offload_to_nvme_says_what_it_needs(tmp_path, zero, match):
    # specs/offload.md §Parameters: refused when the config is loaded (and `fnzero config validate`).
    with pytest.raises(fnzero.ConfigError, match=match):
        W.config(3, extra={"zero_optimization": {"stage": 3, **zero,
                                                 "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}})


def test_param_offload_to_nvme_without_an_optimizer_block_loads_and_init_state_says_what_it_needs(tmp_path):
    # specs/offload.md §Parameters: a config without an optimizer (ZeRO-Inference's) loads; a state to
    # train from it needs the optimizer on NVMe, which holds the trainable shards.
    cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}})
    sm = fnzero.shard(torch.nn.Linear(4, 4), config=cfg)
    with pytest.raises(fnzero.ShardingError, match="needs offload_optimizer device 'nvme'"):
        sm.init_state(optimizer=fnzero.optim.adamw(lr=1e-3))
