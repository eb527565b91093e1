"""ZeRO-Infinity in the training step (specs/offload.md §Step): with offload_optimizer device nvme
the master weights and moments live in files, and the run equals the CPU-offload run bit for bit
(the same C kernel, streamed in sub-groups)."""

import pytest
import torch

import _worlds as W
import fnzero
from fnzero.memory import model_state_bytes
from fnzero.testing._threads import simulated_world


def _run(stage, precision, offload, tmp_path, world=2, steps=3, sub_group=1000, keep_state=False):
    oo = {"device": offload}
    if offload == "nvme":
        oo["nvme_path"] = str(tmp_path)
    extra = {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                   "sub_group_size": sub_group, "offload_optimizer": oo}}
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


def test_checkpointing_an_nvme_run_says_it_is_not_supported(tmp_path):
    r = _run(2, "fp32", "nvme", tmp_path / "nvme", world=1, steps=1, keep_state=True)[0]
    with pytest.raises(fnzero.CheckpointError, match="nvme"):
        fnzero.checkpoint.save(str(tmp_path / "ckpt"), r["state"])
