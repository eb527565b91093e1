"""ZeRO stages on real gloo processes on loopback (specs/sharding.md §Equivalence).

One spawned world per world size runs the whole stage × model × precision matrix, so process
start-up (importing torch) is paid once per world, not per case.
"""

import pytest
import torch

import _worlds as W
from fnzero.testing import run_world

pytestmark = pytest.mark.multiprocess

STEPS = 5  # sharding bugs are O(1) from the first step; five steps carry Adam past its bias correction
STAGES = [0, 1, 2, 3]
F64_CASES = [(kind, s, 2, 0.5, "fp32", "float64") for kind in ("gpt", "mlp:7,1,3") for s in STAGES]
F32_CASES = [("gpt", s, 2, 0.5, "fp32", "float32") for s in STAGES]
MIXED_CASES = [("gpt", s, 2, 0.5, p, "float32") for p in ("bf16", "fp16") for s in STAGES]

# Tolerances, with their reasons:
RTOL_F64 = 1e-9  # float64: only reduction order differs (~1e-16 per op)
RTOL_F32_LOSS = 1e-4  # fp32 losses: reduction-order noise, amplified by Adam on near-zero gradients
# 16-bit compute with fp32 master weights: every matmul rounds to 8 (bf16) / 11 (fp16) mantissa bits,
# ~4e-3 / 5e-4 relative per value; over these steps the loss curve stays within these of the fp32 run.
RTOL_LOSS = {"bf16": 3e-2, "fp16": 5e-3}


# Tensor parallelism on the same processes (specs/mesh.md): (kind, stage, tp) per world size.
TP_CASES = {1: [], 2: [("gpt_tp", 0, 2)], 4: [("gpt_tp", 1, 2), ("gpt_tp", 3, 2)]}
# Pipeline parallelism (specs/mesh.md §Pipeline): (stages, ZeRO stage, schedule) per world size.
PP_CASES = {1: [], 2: [(2, 0, "gpipe", 1), (2, 1, "1f1b", 1)], 4: [(2, 1, "1f1b", 1), (2, 1, "1f1b", 2)]}
# Expert parallelism (specs/mesh.md §Expert parallelism): (model, ZeRO stage, ep) per world size.
EP_CASES = {1: [], 2: [("moe_gpt", 3, 2), ("mixtral", 1, 2)], 4: [("moe_gpt", 1, 2), ("moe_gpt", 3, 4),
                                                                  ("deepseek_v3", 3, 2)]}
# Muon's whole-matrix optimizer partition (specs/optim.md §Muon): ZeRO stages per world size, and 0.
MUON_STAGES = {1: [], 2: [0, 3], 4: [0, 1]}

# MiCS and hpZ (specs/mesh.md §MiCS, specs/mesh.md §hpZ): (model, ZeRO stage, zero_optimization key, size) per world size.
GROUP_CASES = {1: [], 2: [], 4: [("gpt", 3, "mics_shard_size", 2), ("gpt", 3, "zero_hpz_partition_size", 2)]}
# Sequence parallelism (specs/mesh.md §Sequence): tests/_sp_models.py's cases at sp 2 x dp 2.
SP_WORLDS = {4}


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda n: f"world{n}")
def world_results(request):
    world = request.param
    cases = F64_CASES + F32_CASES + MIXED_CASES
    (out, *rest) = run_world(W.spawned_equivalence, world, cases, STEPS, TP_CASES[world], PP_CASES[world],
                             EP_CASES[world], MUON_STAGES[world], GROUP_CASES[world], world in SP_WORLDS, timeout=600)
    for other in rest:
        out.update(other)
    return world, out


@pytest.fixture(scope="module")
def references():
    cache = {}

    def get(kind, world, dtype):
        key = (kind, world, dtype)
        if key not in cache:
            cache[key] = W.train_reference(kind, STEPS, world, k=2, clip=0.5, dtype=dtype)
        return cache[key]

    return get


def test_float64_parameters_match_reference(world_results, references):
    world, out = world_results
    for kind, stage, k, clip, prec, dt in F64_CASES:
        ref = references(kind, world, torch.float64)
        got = out[f"{kind}|{stage}|{k}|{clip}|{prec}|{dt}"]
        W.assert_close_tree(got["params"], ref["params"], rtol=RTOL_F64, atol=1e-12, what=f"{kind} stage {stage} world {world}")
        assert got["losses"] == pytest.approx(ref["losses"], rel=RTOL_F64)


def test_dp_x_tp_meshes_match_reference(world_results, references):
    """dp x tp over real gloo processes (the mesh's groups are a torch DeviceMesh): every rank's
    consolidated parameters equal plain torch's AdamW on the whole model, in float64."""
    world, out = world_results
    if not TP_CASES[world]:
        pytest.skip("a world of one has no tensor parallelism")
    for kind, stage, tp in TP_CASES[world]:
        ref = references(kind, world // tp, torch.float64)
        for rank in range(world):
            got = out[f"tp|{kind}|{stage}|{tp}|rank{rank}"]
            W.assert_close_tree(got["params"], ref["params"], rtol=RTOL_F64, atol=1e-12,
                                what=f"{kind} dp{world // tp} x tp{tp} stage {stage} rank {rank}")
            assert got["losses"] == pytest.approx(ref["losses"], rel=RTOL_F64)


def test_pipelines_match_reference(world_results):
    """pp 2 (GPipe, 1F1B), dp 2 x pp 2 and tp 2 x pp 2 over real gloo processes (point-to-point
    sends between the stages of a torch DeviceMesh's pp groups): each rank's stage equals plain
    torch on the whole GPT, in float64 (tp: under the model's own names)."""
    world, out = world_results
    if not PP_CASES[world]:
        pytest.skip("a world of one has no pipeline")
    refs = {1: W.train_pipe_reference(W.pipe_gpt_layers(), W.lm_loss, W.pipe_gpt_batches(), k=4)}
    of_model = W.pipe_gpt_of_model()  # the tp cases' GPT: built as a model, named as one
    ref, losses = W.train_pipe_reference(of_model.layers, W.lm_loss, W.pipe_gpt_batches(), k=4)
    names = [n for n, _ in W.pipe_gpt_of_model().stage(0, 1).named_parameters()]
    refs[2] = (dict(zip(names, ref.values())), losses)
    for stages, stage, sched, tp in PP_CASES[world]:
        want, ref_losses = refs[tp]
        for rank in range(world):
            got = out[f"pp|{stages}|{stage}|{sched}|{tp}|rank{rank}"]
            assert got["params"], f"rank {rank} holds no layers"
            W.assert_close_tree(got["params"], want, rtol=RTOL_F64, atol=1e-12,
                                what=f"pp{stages} x dp{world // (stages * tp)} x tp{tp} z{stage} {sched} rank {rank}")
            assert got["losses"] == pytest.approx(ref_losses, rel=RTOL_F64)


def test_expert_parallel_moe_matches_reference(world_results):
    """Experts split over ep real gloo ranks (sub-groups of the default process group), tokens
    exchanged by all_to_all_single, expert units ZeRO-sharded over the expert-data-parallel ranks:
    every rank's consolidated parameters equal plain torch's (float64)."""
    import test_moe_hf as hf
    import test_moe_sharded as moe

    world, out = world_results
    if not EP_CASES[world]:
        pytest.skip("expert parallelism needs 2 or more ranks")
    for kind, stage, ep in EP_CASES[world]:
        got = [out[f"ep|{kind}|{stage}|{ep}|rank{r}"]["params"] for r in range(world)]
        if kind == "moe_gpt":
            moe.assert_equal_to_reference(got, moe._reference(world))
        else:
            hf._assert_close(got, hf._reference(kind, world))


def test_muon_partitioned_by_matrix_matches_stage_0(world_results):
    """Muon at ZeRO 3 (2 ranks) and 1 (4 ranks) over real gloo all-to-alls: each matrix's
    gradient pieces reach its owner and its new values come back, to the same float64 numbers as
    Muon at stage 0 (itself checked against DeepSpeed's algorithm, tests/test_optim_muon.py)."""
    world, out = world_results
    stages = MUON_STAGES[world]
    if not stages:
        pytest.skip("one rank: nothing to partition")
    base = out["muon|0"]
    for stage in stages[1:]:
        got = out[f"muon|{stage}"]
        W.assert_close_tree(got["params"], base["params"], rtol=0, atol=1e-9, what=f"muon stage {stage}")
        assert got["losses"] == pytest.approx(base["losses"], rel=RTOL_F64)


def test_mics_and_hpz_groups_match_reference(world_results, references):
    """MiCS's shard and replica groups and hpZ's groups as gloo process groups (`dist.new_group`)."""
    world, out = world_results
    if not GROUP_CASES[world]:
        pytest.skip("MiCS and hpZ are checked on the world of 4")
    for kind, stage, key, size in GROUP_CASES[world]:
        ref = references(kind, world, torch.float64)
        W.assert_close_tree(out[f"zg|{kind}|{stage}|{key}|{size}"]["params"], ref["params"], rtol=RTOL_F64, atol=1e-12,
                            what=f"{kind} stage {stage} {key} {size}")


def test_float32_losses_match_reference(world_results, references):
    world, out = world_results
    ref = references("gpt", world, torch.float32)
    for kind, stage, k, clip, prec, dt in F32_CASES:
        got = out[f"{kind}|{stage}|{k}|{clip}|{prec}|{dt}"]
        assert got["losses"] == pytest.approx(ref["losses"], rel=RTOL_F32_LOSS), f"stage {stage}"


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_follows_reference_loss_curve(world_results, references, precision):
    world, out = world_results
    ref = references("gpt", world, torch.float32)
    curves = {}
    for kind, stage, k, clip, prec, dt in MIXED_CASES:
        if prec != precision:
            continue
        got = out[f"{kind}|{stage}|{k}|{clip}|{prec}|{dt}"]
        assert got["losses"] == pytest.approx(ref["losses"], rel=RTOL_LOSS[precision]), f"{precision} stage {stage}"
        curves[stage] = got["losses"]
    # Sharding itself must not add error: the 16-bit stages agree with each other far more tightly.
    for stage in STAGES[1:]:
        assert curves[stage] == pytest.approx(curves[0], rel=RTOL_LOSS[precision] / 10)


def test_donated_step_equals_pure_step_on_real_ranks():
    """Stages 1-2 with donate=True all-gather straight into the input state's buffers."""
    for rank_result in run_world(W.spawned_donate_matches_pure, 2, timeout=300):
        assert all(diff == 0.0 for diff in rank_result.values()), rank_result


def test_sequence_parallel_on_real_ranks(world_results):
    """sp 2 x dp 2 over 4 processes: the Llama at ZeRO-3, fnzero's GPT at ZeRO-2 under
    `fnzero.jit(scope="units")` (each attention's exchange a graph break; eager is the simulated
    worlds' test), and with 3 heads (a ring of 2: gloo's all-to-all with empty splits) at ZeRO-1:
    each equals plain torch."""
    import _sp_models as M

    world, out = world_results
    if world not in SP_WORLDS:
        pytest.skip("sequence parallelism is checked on the world of 4")
    ref, ref_losses = M.reference("llama", 2, 2, 2, 2)
    gpt_ref = W.train_reference("gpt_tp", 2, 2, k=2, clip=0.5)
    ring_ref = W.train_reference("gpt", 2, 2, k=2, clip=0.5)
    for rank in range(world):
        (params, losses), (jitted, jitted_losses), (ring, _) = out[f"sp|rank{rank}"]
        W.assert_close_tree(params, ref, rtol=RTOL_F64, atol=1e-12, what=f"llama gloo sp2 dp2 z3 rank {rank}")
        assert losses == pytest.approx(ref_losses, rel=RTOL_F64)
        W.assert_close_tree(jitted, gpt_ref["params"], rtol=RTOL_F64, atol=1e-12, what=f"gpt gloo sp2 dp2 jit rank {rank}")
        assert jitted_losses == pytest.approx(gpt_ref["losses"], rel=RTOL_F64)
        W.assert_close_tree(ring, ring_ref["params"], rtol=RTOL_F64, atol=1e-12, what=f"gpt ring gloo rank {rank}")
