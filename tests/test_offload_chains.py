"""Offload is an implementation of a chain (specs/offload.md §Chains): a user's elementwise chain
with `offload_optimizer` runs where the config puts its state — on host tensors (cpu) or streamed
through NVMe files a sub-group at a time (nvme) — through the same `update` as on the device, and
equals the chain with its state in device memory; a transform that reads whole tensors is refused
by name."""

from __future__ import annotations

import copy

import pytest
import torch

import fnzero
from fnzero import optim
from fnzero.testing import MLP, simulated_world

WORLD, STEPS = 2, 3


def _chain():
    # Every kind of state the store must carry: Adam's moments, a momentum buffer started from the
    # first gradient, a sum of squares that does not start at zero; the step's global norm and lr.
    return optim.chain(optim.clip_by_global_norm(0.5), optim.scale_by_adam(b1=0.8), optim.trace(0.5),
                       optim.scale_by_rss(initial_accumulator_value=0.1), optim.add_decayed_weights(0.01),
                       optim.scale_by_learning_rate(3e-2))


def _config(stage, offload, tmp, precision):
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0, "sub_group_size": 16}
    if offload is not None:
        device = offload.split("+")[0]
        zero["offload_optimizer"] = {"device": device, **({"nvme_path": str(tmp)} if device == "nvme" else {})}
        if offload == "nvme+params":
            zero["offload_param"] = {"device": "nvme", "nvme_path": str(tmp)}
    c = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
         "zero_optimization": zero,
         "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 3e-2, "warmup_num_steps": 2}}}
    if precision == "bf16":
        c["bf16"] = {"enabled": True}
    return fnzero.load_config(c, world_size=WORLD)


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return MLP([5, 7, 3]).to(dtype)


def _loss(sm, params, batch):
    x, y = batch
    dtype = next(iter(params.values())).dtype
    return torch.nn.functional.mse_loss(sm.apply(params, x.to(dtype)).double(), y.double())


def _train(stage, offload, tmp, dtype, precision="fp32", donate=False, make=_chain):
    """Every rank's losses and gathered parameters after STEPS steps of the chain."""
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 5, generator=gen, dtype=dtype), torch.randn(8, 3, generator=gen, dtype=dtype))
               for _ in range(STEPS)]
    model = _model(dtype)

    def rank(comm):
        cfg = _config(stage, offload, tmp, precision)
        sm = fnzero.shard(copy.deepcopy(model), config=cfg, comm=comm)  # (the simulated ranks share one RNG)
        tx = make()
        state = sm.init_state(optimizer=tx)
        step = fnzero.train_step(lambda p, b: _loss(sm, p, b), cfg, optimizer=tx, donate=donate)
        losses = []
        for x, y in batches:
            rows = slice(4 * comm.rank, 4 * comm.rank + 4)
            state, m = step(state, (x[rows], y[rows]))
            losses.append(m["loss"])
        # The compute parameters: a run with a master in memory would otherwise gather the master.
        return losses, sm.gather(state.params)

    return simulated_world(WORLD).run(rank)[0]


def _assert_same(got, want, rtol, atol, what):
    for n, w in want[1].items():
        torch.testing.assert_close(got[1][n].double(), w.double(), rtol=rtol, atol=atol, msg=lambda m: f"{what} {n}: {m}")
    assert got[0] == pytest.approx(want[0], rel=max(rtol, 1e-15)), what


@pytest.mark.parametrize("make", [_chain, lambda: optim.adamw(lr=3e-2, weight_decay=0.01)], ids=["chain", "Optimizer"])
def test_a_chain_on_the_host_equals_the_chain_on_the_device_in_float64(tmp_path, make):
    # offload cpu: the optimizer's own update runs on the host master (here the fp64 parameters'
    # own host shards), the step's factor and global norm given as on the device.
    want = _train(2, None, tmp_path, torch.float64, make=make)
    _assert_same(_train(2, "cpu", tmp_path, torch.float64, make=make), want, 1e-9, 1e-12, "cpu offload, float64")


@pytest.mark.parametrize("stage,precision,offload", [(2, "fp32", "nvme"), (3, "bf16", "nvme"), (3, "bf16", "nvme+params")])
def test_a_chain_streamed_through_nvme_files_equals_it_on_the_host_and_the_device(tmp_path, stage, precision, offload):
    # The store keeps fp32 masters, so fp32/bf16 runs: a sub-group of 16 elements cuts every unit
    # into several, each updated by the chain on its own (the chain is elementwise), the step
    # counts kept in memory. Elementwise arithmetic does not depend on the cut: bit for bit.
    device = _train(stage, None, tmp_path / "d", torch.float32, precision)
    host = _train(stage, "cpu", tmp_path / "c", torch.float32, precision, donate=True)
    nvme = _train(stage, offload, tmp_path / "n", torch.float32, precision)
    _assert_same(host, device, 0, 0, f"cpu offload, stage {stage} {precision}")
    _assert_same(nvme, device, 0, 0, f"{offload}, stage {stage} {precision}")


def test_a_chain_with_nvme_checkpoints_in_the_host_layout_and_resumes(tmp_path):
    # The store's files and the resident step counts are read back into the chain's own state
    # structure: an NVMe checkpoint after 2 steps, loaded into a CPU-offload run of the same chain,
    # continues to what 4 steps straight through the store give, bit for bit.
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 5, generator=gen), torch.randn(4, 3, generator=gen)) for _ in range(4)]

    def rank(comm):
        def run(offload, sub, steps, load=False, save=False):
            cfg = _config(2, offload, tmp_path / sub, "fp32")
            sm = fnzero.shard(_model(), config=cfg, comm=comm)
            state = sm.init_state(optimizer=_chain())
            if load:
                state, _ = fnzero.checkpoint.load(str(tmp_path / "ckpt"), like=state)
            step = fnzero.train_step(lambda p, b: _loss(sm, p, b), cfg, optimizer=_chain())
            for b in steps:
                state, _ = step(state, b)
            if save:
                fnzero.checkpoint.save(str(tmp_path / "ckpt"), state)
            return sm.gather(state)

        straight = run("nvme", "a", batches)
        run("nvme", "b", batches[:2], save=True)
        return straight, run("cpu", "c", batches[2:], load=True)

    straight, resumed = simulated_world(1).run(rank)[0]
    for n, want in straight.items():
        assert torch.equal(resumed[n], want), n


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_a_chain_that_reads_whole_tensors_is_refused_naming_the_transform(tmp_path, device):
    cfg = _config(2, device, tmp_path, "fp32")
    lamb_like = optim.chain(optim.scale_by_adam(), optim.scale_by_trust_ratio(max_coeff=5.0),
                            optim.scale_by_learning_rate(1e-3))
    with pytest.raises(fnzero.ShardingError, match=r"chain's scale_by_trust_ratio\(max_coeff=5.0\) reads whole tensors"):
        fnzero.train_step(lambda p, b: 0, cfg, optimizer=lamb_like)
    sm = fnzero.shard(MLP([3, 2]), config=_config(2, device, tmp_path, "fp32"))
    with pytest.raises(fnzero.ShardingError, match="scale_by_trust_ratio"):
        sm.init_state(optimizer=lamb_like)
    with pytest.raises(fnzero.ShardingError, match="optimizer= given is not elementwise"):
        sm.init_state(optimizer=optim.lamb())
    assert sm.init_state(optimizer=_chain()) is not None  # refused before anything was handed over
