"""`fnzero plan` and `fnzero.memory._estimate` (specs/cli.md §plan): every figure checked against the ZeRO formulas."""

import json
import math

import pytest

from fnzero.memory import _estimate as _plan
from fnzero.memory import ep_zero_formula, zero_formula
from test_cli import run_cli, run_fresh

PSI = 7_000_000_000
N, GPN = 64, 8


def _rows(rep, **where):
    return [r for r in rep["rows"] if all(r[k] == v for k, v in where.items())]


def _one(rep, **where):
    (row,) = _rows(rep, **where)
    return row


@pytest.fixture(scope="module")
def rep():
    rc, out, err = run_fresh("plan", "--params", "7e9", "--world-size", N, "--gpus-per-node", GPN, "--json")
    assert rc == 0, err
    return json.loads(out)


def test_no_offload_rows_are_the_zero_formula(rep):
    assert rep["num_params"] == PSI and rep["world_size"] == N and rep["nodes"] == 8
    for prec, mixed in (("fp32", False), ("bf16", True)):
        for stage in range(4):
            row = _one(rep, precision=prec, stage=stage, offload_optimizer="none", offload_param="none")
            assert row["device_bytes"] == round(zero_formula(PSI, stage, N, mixed)), (prec, stage)
            assert sum(row["device"].values()) == pytest.approx(row["device_bytes"], abs=4)
            assert row["host_bytes"] == row["nvme_bytes"] == 0


def test_offload_rows(rep):
    # 16-bit: the device keeps 2-byte params; the optimizer's 16 bytes/param (fp32 master, two
    # moments, fp32 gradient shard) are sharded over the ranks on the offload tier.
    s2 = _one(rep, precision="bf16", stage=2, offload_optimizer="cpu", offload_param="none")
    assert s2["device_bytes"] == 2 * PSI
    assert s2["host_bytes"] == 16 * PSI // N
    assert s2["host_bytes_per_node"] == 16 * PSI // N * GPN
    s1 = _one(rep, precision="bf16", stage=1, offload_optimizer="cpu", offload_param="none")
    assert s1["device_bytes"] == 4 * PSI  # stage 1 keeps the full gradient accumulator
    s3 = _one(rep, precision="bf16", stage=3, offload_optimizer="cpu", offload_param="none")
    assert s3["device_bytes"] == 2 * PSI // N and s3["host_bytes"] == 16 * PSI // N
    both = _one(rep, precision="bf16", stage=3, offload_optimizer="cpu", offload_param="cpu")
    assert both["device_bytes"] == 0 and both["host_bytes"] == 18 * PSI // N
    # nvme: master and moments in files (12 bytes/param), the fp32 gradient shard in host memory
    nv = _one(rep, precision="bf16", stage=3, offload_optimizer="nvme", offload_param="nvme")
    assert (nv["host_bytes"], nv["nvme_bytes"]) == (4 * PSI // N, 14 * PSI // N)
    # Parameters on NVMe in their own files with the optimizer on the host (DeepSpeedExamples' ds_config_nvme.json).
    own = _one(rep, precision="bf16", stage=3, offload_optimizer="cpu", offload_param="nvme")
    assert (own["device_bytes"], own["host_bytes"], own["nvme_bytes"]) == (0, 16 * PSI // N, 2 * PSI // N)
    mixed = _one(rep, precision="bf16", stage=3, offload_optimizer="nvme", offload_param="cpu")
    assert (mixed["host_bytes"], mixed["nvme_bytes"]) == (6 * PSI // N, 12 * PSI // N)
    assert mixed["nvme"] == {"params": 0, "grads": 0, "master": PSI // N * 4, "optimizer": PSI // N * 8}
    f2 = _one(rep, precision="fp32", stage=2, offload_optimizer="cpu", offload_param="none")
    assert f2["device_bytes"] == 4 * PSI and f2["host_bytes"] == 16 * PSI // N
    # Offloading never adds device memory, and the bytes only move: device + offloaded >= formula's shard.
    for r in rep["rows"]:
        base = _one(rep, precision=r["precision"], stage=r["stage"], offload_optimizer="none", offload_param="none")
        assert r["device_bytes"] <= base["device_bytes"]
    assert rep["memory_per_device"] is None and all(r["max_params"] is None for r in rep["rows"])


def test_param_spellings_agree():
    seen = set()
    for spelling in ("7e9", "7B", "7b", "7_000_000_000", "7000000000", "7.0G"):
        rc, out, err = run_cli("plan", "--params", spelling, "--world-size", 8, "--precision", "bf16", "--json")
        assert rc == 0, (spelling, err)
        seen.add(json.loads(out)["num_params"])
    assert seen == {PSI}
    assert _plan.parse_count("350M") == 350_000_000 and _plan.parse_count("1.3b") == 1_300_000_000
    assert _plan.parse_count("125k") == 125_000


def test_largest_model_solves_the_formula():
    rc, out, err = run_cli("plan", "--params", "7B", "--world-size", N, "--memory-per-device", "80GB",
                           "--reserve", "10GiB", "--json")
    assert rc == 0, err
    rep = json.loads(out)
    budget = 80 * 10**9 - 10 * 2**30
    assert rep["memory_per_device"] == 80 * 10**9 and rep["reserve"] == 10 * 2**30
    for r in _rows(rep, offload_optimizer="none", offload_param="none"):
        mixed = r["precision"] != "fp32"
        m = r["max_params"]
        assert zero_formula(m, r["stage"], N, mixed) <= budget < zero_formula(m + 1, r["stage"], N, mixed)
        assert r["fits"] == (r["device_bytes"] <= budget)
    assert _one(rep, precision="fp32", stage=0, offload_optimizer="none", offload_param="none")["fits"] is False
    assert _one(rep, precision="bf16", stage=3, offload_optimizer="none", offload_param="none")["fits"] is True
    s2 = _one(rep, precision="bf16", stage=2, offload_optimizer="cpu", offload_param="none")
    assert s2["max_params"] == budget // 2
    assert _one(rep, precision="bf16", stage=3, offload_optimizer="cpu", offload_param="cpu")["max_params"] is None


def test_host_memory_bounds_offloaded_rows():
    host = 512 * 10**9
    m = _plan.largest_model(80 * 10**9, stage=3, world_size=N, precision="bf16", offload_optimizer="cpu",
                            offload_param="cpu", host_memory_per_node=host, gpus_per_node=GPN)
    assert m == host * N // (18 * GPN)


def test_readable_table():
    rc, out, err = run_cli("plan", "--params", "1.3b", "--world-size", 16, "--memory-per-device", "40GB")
    assert rc == 0 and err == ""
    assert "1.30B parameters" in out and "2 node(s) x 8 per node" in out
    assert "device/rank" in out and "host/node" in out and "largest model" in out
    assert "fp32 weights" in out and "16-bit (bf16/fp16)" in out
    assert "opt=cpu param=cpu" in out and "unbounded" in out
    # 16-bit stage 0: 16 bytes/param unsharded
    assert _plan.format_bytes(16 * 1_300_000_000) in out


def test_config_row_is_marked():
    rc, out, err = run_cli("plan", "--params", "7B", "--world-size", 8, "--config", "examples/configs/offload_nvme.json",
                           "--json")
    assert rc == 0, err
    rep = json.loads(out)
    assert {r["precision"] for r in rep["rows"]} == {"bf16"}
    (mine,) = [r for r in rep["rows"] if r["from_config"]]
    assert (mine["stage"], mine["offload_optimizer"], mine["offload_param"]) == (3, "nvme", "nvme")
    rc, out, _ = run_cli("plan", "--params", "7B", "--world-size", 8, "--config", "examples/configs/offload_cpu.json")
    assert rc == 0
    assert any(line.startswith("*") and "opt=cpu" in line and line.split()[1] == "2" for line in out.splitlines()), out


@pytest.mark.parametrize("argv, message", [
    (["--params", "abc", "--world-size", "8"], "parameter count 'abc'"),
    (["--params", "-5", "--world-size", "8"], "--params"),
    (["--params", "0", "--world-size", "8"], "at least 1"),
    (["--params", "7B", "--world-size", "0"], "at least 1"),
    (["--params", "7B", "--world-size", "2.5"], "whole number"),
    (["--params", "7B", "--world-size", "8", "--memory-per-device", "80XB"], "size '80XB'"),
    (["--params", "7B", "--world-size", "8", "--memory-per-device", "80GB", "--reserve", "90GB"], "--reserve"),
    (["--params", "7B", "--world-size", "8", "--precision", "fp8"], "invalid choice"),
    (["--params", "inf", "--world-size", "8"], "--params"),
    (["--world-size", "8"], "--params"),
])
def test_bad_numbers_exit_2(argv, message):
    rc, out, err = run_cli("plan", *argv)
    assert rc == 2
    assert out == ""
    assert message in err, err


def test_invalid_config_exits_2_with_every_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2, '
                   '"offload_param": {"device": "cpu"}}, "bf16": {"enabled": true}, "fp16": {"enabled": true}}')
    rc, out, err = run_cli("plan", "--params", "7B", "--world-size", 8, "--config", str(bad))
    assert rc == 2 and out == ""
    assert "2 error(s)" in err and "offload_param" in err and "fp16" in err


# -- the pure functions ---------------------------------------------------------------------------------

@pytest.mark.parametrize("stage", range(4))
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("n", [1, 3, 64])
def test_breakdown_sums_to_formula(stage, precision, n):
    e = _plan.estimate(123_456_789, stage=stage, world_size=n, precision=precision)
    assert float(e.device.total) == pytest.approx(zero_formula(123_456_789, stage, n, precision != "fp32"), rel=1e-12)


def test_partial_offload_interpolates():
    kw = dict(stage=3, world_size=8, precision="bf16")
    none, full = _plan.estimate(8e9, **kw), _plan.estimate(8e9, offload_optimizer="cpu", **kw)
    half = _plan.estimate(8e9, offload_optimizer="cpu", ratio=0.5, **kw)
    assert half.host_bytes == full.host_bytes // 2
    assert full.device_bytes < half.device_bytes < none.device_bytes


def test_parameters_on_nvme_with_the_optimizer_in_device_memory_keep_a_master_there():
    # specs/offload.md §Parameters: the shards are in files, so the optimizer updates a master copy of
    # its own in device memory, also at fp32 (where, in memory, the parameters are their own master).
    for precision, p in (("fp32", 4), ("bf16", 2)):
        e = _plan.estimate(8000, stage=3, world_size=8, precision=precision, offload_param="nvme")
        assert e.device.as_ints() == {"params": 0, "grads": p * 1000, "master": 4000, "optimizer": 8000}, precision
        assert (e.host_bytes, e.nvme_bytes) == (0, p * 1000)


@pytest.mark.parametrize("kw", [
    dict(stage=0, offload_optimizer="cpu"), dict(stage=2, offload_param="cpu"), dict(stage=2, ratio=0.5),
    dict(stage=4), dict(stage=1, precision="fp8"), dict(stage=1, world_size=0), dict(stage=1, offload_param="disk"),
])
def test_estimate_rejects_what_config_rejects(kw):
    kw = {"world_size": 8, **kw}
    with pytest.raises(ValueError):
        _plan.estimate(1e9, **kw)


@pytest.mark.parametrize("text", ["", "GB", "1..2", "1e", "nan", "-1", "1 2", "0x10"])
def test_parse_rejects(text):
    with pytest.raises(ValueError):
        _plan.parse_count(text)
    with pytest.raises(ValueError):
        _plan.parse_bytes(text)


def test_parse_bytes_units():
    assert _plan.parse_bytes("80GB") == 80 * 10**9 and _plan.parse_bytes("80 GiB") == 80 * 2**30
    assert _plan.parse_bytes("1.5TB") == 1_500_000_000_000 and _plan.parse_bytes("512") == 512
    assert _plan.parse_bytes("0", allow_zero=True) == 0
    with pytest.raises(ValueError):
        _plan.parse_bytes("0")
    assert math.isclose(_plan.largest_model(10**9, stage=0, world_size=1, reserve=10**9), 0)


def test_tp_rows_are_the_formula_of_each_ranks_share(tmp_path):
    """specs/mesh.md §Memory: with --tp T each rank holds Ψ/T, sharded by ZeRO over N/T ranks; a
    T that does not divide the world is exit 2 naming both; the config's autotp_size is marked."""
    rc, out, err = run_cli("plan", "--params", "7e9", "--world-size", N, "--tp", "1,2,8", "--precision", "bf16",
                           "--memory-per-device", "80GB", "--json")
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["tp"] == [1, 2, 8]
    for tp in (1, 2, 8):
        for stage in range(4):
            row = _one(rep, tp=tp, stage=stage, offload_optimizer="none", offload_param="none")
            assert row["dp"] == N // tp
            assert row["device_bytes"] == round(zero_formula(-(-PSI // tp), stage, N // tp, True)), (tp, stage)
    z1 = {tp: _one(rep, tp=tp, stage=1, offload_optimizer="none", offload_param="none")["max_params"] for tp in (1, 8)}
    assert z1[8] > 6 * z1[1]  # (4 + 12/64) / ((4 + 12/8) / 8) = 6.09: splitting the weights lets a far larger model fit
    rc, _, err = run_cli("plan", "--params", "7e9", "--world-size", 6, "--tp", "4")
    assert rc == 2 and "--tp 4 does not divide --world-size 6" in err
    rc, _, err = run_cli("plan", "--params", "7e9", "--world-size", 8, "--tp", "2", "--pp", "3")
    assert rc == 2 and "--tp 2 x --pp 3 = 6 does not divide --world-size 8" in err
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1},
                               "tensor_parallel": {"autotp_size": 2}}))
    rc, out, err = run_cli("plan", "--params", "7e9", "--world-size", 8, "--config", str(cfg), "--json")
    assert rc == 0, err
    (mine,) = [r for r in json.loads(out)["rows"] if r["from_config"]]
    assert (mine["tp"], mine["dp"], mine["stage"]) == (2, 4, 1)


def test_pp_rows_divide_the_parameters_over_the_stages_too(tmp_path):
    """specs/mesh.md §Memory: with --pp P (and --tp T) each rank holds Ψ/(T·P), sharded over
    N/(T·P) ranks; ZeRO-2/3 rows are not offered with a pipeline; the config's stages are marked."""
    rc, out, err = run_cli("plan", "--params", "7e9", "--world-size", N, "--tp", "1,2", "--pp", "1,4",
                           "--precision", "bf16", "--memory-per-device", "80GB", "--json")
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["pp"] == [1, 4]
    for tp in (1, 2):
        for pp in (1, 4):
            stages = {r["stage"] for r in rep["rows"] if (r["tp"], r["pp"]) == (tp, pp)}
            assert stages == ({0, 1} if pp > 1 else {0, 1, 2, 3})
            for stage in stages:
                row = _one(rep, tp=tp, pp=pp, stage=stage, offload_optimizer="none", offload_param="none")
                assert row["dp"] == N // (tp * pp)
                assert row["device_bytes"] == round(zero_formula(-(-PSI // (tp * pp)), stage, N // (tp * pp), True))
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1},
                               "pipeline": {"stages": 2}}))
    rc, out, err = run_cli("plan", "--params", "7e9", "--world-size", 8, "--config", str(cfg), "--json")
    assert rc == 0, err
    (mine,) = [r for r in json.loads(out)["rows"] if r["from_config"]]
    assert (mine["tp"], mine["pp"], mine["dp"], mine["stage"]) == (1, 2, 4, 1)


def test_moe_model_rows_split_the_experts_over_ep(tmp_path):
    """specs/mesh.md §Expert parallelism memory, specs/cli.md: --model counts a Hugging Face MoE
    config's experts apart (routed experts only), and each --ep row is the dense parameters over
    the dp ranks plus the experts / ep over dp / ep; an ep not dividing the experts is exit 2."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, num_local_experts=4)
    cfg.save_pretrained(tmp_path)
    counted = dict(MixtralForCausalLM(cfg).named_parameters())
    psi_e = sum(p.numel() for n, p in counted.items() if ".experts." in n)
    psi = sum(p.numel() for p in counted.values())
    assert psi_e == 2 * 4 * 3 * 16 * 32  # 2 layers x 4 experts x (gate, up, down) 16 x 32
    rc, out, err = run_cli("plan", "--model", tmp_path, "--world-size", 8, "--ep", "1,2,4", "--precision", "bf16",
                           "--memory-per-device", "1MB", "--json")
    assert rc == 0, err
    rep = json.loads(out)
    assert (rep["num_params"], rep["expert_params"], rep["experts_per_layer"]) == (psi, psi_e, 4)
    for ep in (1, 2, 4):
        for stage in range(4):
            row = _one(rep, ep=ep, stage=stage, offload_optimizer="none", offload_param="none")
            want = ep_zero_formula(psi - psi_e, psi_e, stage, 8, ep, True)
            assert row["device_bytes"] == round(want) and row["dp"] == 8, (ep, stage)
            m = row["max_params"]  # the largest model of the same expert share that fits
            assert (ep_zero_formula((psi - psi_e) * m / psi, psi_e * m / psi, stage, 8, ep, True)
                    <= 10**6 < ep_zero_formula((psi - psi_e) * (m + 1) / psi, psi_e * (m + 1) / psi,
                                                             stage, 8, ep, True))
    z1 = [_one(rep, ep=ep, stage=1, offload_optimizer="none", offload_param="none")["device_bytes"] for ep in (1, 2, 4)]
    assert z1[0] > z1[1] > z1[2]
    rc, _, err = run_cli("plan", "--model", tmp_path, "--world-size", 16, "--ep", "8")
    assert rc == 2 and "--ep 8 does not divide the model's 4 experts per MoE layer" in err
    rc, _, err = run_cli("plan", "--params", "7B", "--world-size", 8, "--ep", "2")
    assert rc == 2 and "no expert parameters" in err


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("llama")
    LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=2).save_pretrained(path)
    return path


def test_sp_rows_are_the_activation_formula(llama_dir):
    """specs/cli.md --sp: per sp, fnzero.memory.activation_bytes of the --model at --seq-len x --micro-batch,
    the all-to-all bytes of forward and backward (+ recomputation), and the longest sequence whose peak
    fits beside ZeRO-3's model state; the model-state rows are those without --sp."""
    from fnzero.memory import TransformerShape, activation_bytes, longest_sequence, ulysses_bytes
    from transformers import LlamaConfig

    shape = TransformerShape.from_config(LlamaConfig.from_pretrained(llama_dir))
    args = ("plan", "--model", llama_dir, "--world-size", 8, "--precision", "bf16", "--memory-per-device", "1GB",
            "--seq-len", 4096, "--micro-batch", 2)
    rc, plain, err = run_cli(*args, "--json")
    assert rc == 0 and "sequence" not in json.loads(plain), err
    for ckpt in ((), ("--checkpointing",)):
        rc, out, err = run_cli(*args, "--sp", "1,2,8", *ckpt, "--json")
        assert rc == 0, err
        rep = json.loads(out)
        assert rep["rows"] == json.loads(plain)["rows"]
        state = _one(rep, stage=3, offload_optimizer="none", offload_param="none")["device_bytes"]
        for sp, row in zip((1, 2, 8), rep["sequence"], strict=True):
            a = activation_bytes(shape, seq_len=4096, micro_batch=2, sp=sp, dtype="bf16", checkpointing=bool(ckpt))
            assert (row["sp"], row["saved_bytes"], row["peak_bytes"]) == (sp, a.saved, a.peak)
            assert row["all_to_all_bytes"] == 2 * (3 if ckpt else 2) * ulysses_bytes(
                shape, seq_len=4096, micro_batch=2, sp=sp, dtype="bf16")
            assert row["longest_seq_len"] == longest_sequence(shape, 10**9 - state, micro_batch=2, sp=sp,
                                                              dtype="bf16", checkpointing=bool(ckpt))
        assert rep["sequence"][2]["longest_seq_len"] > 7 * rep["sequence"][0]["longest_seq_len"]


@pytest.mark.parametrize("extra,message", [
    (("--sp", "3"), "--sp 3 does not divide --world-size 8"),
    (("--sp", "0"), "give sequence-parallel sizes of at least 1"),
    (("--sp", "two"), "'two' is not a comma-separated list"),
    (("--sp", "2", "--tp", "2"), "--sp plans data- and sequence-parallel runs only"),
    (("--seq-len", "0", "--checkpointing"), "--seq-len 0 and --micro-batch 1 must be at least 1"),
    (("--sp", "2"), "--sp and --checkpointing need --model"),
])
def test_bad_sp_options_exit_2_with_one_line(extra, message):
    rc, out, err = run_cli("plan", "--params", "7B", "--world-size", 8, *extra)
    # One error line (argparse's, for a malformed value, after its usage lines).
    errors = [line for line in err.splitlines() if line.startswith("fnzero plan:")]
    assert rc == 2 and out == "" and len(errors) == 1 and message in errors[0], err


def test_sp_with_a_model_prints_the_table_or_names_what_does_not_spread(llama_dir):
    rc, out, err = run_cli("plan", "--model", llama_dir, "--world-size", 8, "--sp", "1,2", "--memory-per-device", "1GB")
    assert rc == 0 and "activations per rank" in out and "longest seq" in out, err
    for extra, message in ((("--world-size", 16, "--sp", "16"), "--sp 16 with --seq-len 4096: 8 attention heads and "
                            "2 key/value heads do not spread"),
                           (("--world-size", 8, "--sp", "8", "--seq-len", "100"),
                            "--sp 8 with --seq-len 100: a sequence of 100 tokens does not divide over 8")):
        rc, out, err = run_cli("plan", "--model", llama_dir, *extra)
        assert rc == 2 and out == "" and err.startswith(f"fnzero plan: {message}"), err
        assert len(err.strip().splitlines()) == 1
