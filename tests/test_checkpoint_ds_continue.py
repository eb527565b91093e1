"""fnzero resumes checkpoints DeepSpeed 0.19.8 itself wrote and takes the steps DeepSpeed takes from
them (specs/checkpoint-format.md §DeepSpeed, "Resuming in fnzero"). DeepSpeed trains AdamW (WarmupLR,
gradient accumulation 2, clipping 1.0) 3 steps on gloo ranks, saves, and continues 2 steps at the
saved stage and, where its own loader reads the files at another stage (ZeRO-1 and 2 read each
other's), at that one too; fnzero loads the same files at the same and at another world size and
stage, and takes the same 2 steps on the same global batches. The matrix (`SAVED`, `RESUMES`):
fp32 at stages 0-3, bf16 at 0-3 and under DeepSpeed's BF16_Optimizer (bf16 ZeRO-1 with fp32
gradient accumulation), saved at 2 and 4 ranks, and a Hugging Face Llama (built from a tiny config,
tied embeddings; the loss computed here, not by transformers) at ZeRO-3. DeepSpeed runs in
subprocesses (`_ds_universal_runner.py`: one per world size and one for the Llama, every saved run
of it in the same process group; ~60 s in all on 2 cores, the file ~80 s) with the interpreter
FNZERO_DEEPSPEED_PYTHON names, or this one when it imports deepspeed; skipped with the reason
otherwise."""

from __future__ import annotations

import copy
import json
import os
import subprocess
from dataclasses import dataclass

import pytest
import torch
from _ds_universal_runner import SEQ, VOCAB, build_model, loss_of

import fnzero
from fnzero.checkpoint import load
from fnzero.checkpoint._ds_optim import MOMENTS
from fnzero.testing._threads import simulated_world

HERE = os.path.dirname(os.path.abspath(__file__))
ROWS, GAS = 8, 2  # the global batch: GAS micro-batches of ROWS / (GAS * world) rows on each rank
SAVED_STEPS, MORE_STEPS = 3, 2
FLOOR = 1e-6  # float32 rounding: a few ulps of a loss (relative) and of masters of size ~0.5 (absolute)


@dataclass(frozen=True)
class Saved:
    """One DeepSpeed run: `SAVED_STEPS` at ZeRO `stage` on `world` ranks, saved, then continued
    `MORE_STEPS` by DeepSpeed at each stage of `continued` (the first is the saved one)."""

    precision: str
    stage: int
    world: int
    continued: tuple[int, ...]
    model: str = "mlp"
    bf16_optimizer: bool = False  # bf16 ZeRO-1 accumulating in fp32: DeepSpeed's BF16_Optimizer

    @property
    def name(self) -> str:
        kind = "bf16opt" if self.bf16_optimizer else f"zero{self.stage}"
        return f"{self.model}_{self.precision}_{kind}_w{self.world}"

    @property
    def launch(self) -> str:  # the DeepSpeed subprocess that runs it
        return "llama" if self.model == "llama" else f"w{self.world}"


SAVED = {s.name: s for s in (
    Saved("fp32", 2, 2, (2, 1)), Saved("fp32", 0, 2, (0,)), Saved("fp32", 3, 2, (3,)),
    Saved("bf16", 0, 2, (0,)), Saved("bf16", 1, 2, (1, 2)), Saved("bf16", 2, 2, (2, 1)), Saved("bf16", 3, 2, (3,)),
    Saved("bf16", 1, 2, (1,), bf16_optimizer=True),
    Saved("fp32", 2, 4, (2, 1)), Saved("bf16", 2, 4, (2, 1)), Saved("bf16", 3, 4, (3,)),
    Saved("fp32", 3, 2, (3,), "llama"), Saved("fp32", 2, 2, (2, 1), "llama"),
)}

# (saved run, fnzero's stage, fnzero's world): each checkpoint at its own world and stage and at others
RESUMES = [
    ("mlp_fp32_zero2_w2", 2, 2), ("mlp_fp32_zero2_w2", 3, 2), ("mlp_fp32_zero2_w2", 2, 1), ("mlp_fp32_zero2_w2", 1, 1),
    ("mlp_fp32_zero0_w2", 0, 1), ("mlp_fp32_zero0_w2", 2, 2),
    ("mlp_fp32_zero3_w2", 3, 2), ("mlp_fp32_zero3_w2", 1, 1), ("mlp_fp32_zero3_w2", 2, 4),
    ("mlp_bf16_zero0_w2", 0, 2), ("mlp_bf16_zero0_w2", 2, 1),
    ("mlp_bf16_zero1_w2", 1, 2), ("mlp_bf16_zero1_w2", 3, 1),
    ("mlp_bf16_zero2_w2", 2, 2), ("mlp_bf16_zero2_w2", 1, 1),
    ("mlp_bf16_zero3_w2", 3, 2), ("mlp_bf16_zero3_w2", 2, 1),
    ("mlp_bf16_bf16opt_w2", 1, 2), ("mlp_bf16_bf16opt_w2", 3, 1),
    ("mlp_fp32_zero2_w4", 2, 4), ("mlp_fp32_zero2_w4", 3, 2), ("mlp_fp32_zero2_w4", 1, 1),
    ("mlp_bf16_zero2_w4", 2, 4), ("mlp_bf16_zero2_w4", 1, 2),
    ("mlp_bf16_zero3_w4", 3, 4), ("mlp_bf16_zero3_w4", 2, 2), ("mlp_bf16_zero3_w4", 1, 1),
    ("llama_fp32_zero3_w2", 3, 2), ("llama_fp32_zero3_w2", 2, 1),
]


def _config(stage: int, world: int, precision: str = "fp32", bf16_optimizer: bool = False) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": ROWS // (GAS * world),
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR",
                      "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2, "warmup_num_steps": 10}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 10**6,
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if bf16_optimizer:
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    return cfg


def _batches(model: str, n: int = SAVED_STEPS + MORE_STEPS, seed: int = 11) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    if model == "llama":  # token ids, which are their own targets (shifted by the loss)
        return [(ids, ids) for ids in (torch.randint(0, VOCAB, (ROWS, SEQ), generator=g) for _ in range(n))]
    return [(torch.randn(ROWS, 8, generator=g), torch.randn(ROWS, 4, generator=g)) for _ in range(n)]


@pytest.fixture(scope="module")
def deepspeed_runs(tmp_path_factory, deepspeed_python):  # noqa: F811
    """`get(saved)`: (checkpoint root, what the engine held when it saved, {stage: DeepSpeed's
    continuation}); each launch (every saved run of one world size, or the Llama's) runs once, when
    a test first needs it."""
    done: dict[str, dict] = {}

    def get(saved: Saved):
        if saved.launch not in done:
            runs = [s for s in SAVED.values() if s.launch == saved.launch]
            done[saved.launch] = _launch(tmp_path_factory.mktemp(f"ds_{saved.launch}"), deepspeed_python, runs)
        return done[saved.launch][saved.name]

    return get


def _launch(tmp, deepspeed_python: str, saved: list[Saved]) -> dict:
    """One DeepSpeed subprocess trains, saves and continues every run of `saved` (one world size)."""
    jobs, outs = [], {}
    for s in saved:
        d = tmp / s.name
        d.mkdir()
        batches = _batches(s.model)
        torch.save(batches[:SAVED_STEPS], d / "first.pt")
        torch.save(batches[SAVED_STEPS:], d / "more.pt")
        runs = [{"config": _config(t, s.world, s.precision, s.bf16_optimizer and t == 1), "out": str(d / f"ds{t}.pt")}
                for t in s.continued]
        outs[s.name] = (d, runs)
        jobs.append({"model": s.model, "load": str(d / "ds"), "batches": str(d / "more.pt"), "runs": runs,
                     "train": {"config": _config(s.stage, s.world, s.precision, s.bf16_optimizer),
                               "batches": str(d / "first.pt"), "save": str(d / "ds"), "out": str(d / "saved.pt")}})
    (tmp / "spec.json").write_text(json.dumps({"world": saved[0].world, "jobs": jobs}))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([deepspeed_python, os.path.join(HERE, "_ds_universal_runner.py"), str(tmp / "spec.json")],
                       capture_output=True, text=True, env={**env, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return {s.name: (str(d / "ds"), torch.load(d / "saved.pt"), {t: torch.load(run["out"]) for t, run in
                                                                  zip(s.continued, runs)})
            for s in saved for d, runs in [outs[s.name]]}


def _fnzero_continues(root: str, saved: Saved, stage: int, world: int):
    """fnzero loads `root` at `stage` on `world` simulated ranks and takes MORE_STEPS on each rank's
    rows of the same global batches: (losses, {name: fp32 master}, step, {field: {name: tensor}}
    as loaded: the parameters, the masters and Adam's moments)."""
    cfg_dict = _config(stage, world, saved.precision, saved.bf16_optimizer and stage == 1)
    more = _batches(saved.model)[SAVED_STEPS:]
    base = build_model(saved.model)  # once: the simulated ranks are threads sharing one RNG
    dtype = torch.bfloat16 if saved.precision == "bf16" else torch.float32

    def fn(comm):
        cfg = fnzero.load_config(cfg_dict, world_size=world)
        sm = fnzero.shard(copy.deepcopy(base), config=cfg, comm=comm)
        state, _ = load(root, like=sm.init_state(), config=cfg)
        loaded = {"param": sm.gather(state.params), "master": sm.gather(state),
                  **{k: sm.gather(getattr(state.opt_state, k)) for k in MOMENTS}}
        step = fnzero.train_step(lambda p, b: loss_of(saved.model, lambda *a, **k: sm.apply(p, *a, **k), *b), cfg)
        r, n = comm.rank, ROWS // world
        losses = []
        for x, y in more:
            x = x.to(dtype) if x.is_floating_point() else x
            state, m = step(state, (x[r * n:(r + 1) * n], y[r * n:(r + 1) * n]))
            losses.append(float(m["loss"]))
        return losses, sm.gather(state), int(state.step), loaded

    return simulated_world(world).run(fn)[0]


def _distance(a: dict, b: dict) -> tuple[float, float]:
    """(largest relative loss difference, largest fp32 master difference) of two continuations."""
    loss = max(abs(x - y) / abs(y) for x, y in zip(a["losses"], b["losses"]))
    return loss, max(float((a["masters"][n] - b["masters"][n]).abs().max()) for n in b["masters"])


def _spread(deepspeed_runs, model: str, precision: str) -> tuple[float, float]:
    """DeepSpeed's own stage-to-stage spread for `model` in `precision`: the largest `_distance`
    between two of its continuations of checkpoints its ZeRO optimizers wrote (stages 1-3 and
    BF16_Optimizer, at 2 and 4 ranks): the same checkpoint continued at two stages, and runs saved
    at other stages and world sizes, all from the same weights on the same batches. (A bf16 stage-0
    run, DeepSpeed's unfused optimizer accumulating gradients in bf16, is a trajectory of its own,
    1e-3 away from the others; it is judged against the same tolerance.)"""
    runs = [r for s in SAVED.values() if s.model == model and s.precision == precision and s.stage > 0
            for r in deepspeed_runs(s)[2].values()]
    pairs = [_distance(a, b) for i, a in enumerate(runs) for b in runs[i + 1:]]
    return max(p[0] for p in pairs), max(p[1] for p in pairs)


@pytest.mark.parametrize("name,stage,world", RESUMES, ids=[f"{n}-to-zero{s}_w{w}" for n, s, w in RESUMES])
def test_fnzero_takes_the_steps_deepspeed_takes_from_its_checkpoint(deepspeed_runs, name, stage, world):
    """The load is exact: fnzero's parameters, fp32 masters and both Adam moments, as loaded, equal
    bit for bit what DeepSpeed's engine held when it saved, and the first loss agrees to float32
    rounding of the mean (FLOOR; measured <= 1.2e-7). The 2 steps after it are within DeepSpeed's own stage-to-stage
    spread (`_spread`), floored at FLOOR. Measured (torch 2.13, 2-core CPU): the spread is 1.0e-7
    (losses) and 3.0e-8 (masters) in fp32, 0 and 1.2e-7 for the Llama, fnzero within 1.0e-7 and
    1.2e-7; in bf16 3.3e-4 and 1.3e-4 (a bf16 parameter a rounding flip away moves the next loss
    by ~1e-4), fnzero within 1.6e-4 and 7.8e-5. Every master moves by > 1e-3 over the 2 steps, so
    a wrong lr, Adam step or moment fails."""
    saved = SAVED[name]
    root, held, ds = deepspeed_runs(saved)
    want = ds[saved.stage]
    assert want["global_steps"] == SAVED_STEPS + MORE_STEPS and want["skipped_steps"] == 0
    assert (want["optimizer"] == "BF16_Optimizer") == saved.bf16_optimizer, want["optimizer"]
    losses, masters, step, loaded = _fnzero_continues(root, saved, stage, world)
    assert step == SAVED_STEPS + MORE_STEPS
    for n, h in held.items():  # the load itself is exact: what DeepSpeed's engine held when it saved
        for k in ("param", "master", *MOMENTS):  # (DeepSpeed's bf16 parameters: its masters rounded)
            assert torch.equal(loaded[k][n], h[k]), (n, k)
    spread = _spread(deepspeed_runs, saved.model, saved.precision)
    cap = (FLOOR, FLOOR) if saved.precision == "fp32" else (5e-4, 2e-4)  # the tolerance means something: a
    assert spread[0] <= cap[0] and spread[1] <= cap[1], spread  # step moves every master by > 1e-3
    loss_err, master_err = _distance({"losses": losses, "masters": masters}, want)
    first = abs(losses[0] - want["losses"][0]) / abs(want["losses"][0])
    print(f"{name} ({want['optimizer']}) -> fnzero zero{stage} w{world}: first loss {first:.1e}, losses "
          f"{loss_err:.1e} masters {master_err:.1e}; DeepSpeed's spread {spread[0]:.1e} {spread[1]:.1e}")
    assert first <= FLOOR and loss_err <= max(FLOOR, spread[0]) and master_err <= max(FLOOR, spread[1])
    assert min(float((p - loaded["master"][n]).abs().max()) for n, p in masters.items()) > 1e-3  # not vacuous
