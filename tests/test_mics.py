"""MiCS (`zero_optimization.mics_shard_size`, `specs/mesh.md §MiCS`) and ZeRO++'s hpZ
(`zero_hpz_partition_size`, `specs/mesh.md §hpZ`) on simulated worlds of 4 ranks: equal to plain
torch in float64, their collectives counted per group, their memory exact, bad sizes refused.

The reference is plain torch on one process: the global batch of every rank's micro-batches,
each chunk weighted 1 / (ranks x accumulation) as DDP weighs it, AdamW, clip_grad_norm_.
"""

from __future__ import annotations

import collections
import functools

import pytest
import torch
import torch.nn.functional as F

import fnzero
from fnzero import ConfigError
from fnzero.testing import GPT, seeded, simulated_world

# MiCS's keys load with a ConfigWarning that DeepSpeed 0.19.8 removed them (tested in test_mics_config_keys).
pytestmark = pytest.mark.filterwarnings("ignore:.*DeepSpeed 0.19.8 refuses this key:fnzero.config.ConfigWarning")

WORLD, VOCAB, SEQ, HIDDEN, ACCUM, STEPS, LR, CLIP, MICRO = 4, 64, 8, 16, 2, 3, 1e-2, 0.5, 2


def _model(dtype=torch.float64) -> GPT:
    with seeded(0):
        return GPT(vocab_size=VOCAB, seq_len=SEQ, d_model=HIDDEN, n_layer=2, n_head=2).to(dtype)


def _loss(apply, batch):
    logits = apply(batch[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).double(), batch[:, 1:].flatten())


def _chunk(step: int, i: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=torch.Generator().manual_seed(1000 * step + i))


def _config(stage: int, **zero):
    return fnzero.load_config({
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUM, "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero},
    }, world_size=WORLD)


@functools.cache
def _reference() -> dict[str, torch.Tensor]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for s in range(STEPS):
        opt.zero_grad()
        for i in range(WORLD * ACCUM):
            (_loss(model, _chunk(s, i)) / (WORLD * ACCUM)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(stage: int, **zero):
    cfg = _config(stage, **zero)

    def rank(comm):
        sm = fnzero.shard(_model(), config=cfg, comm=comm)
        assert sm.plan.world_size == zero.get("mics_shard_size", WORLD) and sm.sharding.dp_size == WORLD
        assert (sm.sharding.mesh.hpz is not None) == ("zero_hpz_partition_size" in zero)
        state = sm.init_state()
        step = fnzero.train_step(lambda p, b: _loss(lambda x: sm.apply(p, x), b), cfg)
        for s in range(STEPS):
            state, metrics = step(state, [_chunk(s, comm.rank * ACCUM + i) for i in range(ACCUM)])
        return sm.gather(state)

    return simulated_world(WORLD).run(rank)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_mics_equals_plain_torch(stage):
    """specs/mesh.md §MiCS: shard groups of 2 on 4 ranks, 3 steps of AdamW with accumulation and
    clipping, equal to plain torch (float64: only the order of the sums differs, ~1e-16 per op)."""
    want = _reference()
    for got in _train(stage, mics_shard_size=2):
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-12, msg=name)


def test_hpz_equals_plain_torch():
    """specs/mesh.md §hpZ: stage 3 with hpZ groups of 2, backward re-gathering from the secondary
    copies every micro-batch, equal to plain torch (float64, as above)."""
    want = _reference()
    for got in _train(3, zero_hpz_partition_size=2, stage3_max_reuse_distance=0):  # every step re-gathers in backward
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-12, msg=name)


def test_mics_groups_are_axes_of_the_state_mesh():
    """specs/mesh.md §The state's mesh: MiCS's shard and replica groups are the data and replicas
    axes of one mesh, which the sharding's names read; an axis the state lacks is named."""
    cfg = _config(1, mics_shard_size=2)

    def rank(comm):
        sm = fnzero.shard(_model(), config=cfg, comm=comm)
        sh = sm.init_state().sharding
        mesh = sh.mesh
        assert mesh.present == ("data", "replicas")
        assert sh.comm is mesh.data is sm.comm and sh.replicas is mesh.replicas is mesh.axis("replicas")
        assert (mesh.data.world_size, mesh.num_replicas, sh.dp_size) == (2, 2, WORLD)
        with pytest.raises(fnzero.ShardingError, match=r"no tp axis \(its mesh has data, replicas\)"):
            mesh.axis("tp")
        with pytest.raises(AttributeError):
            sh.replicas = None  # read from the mesh, its only source
        return mesh.not_traceable

    assert all("MiCS" in why for why in simulated_world(WORLD).run(rank))


def _recorded_step(mesh_args: dict, stage: int = 3):
    """Per rank: the plan and the (op, numel) records of one step on the group ZeRO shards over
    (`sm.comm`), MiCS's replica group and hpZ's group (empty where a group is absent)."""
    cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "AdamW"},
                              "comms_logger": {"enabled": True},
                              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                                    "stage3_max_reuse_distance": 0}},
                             world_size=WORLD)

    def rank(comm):
        mesh = fnzero.make_mesh(comm, **mesh_args)
        sm = fnzero.shard(_model(torch.float32), config=cfg, comm=comm, mesh=mesh)
        state = sm.init_state()
        step = fnzero.train_step(lambda p, b: _loss(lambda x: sm.apply(p, x), b), cfg)
        groups = [sm.comm, sm.sharding.replicas, sm.sharding.mesh.hpz]
        for c in groups:
            if c is not None:
                c.reset()
        step(state, _chunk(0, comm.rank))
        return sm.plan, [[(r.op, r.numel) for r in c.records] if c is not None else [] for c in groups]

    return simulated_world(WORLD).run(rank)


@pytest.mark.parametrize("stage", [1, 3])
def test_mics_gathers_and_reduces_in_the_shard_group_then_all_reduces_shards_across_replicas(stage):
    """specs/mesh.md §MiCS: every all-gather and reduce-scatter runs in the shard group of 2, over
    units padded to 2; the replica group carries one all-reduce of each unit's shard and of the loss."""
    for plan, (shard, replicas, _) in _recorded_step({"mics": 2}, stage):
        assert plan.world_size == 2
        padded = collections.Counter(u.padded_numel for u in plan.units)
        gathers = collections.Counter(n for op, n in shard if op == "all_gather")
        assert set(gathers) == set(padded)  # every unit gathered (stage 3: forward and backward; 1: published)
        if stage == 1:
            assert gathers == padded
        assert collections.Counter(n for op, n in shard if op == "reduce_scatter") == padded
        assert collections.Counter((op, n) for op, n in replicas) == (
            collections.Counter(("all_reduce", u.shard_numel) for u in plan.units) + collections.Counter([("all_reduce", 1)]))
        assert [op for op, _ in shard if op == "all_reduce"] == ["all_reduce"]  # the norm and the loss, once


def test_hpz_moves_backward_gathers_into_its_group():
    """specs/mesh.md §hpZ: the forward gathers each unit over the 4 dp ranks; backward's re-gathers
    run in the hpZ group of 2, from the secondary shards, and are the plain run's backward gathers."""
    plain = _recorded_step({})
    hpz = _recorded_step({"hpz": 2})
    for (plan, (dp0, _, _)), (_, (dp, _, group)) in zip(plain, hpz):
        gathers = collections.Counter(n for op, n in dp0 if op == "all_gather")
        forward = collections.Counter(n for op, n in dp if op == "all_gather")
        backward = collections.Counter(n for op, n in group if op == "all_gather")
        assert {op for op, _ in group} == {"all_gather"} and sum(backward.values()) >= 3
        assert forward == collections.Counter(u.padded_numel for u in plan.units)  # once each, in forward
        assert forward + backward == gathers  # (records count the gathered buffer's elements)
        assert [(op, n) for op, n in dp if op != "all_gather"] == [(op, n) for op, n in dp0 if op != "all_gather"]


def test_mics_state_is_16_bytes_per_parameter_over_the_shard_group():
    """specs/mesh.md §MiCS memory: at stage 3 in bf16 with fp32 master and Adam, each rank holds
    16 bytes per element of its shard of each unit padded to the shard group of 2: 16 Ψ / 2, up to
    the padding, exactly `zero_formula(Ψ, 3, 2)` of the padded count, twice plain ZeRO-3's on 4 ranks."""
    cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "AdamW"},
                              "bf16": {"enabled": True},
                              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}, world_size=WORLD)

    def rank(comm, mics):
        sm = fnzero.shard(_model(torch.float32), config=cfg, comm=comm, mesh=fnzero.make_mesh(comm, mics=mics))
        return sm.plan, fnzero.memory.model_state_bytes(sm.init_state()).total

    for mics, sharing in ((2, 2), (0, WORLD)):
        for plan, got in simulated_world(WORLD).run(lambda comm: rank(comm, mics)):
            assert got == fnzero.memory.zero_formula(plan.num_padded, 3, sharing, True) == 16 * plan.num_padded // sharing
            assert plan.num_padded - plan.num_params < 2 * len(plan.units)  # padding: under one element per rank and unit


@pytest.mark.parametrize("stage", [2, 3])
def test_mics_in_bf16_divides_by_every_data_parallel_rank(stage):
    """16-bit gradients are divided by the dp ranks before they are summed (`specs/sharding.md`
    §Step): by all 4, not the shard group's 2, so the gradient norm is plain ZeRO's (bf16 rounding apart)."""
    cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "AdamW"},
                              "bf16": {"enabled": True},
                              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}},
                             world_size=WORLD)

    def rank(comm, mics):
        sm = fnzero.shard(_model(torch.float32), config=cfg, comm=comm, mesh=fnzero.make_mesh(comm, mics=mics))
        step = fnzero.train_step(lambda p, b: _loss(lambda x: sm.apply(p, x), b), cfg)
        return step(sm.init_state(), _chunk(0, comm.rank))[1]

    plain, mics = (simulated_world(WORLD).run(lambda comm: rank(comm, m))[0] for m in (0, 2))
    assert mics["grad_norm"] == pytest.approx(plain["grad_norm"], rel=2e-2)  # bf16: 8 bits of mantissa
    assert mics["loss"] == pytest.approx(plain["loss"], rel=1e-6)


def test_bad_group_sizes_are_one_config_error_naming_the_key(monkeypatch):
    """A MiCS shard size that does not divide the dp ranks; an hpZ size that does not divide the
    ranks per node (two nodes of 2: LOCAL_WORLD_SIZE 2); either with tensor parallelism or offload."""
    def error(body) -> str:
        def rank(comm):
            with pytest.raises(ConfigError) as e:
                body(comm)
            return str(e.value)
        return simulated_world(WORLD).run(rank)[0]

    with pytest.raises(ConfigError, match=r"`zero_optimization.mics_shard_size` 3 must divide the data-parallel world "
                                          r"size 4") as e:
        _config(3, mics_shard_size=3)
    assert len(e.value.errors) == 1
    assert "zero_optimization.mics_shard_size 3 must divide the data-parallel ranks: this mesh has 4" in error(
        lambda comm: fnzero.make_mesh(comm, mics=3))
    assert "zero_optimization.mics_shard_size 2 with tensor-parallel size 2" in error(
        lambda comm: fnzero.make_mesh(comm, tp=2, mics=2))
    offload = {"offload_optimizer": {"device": "cpu"}}
    assert "zero_optimization.mics_shard_size with zero_optimization.offload_optimizer" in error(
        lambda comm: fnzero.shard(_model(), config=_config(3, mics_shard_size=2, **offload), comm=comm))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert "zero_optimization.zero_hpz_partition_size 4 must divide the ranks per node (2, LOCAL_WORLD_SIZE)" in error(
        lambda comm: fnzero.shard(_model(), config=_config(3, zero_hpz_partition_size=4), comm=comm))
    fnzero.testing.simulated_world(WORLD).run(lambda comm: fnzero.make_mesh(comm, hpz=2))  # 2 divides 2: accepted


def _run(world: int, stage: int, mics: int, ckpt, save_to=None, load_from=None):
    """On `world` simulated ranks: a state (loaded from `load_from`, else fresh), saved to `save_to`
    after one step when given; returns rank 0's consolidated parameters after loading and after
    the next step (the chunks of step 1, as the same global batch split over `world` ranks)."""
    cfg = fnzero.load_config({
        "train_micro_batch_size_per_gpu": MICRO * WORLD // world, "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}, world_size=world)

    def rank(comm):
        sm = fnzero.shard(_model(), config=cfg, comm=comm, mesh=fnzero.make_mesh(comm, mics=mics))
        state = sm.init_state()
        step = fnzero.train_step(lambda p, b: _loss(lambda x: sm.apply(p, x), b), cfg)
        if load_from is not None:
            # Threads share one generator, which a restore would reset while another shard group builds its model.
            state, _ = ckpt.load(load_from, state, restore_rng=False)
        else:
            state, _ = step(state, _chunk(0, comm.rank))
        if save_to is not None:
            ckpt.save(save_to, state)
        loaded = sm.gather(state)
        mine = torch.cat([_chunk(1, r) for r in range(WORLD)])[comm.rank * MICRO * WORLD // world:][:MICRO * WORLD // world]
        return loaded, sm.gather(step(state, mine)[0])

    return simulated_world(world).run(rank)[0]


def test_mics_checkpoint_is_one_shard_groups_and_loads_into_plain_zero_and_back(tmp_path):
    """specs/checkpoint-format.md §MiCS: the first shard group writes the checkpoint, as a run of 2
    ranks would (two data files); a plain ZeRO run of 2 ranks at another stage loads it by
    name, bit for bit, and its next step equals the MiCS run's; saved again, it loads into MiCS."""
    from fnzero import checkpoint as ckpt

    saved, mics_next = _run(WORLD, 3, 2, ckpt, save_to=tmp_path / "a")
    assert sorted(p.name for p in (tmp_path / "a" / "step_1").glob("rank*.bin")) == ["rank00000.bin", "rank00001.bin"]
    loaded, plain_next = _run(2, 1, 0, ckpt, load_from=tmp_path / "a", save_to=tmp_path / "b")
    again, mics_again = _run(WORLD, 2, 2, ckpt, load_from=tmp_path / "b")
    for name in saved:
        assert torch.equal(loaded[name], saved[name]) and torch.equal(again[name], saved[name]), name
        torch.testing.assert_close(plain_next[name], mics_next[name], rtol=1e-9, atol=1e-12, msg=name)
        torch.testing.assert_close(mics_again[name], mics_next[name], rtol=1e-9, atol=1e-12, msg=name)


def test_a_node_local_save_of_a_mics_state_is_refused_before_writing(tmp_path):
    from fnzero import checkpoint as ckpt
    from fnzero._errors import CheckpointError

    def rank(comm):
        sm = fnzero.shard(_model(), config=_config(1), comm=comm, mesh=fnzero.make_mesh(comm, mics=2))
        with pytest.raises(CheckpointError, match=r"node-local save .* of a MiCS state"):
            ckpt.save(tmp_path, sm.init_state(), node_local=True)

    simulated_world(WORLD).run(rank)
    assert not any(tmp_path.iterdir())


def test_benchmark_rows_count_what_their_formulas_say():
    """benchmarks/comm_opt_mics.py: each configuration's counted bytes equal its formula; MiCS moves
    all but the replica all-reduce into the node and holds twice the state; hpZ moves backward's
    gathers into the node; the losses are plain ZeRO-3's."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "comm_opt_mics.py"
    spec = importlib.util.spec_from_file_location("comm_opt_mics", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.FEATURE == "mics"
    for z3, mics, hpz in simulated_world(WORLD).run(lambda comm: bench.measure(comm, 1, 0)):
        assert [r["config"] for r in (z3, mics, hpz)] == ["z3", "mics2", "hpz2"]
        for r in (z3, mics, hpz):
            assert r["bytes_per_step"] == pytest.approx(r["formula_bytes"], rel=1e-12) == r["bytes_intra"] + r["bytes_cross"]
            assert r["loss"] == pytest.approx(z3["loss"], rel=1e-6)
        assert z3["bytes_intra"] == 0 and mics["bytes_cross"] < z3["bytes_cross"] / 3 and hpz["bytes_intra"] > 0
        assert mics["state_bytes"] > 1.9 * z3["state_bytes"] and hpz["state_bytes"] == z3["state_bytes"]


def test_mics_config_keys():
    """specs/config.md: MiCS's keys load as fields (DeepSpeed 0.19.8 refuses them: said by a warning
    when on); no effect where nothing is sharded (MiCS at stage 0, hpZ below 3) or for the two-level
    gather: one ConfigWarning each; `to_json` writes MiCS's keys only when on."""
    import json
    import warnings

    def said(zero: dict | str):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cfg = fnzero.load_config(zero if isinstance(zero, str) else {"train_batch_size": 4, "zero_optimization": zero},
                                     world_size=WORLD)
        return cfg, [str(w.message) for w in caught if issubclass(w.category, fnzero.config.ConfigWarning)]

    cfg, msgs = said({"stage": 3, "mics_shard_size": 2, "mics_hierarchical_params_gather": True})
    assert cfg.zero_optimization.mics_shard_size == 2 and len(msgs) == 3
    assert sum("DeepSpeed 0.19.8 refuses this key" in m for m in msgs) == 2
    assert any("mics_hierarchical_params_gather` is true, which has no effect" in m for m in msgs)
    assert json.loads(cfg.to_json())["zero_optimization"]["mics_shard_size"] == 2
    assert said(cfg.to_json())[0] == cfg
    _, msgs = said({"stage": 0, "mics_shard_size": 2})
    assert any("`zero_optimization.mics_shard_size` is 2, which has no effect" in m for m in msgs)
    cfg, msgs = said({"stage": 2, "zero_hpz_partition_size": 2})
    assert msgs == [m for m in msgs if "`zero_optimization.zero_hpz_partition_size` is 2, which has no effect" in m] != []
    assert "mics_shard_size" not in json.loads(cfg.to_json())["zero_optimization"]


def test_plan_prints_mics_rows_over_the_shard_group(capsys):
    """`fnzero plan --mics S` (specs/cli.md): stages 1-3 shard over S ranks (§MiCS memory), no offload
    rows (MiCS refuses offload); a size that does not divide the world is a usage error."""
    import json

    from fnzero.cli._main import main

    assert main(["plan", "--params", "7B", "--world-size", "64", "--mics", "8", "--precision", "bf16", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["stage"], r["offload_optimizer"], r["offload_param"]) for r in rows] == [(s, "none", "none") for s in range(4)]
    for r in rows:
        assert r["device_bytes"] == round(fnzero.memory.zero_formula(7 * 10**9, r["stage"], 8 if r["stage"] else 64, True))
    assert main(["plan", "--params", "7B", "--world-size", "64", "--mics", "7"]) == 2
    assert "--mics 7 does not divide --world-size 64" in capsys.readouterr().err


def test_hpz_holds_one_hpz_share_of_each_unit_from_forward_to_backward():
    """specs/mesh.md §hpZ memory: after the forward each rank holds, of each unit gathered and not
    kept for backward, its 1/H part (P/H elements of the P padded), at most Ψ/H in all; the step
    drops them once backward is done."""
    from fnzero.sharding.zero._ambient import ambient

    cfg = _config(3, stage3_max_reuse_distance=0)  # (the default keeps every unit of this model gathered for backward)

    def rank(comm):
        sm = fnzero.shard(_model(), config=cfg, comm=comm, mesh=fnzero.make_mesh(comm, hpz=2))
        held, runs = [], []

        def loss_fn(p, b):
            loss = _loss(lambda x: sm.apply(p, x), b)
            run = ambient().step_runs[-1]  # this micro-batch's
            runs.append(run)
            held.append([(rt.unit.padded_numel, rt.secondary.numel()) for rt in run.rts.values() if rt.secondary is not None])
            return loss

        fnzero.train_step(loss_fn, cfg)(sm.init_state(), [_chunk(0, comm.rank + i) for i in range(ACCUM)])
        return sm.plan, held, [rt.secondary for r in runs for rt in r.rts.values()]

    for plan, held, after in simulated_world(WORLD).run(rank):
        assert len(held) == ACCUM and all(h and all(mine * 2 == padded for padded, mine in h) for h in held)
        assert all(sum(mine for _, mine in h) <= plan.num_padded / 2 for h in held) and not any(t is not None for t in after)


def test_export_live_of_a_mics_state_is_written_once(tmp_path):
    """`export_live` (DeepSpeed's save_16bit_model): rank 0 of the first shard group writes, every
    rank returns its paths, and the file holds the consolidated parameters; `gather(rank0_only=True)`
    gives them to that rank only."""
    from fnzero import checkpoint as ckpt

    def rank(comm):
        sm = fnzero.shard(_model(), config=_config(3), comm=comm, mesh=fnzero.make_mesh(comm, mics=2))
        state = sm.init_state()
        return ckpt.export_live(sm, state, tmp_path / "out"), sm.gather(state), sm.gather(state, rank0_only=True)

    results = simulated_world(WORLD).run(rank)
    assert [bool(only) for _, _, only in results] == [True, False, False, False]  # rank0_only: the job's rank 0
    assert len({tuple(paths) for paths, _, _ in results}) == 1
    from safetensors.torch import load_file

    written = {k: v for p in results[0][0] if p.endswith(".safetensors") for k, v in load_file(p).items()}
    assert written.keys() == results[0][1].keys() and all(torch.equal(written[k], results[0][1][k]) for k in written)
