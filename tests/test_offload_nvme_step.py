"""ZeRO-Infinity in the training step (specs/offload.md §Step): with offload_optimizer device nvme
the master weights and moments live in files, and the run equals the CPU-offload run bit for bit
(the same C kernel, streamed in sub-groups)."""

import errno

import pytest
import torch

import _worlds as W
import fnzero
from fnzero.memory import model_state_bytes
from fnzero.offload import NvmeStoreError
from fnzero.sharding.zero._param_store import is_placeholder, sources_of
from fnzero.testing._threads import simulated_world


def _zero(stage, offload, path, sub_group=1000):
    """The zero_optimization block: `offload` is where the optimizer state goes ("cpu", "nvme", or
    "none": not offloaded), and with "+params" the stage-3 parameter shards go to NVMe too."""
    where, _, params = offload.partition("+")
    z = {"stage": stage, "stage3_param_persistence_threshold": 0, "sub_group_size": sub_group}
    if where != "none":
        z["offload_optimizer"] = {"device": where, **({"nvme_path": str(path)} if where == "nvme" else {})}
    if params:
        z["offload_param"] = {"device": "nvme", "nvme_path": str(path)}
    return {"zero_optimization": z}


def _run(stage, precision, offload, tmp_path, world=2, steps=3, sub_group=1000, keep_state=False, dtype=torch.float32):
    extra = _zero(stage, offload, tmp_path, sub_group)
    def rank_fn(comm):
        r = W.train_fnzero("gpt", stage, steps, comm, k=2, dtype=dtype, precision=precision,
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


@pytest.mark.parametrize("zero", ["optimizer", "params"])
def test_an_old_state_cannot_step_again(zero, tmp_path):
    # The optimizer's files, or the parameter shards' own (the optimizer on the cpu), change in place.
    def rank_fn(comm):
        nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
        block = ({"stage": 2, "offload_optimizer": nvme} if zero == "optimizer" else
                 {"stage": 3, "stage3_param_persistence_threshold": 0, "offload_optimizer": {"device": "cpu"},
                  "offload_param": nvme})
        cfg = W.config(2, world=1, extra={"zero_optimization": block})
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
] + [("nvme+params", "cpu", 3, "fp32"), ("cpu", "nvme+params", 3, "bf16"), ("nvme+params", "nvme+params", 3, "bf16"),
       ("cpu+params", "cpu+params", 3, "bf16"), ("cpu+params", "nvme+params", 3, "fp32"),
       ("none+params", "none", 3, "fp32"), ("cpu", "none+params", 3, "bf16")])
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


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("optimizer,precision,dtype", [
    ("cpu", "fp32", torch.float32), ("cpu", "bf16", torch.float32),  # the host kernels are fp32's
    ("none", "fp32", torch.float64), ("none", "bf16", torch.float32),
])
def test_nvme_params_in_their_own_files_equal_in_memory_params_bit_for_bit(optimizer, precision, dtype, world,
                                                                            tmp_path):
    # specs/offload.md §Parameters: with the optimizer's master in memory (offload_optimizer cpu, or
    # none) the shards live in a parameter store of their own; the step writes the new master into it
    # in the compute dtype, the bits it would have kept in memory.
    held = _run(3, precision, optimizer, tmp_path / "a", world=world, dtype=dtype)[0]
    r0 = _run(3, precision, f"{optimizer}+params", tmp_path / "b", world=world, dtype=dtype, keep_state=True)[0]
    assert r0["losses"] == held["losses"]
    W.assert_close_tree(r0["compute_params"], held["compute_params"], rtol=0, atol=0,
                        what=f"params on nvme, optimizer {optimizer}, {precision}, {world} ranks")
    state, plan = r0["state"], r0["state"].sharding.plan
    sharded = [u for u in plan.units if plan.params_sharded(u)]
    assert sharded and all(state.params[u.name].untyped_storage().nbytes() <= 8 for u in sharded)
    assert model_state_bytes(state).params <= 8 * len(plan.units)  # the 2-8Ψ/N of parameters left memory
    # Their own files, under offload_param.nvme_path: a parameter store per rank, no optimizer store.
    stores = sorted(p.name for p in (tmp_path / "b").iterdir())
    assert stores and all(name.startswith("fnzero-rank") and "-params-" in name for name in stores), stores
    assert state.master is not None  # the optimizer's fp32 master, in memory


@pytest.mark.parametrize("offload_optimizer", [{"device": "cpu", "pin_memory": True}, None])
def test_deepspeed_examples_param_offload_to_nvme_loads_with_the_optimizer_on_cpu_or_in_memory(offload_optimizer,
                                                                                                 tmp_path):
    # DeepSpeedExamples' ds_config_nvme.json / ds_offload_nvme_aio.json: parameters on NVMe, the
    # optimizer on the CPU or not offloaded at all.
    zero = {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "pin_memory": True,
                                          "buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9}}
    if offload_optimizer is not None:
        zero["offload_optimizer"] = offload_optimizer
    cfg = W.config(3, extra={"zero_optimization": zero})
    assert cfg.zero_optimization.offload_param.device == "nvme"


def test_param_offload_to_nvme_beside_an_nvme_optimizer_elsewhere_says_what_it_needs(tmp_path):
    # specs/offload.md §Parameters: with the optimizer on NVMe its master file holds the shards, so
    # both blocks name one directory (refused when the config is loaded, and `fnzero config validate`).
    with pytest.raises(fnzero.ConfigError, match="differs from"):
        W.config(3, extra={"zero_optimization": {
            "stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "elsewhere")},
            "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}})


def test_param_offload_to_nvme_without_an_optimizer_block_loads_and_trains_with_any_optimizer(tmp_path):
    # specs/offload.md §Parameters: a config without an optimizer (ZeRO-Inference's) loads, and a
    # state trains from it with the optimizer's master in memory and the shards in their own files.
    cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0,
        "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}})
    model = torch.nn.Linear(4, 4)
    sm = fnzero.shard(model, config=cfg)
    state = sm.init_state(optimizer=fnzero.optim.adamw(lr=1e-3))
    assert all(is_placeholder(t) for t in state.params.values())
    step = fnzero.train_step(lambda p, b: sm.apply(p, b).square().mean(), cfg, optimizer=fnzero.optim.adamw(lr=1e-3))
    before = sm.gather(state)
    state, _ = step(state, torch.ones(1, 4))
    after = sm.gather(state)
    assert all(is_placeholder(t) for t in state.params.values())
    assert not torch.equal(after["weight"], before["weight"])


@pytest.mark.parametrize("key,zero", [
    ("offload_param", {"offload_optimizer": {"device": "cpu"}}),
    ("offload_param", {}),
    ("offload_optimizer", {"offload_optimizer": {"device": "nvme", "nvme_path": "PATH"}}),
])
def test_an_nvme_path_that_cannot_hold_files_is_one_line_naming_the_key(key, zero, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    path = str(blocker / "nvme")  # under a regular file: no directory can be made there
    zero = {k: {**v, "nvme_path": path} if v.get("nvme_path") == "PATH" else v for k, v in zero.items()}
    if key == "offload_param":
        zero["offload_param"] = {"device": "nvme", "nvme_path": path}
    cfg = W.config(3, extra={"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero}})
    sm = fnzero.shard(W.make_model("mlp:3,4,2", torch.float32), config=cfg)
    with pytest.raises(fnzero.ConfigError) as err:
        sm.init_state()
    msg = str(err.value)
    assert f"zero_optimization.{key}.nvme_path" in msg and path in msg and "\n" not in msg, msg


def _failing_after(store, monkeypatch, writes):
    """The parameter store's file writes fail (disk full) once `writes` of them went through; the
    list of those that did."""
    real, done = store._handle.pwrite, []

    def pwrite(*args, **kw):
        if len(done) == writes:
            raise OSError(errno.ENOSPC, "No space left on device", store.path)
        done.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(store._handle, "pwrite", pwrite)
    return done


def _params_on_nvme(comm, tmp_path):
    """(config, sharded model, step, batch) of a stage-3 MLP whose parameters are on NVMe in their
    own store, the optimizer on the CPU."""
    cfg = W.config(3, world=1, extra={"zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0, "offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "nvme")}}})
    sm = fnzero.shard(W.make_model("mlp:3,4,2", torch.float32), config=cfg, comm=comm)
    step = fnzero.train_step(lambda p, b: W.loss_of("mlp", sm.apply(p, b[0]), b[1]), cfg)
    return cfg, sm, step, (torch.randn(2, 3), torch.randn(2, 2))


@pytest.mark.parametrize("fails_in", ["step", "load"])
def test_a_parameter_store_update_that_fails_part_way_refuses_all_later_use(fails_in, tmp_path, monkeypatch):
    # specs/offload.md §Parameters: the step's copy-out (and a checkpoint load) writes the shards a
    # unit at a time; one that fails after some units were written leaves the files of no one step,
    # so every later use of them is one NvmeStoreError naming the store and the way back, never a
    # read of old and new shards together.
    def rank_fn(comm):
        _, sm, step, batch = _params_on_nvme(comm, tmp_path)
        s1, _ = step(sm.init_state(), batch)
        fnzero.checkpoint.save(str(tmp_path / "ckpt"), s1)
        at_step_1 = sm.gather(s1.params)
        store = sources_of(s1.sharding).params.store
        assert len(store.units("params")) >= 2  # so one can be written and the next fail
        written = _failing_after(store, monkeypatch, 1)
        with pytest.raises(OSError, match="No space left"):
            if fails_in == "step":
                step(s1, batch)
            else:
                fnzero.checkpoint.load(str(tmp_path / "ckpt"), like=s1)
        monkeypatch.undo()
        assert len(written) == 1  # one unit's new shard is in the file, the others' are old
        uses = {"step": lambda: step(s1, batch), "gather": lambda: sm.gather(s1.params),
                "forward": lambda: sm.apply(s1.params, batch[0]),  # what generate runs
                "save": lambda: fnzero.checkpoint.save(str(tmp_path / "again"), s1),
                "load": lambda: fnzero.checkpoint.load(str(tmp_path / "ckpt"), like=s1)}
        for use, call in uses.items():
            with pytest.raises(NvmeStoreError, match="failed part-way") as err:
                call()
            msg = str(err.value)
            assert store.path in msg and "fnzero.shard" in msg and "checkpoint.load" in msg, (use, msg)
        # The way back the error names: a new state, the last checkpoint loaded into it.
        _, sm, step, _ = _params_on_nvme(comm, tmp_path)
        state, _ = fnzero.checkpoint.load(str(tmp_path / "ckpt"), like=sm.init_state())
        assert sources_of(state.sharding).params.store is not store
        W.assert_close_tree(sm.gather(state.params), at_step_1, rtol=0, atol=0, what="reloaded")
        step(state, batch)

    simulated_world(1).run(rank_fn)


def test_a_parameter_store_refuses_an_older_state_and_a_step_it_could_not_flush(tmp_path, monkeypatch):
    # specs/offload.md §Parameters: the store changes in place, so an older state's save would pair
    # its own master and moments with a later step's parameters; and a step whose one closing
    # fdatasync fails (a write-back error shows only there) leaves the store refusing further use.
    def rank_fn(comm):
        _, sm, step, batch = _params_on_nvme(comm, tmp_path)
        s1, _ = step(sm.init_state(), batch)
        s2, _ = step(s1, batch)
        with pytest.raises(fnzero.ShardingError, match="at step 1 but the NVMe files of its parameter shards hold step 2"):
            fnzero.checkpoint.save(str(tmp_path / "old"), s1)
        assert not (tmp_path / "old").exists()
        fnzero.checkpoint.save(str(tmp_path / "new"), s2)  # the newest state saves
        # An older state's forward (what generate runs) would compute with step 2's parameters.
        with pytest.raises(fnzero.ShardingError, match="older state's placeholder"):
            sm.apply(s1.params, batch[0])
        sm.apply(s2.params, batch[0])
        s2_again, _ = fnzero.checkpoint.load(str(tmp_path / "new"), like=s2)  # the store now holds its shards
        with pytest.raises(fnzero.ShardingError, match="older state's placeholder"):
            sm.apply(s2.params, batch[0])
        s2 = s2_again
        store = sources_of(s2.sharding).params.store
        monkeypatch.setattr(store._handle, "sync", lambda: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
        with pytest.raises(OSError, match="I/O error"):
            step(s2, batch)
        monkeypatch.undo()
        with pytest.raises(NvmeStoreError, match="could not be flushed"):
            step(s2, batch)

    simulated_world(1).run(rank_fn)


def test_a_checkpoint_load_into_an_nvme_optimizer_that_fails_part_way_refuses_all_later_use(tmp_path, monkeypatch):
    # The optimizer store's load is one update too: a failure between two units' writes (here a
    # store file found gone), not only inside one, leaves it refusing the state's next step and save.
    def rank_fn(comm):
        cfg = W.config(2, world=1, extra={"zero_optimization": {
            "stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "nvme")}}})
        sm = fnzero.shard(W.make_model("mlp:3,4,2", torch.float32), config=cfg, comm=comm)
        step = fnzero.train_step(lambda p, b: W.loss_of("mlp", sm.apply(p, b[0]), b[1]), cfg)
        batch = (torch.randn(2, 3), torch.randn(2, 2))
        s1, _ = step(sm.init_state(), batch)
        fnzero.checkpoint.save(str(tmp_path / "ckpt"), s1)
        s2, _ = step(s1, batch)
        store, real, checks = s2.opt_state.store, s2.opt_state.store._check_files, []

        def check_files():  # before each write: the second finds a file gone, after the first was written
            checks.append(1)
            if len(checks) == 2:
                raise NvmeStoreError(errno.ENOENT, "store file is missing", store.path)
            real()

        monkeypatch.setattr(store, "_check_files", check_files)
        with pytest.raises(NvmeStoreError, match="missing"):
            fnzero.checkpoint.load(str(tmp_path / "ckpt"), like=s2)
        monkeypatch.undo()
        for call in (lambda: step(s2, batch), lambda: fnzero.checkpoint.save(str(tmp_path / "again"), s2)):
            with pytest.raises(NvmeStoreError, match="a checkpoint load .* failed part-way"):
                call()

    simulated_world(1).run(rank_fn)
