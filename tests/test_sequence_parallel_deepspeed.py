"""fnzero's Ulysses sequence parallelism against DeepSpeed 0.19.8's own (`UlyssesSPAttentionHF`,
`UlyssesSPDataLoaderAdapter`, and transformers' `deepspeed_sp_compute_loss`) on CPU gloo ranks, run
by `_ds_ulysses_runner.py` in a subprocess with a DeepSpeed interpreter (`FNZERO_DEEPSPEED_PYTHON`,
or this one when it imports deepspeed; skipped with the reason otherwise). One launch per world
size runs all of its cases (`specs/mesh.md` §Sequence).

* Module level: the same tiny float64 Llama (seed 0, sdpa, 4 heads; kv 2, and kv 1 replicated up
  to sp 2) on the same shards: equal logits per rank, equal losses, equal gradients summed over the
  sp group, all also equal to plain torch on the whole sequence.
* Engine level: `deepspeed.initialize(..., mpu=parallel_state_sp)` at ZeRO 1, 2 and 3 at sp 2
  (world 2) and sp 2 x dp 2 (world 4), AdamW with clipping, accumulation 2, 2 steps: the same
  parameters and losses as `fnzero.train_step`. In float32: DeepSpeed's ZeRO keeps a float32 master
  (and reduces in `seq_parallel_communication_data_type`, float32 at least) whatever the model's
  dtype. At ZeRO-3 DeepSpeed 0.19.8's default reduce-scatter averages gradients over the sp ranks
  where stages 1-2 sum them; its runs there carry transformers' own compensation (each rank's share
  times sp, which `deepspeed_sp_compute_loss` applies when `is_deepspeed_zero3_enabled()`), fnzero's
  none.

DeepSpeed drops the attention mask (its wrapper passes None and relies on `is_causal` and the
position ids), so the samples are unpadded; a prompt of -100 labels in one row gives the sp ranks
unequal numbers of valid labels, which the token-weighted loss must account for.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess

import pytest
import torch
import torch.nn.functional as F
from _ds_ulysses_runner import S, V, build_llama

import _worlds as W
import fnzero
from fnzero.testing import simulated_world

HERE = os.path.dirname(os.path.abspath(__file__))
SP, ROWS, ACCUM, STEPS = 2, 2, 2, 2
KVS = (2, 1)  # module level; the engine runs kv 2 at world 2 and kv 1 at world 4
STAGES = (1, 2, 3)


def _samples(micro: int, dp: int, seed: int) -> dict[str, torch.Tensor]:
    """{"input_ids", "labels"}, each (micro-batches, dp groups, ROWS, S); row 0's first 5 labels -100."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (micro, dp, ROWS, S), generator=g)
    labels = ids.clone()
    labels[:, :, 0, :5] = -100
    return {"input_ids": ids, "labels": labels}


def _engine_config(stage: int) -> dict:
    """The one JSON both sides read (DeepSpeed takes sp from the mpu, fnzero from the key)."""
    return {
        "train_micro_batch_size_per_gpu": ROWS,
        "gradient_accumulation_steps": ACCUM,
        # Adam's update is blind to a gradient scaled as a whole (summed where it should be averaged
        # over sp or dp), and so is clipping that acts. So the norm (~1) stays under the clip, which
        # a doubled gradient would cross, and eps 1e-3 is above most gradients (~1e-5 to 1e-1), whose
        # update is then about g / eps: a factor in the gradient is a factor in their step.
        "gradient_clipping": 2.0,
        # torch_adam: DeepSpeed's AdamW as torch.optim.AdamW (its fused kernels need a build); fnzero ignores it
        "optimizer": {"type": "AdamW", "params": {"lr": W.LR, "betas": list(W.BETAS), "eps": 1e-3,
                                                  "weight_decay": W.WD, "torch_adam": True}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "sequence_parallel_size": SP,
        "steps_per_print": 10**6,
    }


# -- DeepSpeed, one launch per world size -----------------------------------------------------------
def _launch(exe: str, tmp, world: int, jobs: list[dict]) -> None:
    (tmp / "spec.json").write_text(json.dumps({"world": world, "jobs": jobs}))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([exe, os.path.join(HERE, "_ds_ulysses_runner.py"), str(tmp / "spec.json")],
                       capture_output=True, text=True, env={**env, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]


def _deepspeed_world(exe: str, tmp, world: int) -> dict:
    """DeepSpeed's results for `world`: {("module", kv): [per rank: per micro-batch dict]} at world
    2, {("engine", stage): {"losses", "params"}} at both."""
    kv_engine = 2 if world == 2 else 1
    torch.save(_samples(2, 1, seed=3), tmp / "module.pt")
    torch.save(_samples(STEPS * ACCUM, world // SP, seed=world), tmp / "engine.pt")
    jobs = [{"level": "module", "kv": kv, "sp": SP, "rows": ROWS, "samples": str(tmp / "module.pt"),
             "out": str(tmp / f"module{kv}")} for kv in (KVS if world == 2 else ())]
    jobs += [{"level": "engine", "kv": kv_engine, "sp": SP, "config": _engine_config(s),
              "samples": str(tmp / "engine.pt"), "out": str(tmp / f"engine{s}.pt")} for s in STAGES]
    _launch(exe, tmp, world, jobs)
    out = {("module", kv): [torch.load(tmp / f"module{kv}.{r}") for r in range(SP)] for kv in KVS if world == 2}
    out.update({("engine", s): torch.load(tmp / f"engine{s}.pt") for s in STAGES})
    return out


@pytest.fixture(scope="module")
def deepspeed_runs(deepspeed_python, tmp_path_factory):
    """{world: DeepSpeed's results}, each world launched once, when a test first asks for it."""
    cache: dict[int, dict] = {}

    def get(world: int) -> dict:
        if world not in cache:
            cache[world] = _deepspeed_world(deepspeed_python, tmp_path_factory.mktemp(f"ds_ulysses{world}"), world)
        return cache[world]

    return get


# -- fnzero ---------------------------------------------------------------------------------------
def _fnzero_module_level(kv: int, samples: dict) -> list[list[dict]]:
    """Per rank, per micro-batch: the shard, logits, loss and this rank's gradients (ZeRO-0, sp 2)."""
    base = build_llama(kv)
    cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": ROWS, "zero_optimization": {"stage": 0},
                              "optimizer": {"type": "AdamW", "params": {"lr": W.LR}}, "sequence_parallel_size": SP,
                              "seq_parallel_communication_data_type": None}, world_size=SP)

    def rank(comm):
        sm = fnzero.shard(copy.deepcopy(base), config=cfg, comm=comm)
        params = sm.init_state().params
        out = []
        for m in range(samples["input_ids"].shape[0]):
            batch = fnzero.shard_sequence({"input_ids": samples["input_ids"][m, 0],
                                           "labels": samples["labels"][m, 0]}, sm.sp)
            leaves = {n: t.detach().clone().requires_grad_() for n, t in params.items()}
            res = sm.apply(leaves, **batch)
            res.loss.backward()
            out.append({**batch, "logits": res.logits.detach(), "loss": res.loss.detach(),
                        "grads": sm.gather({n: t.grad for n, t in leaves.items()})})  # stage 0: whole, no collective
        return out

    return simulated_world(SP).run(rank)


def _fnzero_engine_level(kv: int, stage: int, world: int, samples: dict):
    """fnzero.train_step on the same micro-batches: (gathered parameters, losses) of rank 0."""
    base = build_llama(kv, torch.float32)
    cfg = fnzero.load_config(_engine_config(stage), world_size=world)

    def rank(comm):
        sm = fnzero.shard(copy.deepcopy(base), config=cfg, comm=comm)
        state = sm.init_state()
        step = fnzero.train_step(lambda p, b: sm.apply(p, **b).loss, cfg)
        d, losses = comm.rank // SP, []
        for t in range(STEPS):
            micro = [fnzero.shard_sequence({"input_ids": samples["input_ids"][m, d],
                                            "labels": samples["labels"][m, d]}, sm.sp)
                     for m in range(t * ACCUM, (t + 1) * ACCUM)]
            state, metrics = step(state, micro)
            losses.append(metrics["loss"])
        return sm.gather(state), losses

    return simulated_world(world).run(rank)[0]


def _whole_sequence(kv: int, ids: torch.Tensor, labels: torch.Tensor):
    """Plain torch on the whole sequence: logits, the mean next-token loss and its gradients."""
    model = build_llama(kv)
    logits = model(input_ids=ids).logits
    loss = F.cross_entropy(logits.flatten(0, 1), F.pad(labels, (0, 1), value=-100)[:, 1:].flatten())
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad for n, p in model.named_parameters()}


# -- the tests ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kv", KVS, ids=lambda kv: f"kv{kv}")
def test_module_level_equals_deepspeed_ulysses(deepspeed_runs, kv):
    """The same float64 Llama on the same shards (DeepSpeed's adapter hands the group rank 0's
    sample, then rank 1's; fnzero's shard_sequence cuts the same samples in that order): each
    rank's tokens, position ids and shifted labels are DeepSpeed's; its logits equal DeepSpeed's
    on that rank; its loss share equals DeepSpeed's local share (local sum over the group's valid
    labels) and the shares add up to DeepSpeed's loss (the group's mean); the gradients summed over
    the sp ranks equal DeepSpeed's summed. All equal plain torch on the whole sequence.

    Tolerance 1e-12 (float64; the gradients have size ~1e-1): the same products in another order.
    Measured: logits and shares bit for bit, gradients 4e-17 apart (each rank's own too).
    DeepSpeed's own `deepspeed_sp_compute_loss` (float32) gives the runner's loss to float32."""
    # ~15 s with the world-2 engine cases: one DeepSpeed launch (import ~5 s) of 2 ranks, then ~1 s here.
    ds = deepspeed_runs(2)[("module", kv)]
    samples = _samples(2, 1, seed=3)
    fz = _fnzero_module_level(kv, samples)
    tight = dict(rtol=1e-12, atol=1e-12)
    for m in range(2):
        ids, labels = samples["input_ids"][m, 0], samples["labels"][m, 0]
        for r in range(SP):
            got, want = fz[r][m], ds[r][m]
            for key in ("input_ids", "position_ids", "shift_labels"):
                assert torch.equal(got[key], want[key]), (key, r, m)
            torch.testing.assert_close(got["logits"], want["logits"], **tight)
            torch.testing.assert_close(got["loss"], want["share"], **tight)
            torch.testing.assert_close(want["tf_loss"], want["loss"].float(), rtol=1e-6, atol=0)
        assert sum(fz[r][m]["loss"] for r in range(SP)).item() == pytest.approx(ds[0][m]["loss"].item(), rel=1e-12)
        whole_logits, whole_loss, whole_grads = _whole_sequence(kv, ids, labels)
        torch.testing.assert_close(torch.cat([ds[r][m]["logits"] for r in range(SP)], 1), whole_logits, **tight)
        assert ds[0][m]["loss"].item() == pytest.approx(whole_loss.item(), rel=1e-12)
        for name, g in whole_grads.items():
            ours = sum(fz[r][m]["grads"][name] for r in range(SP))
            theirs = sum(ds[r][m]["grads"][name] for r in range(SP))
            torch.testing.assert_close(ours, theirs, **tight, msg=lambda s: f"{name} (micro {m}): {s}")
            torch.testing.assert_close(theirs, g, **tight, msg=lambda s: f"{name} DeepSpeed vs whole (micro {m}): {s}")
            assert g.abs().max() > 1e-6, name  # every parameter takes part: the agreement is not vacuous


@pytest.mark.parametrize("world,stage", [(w, s) for w in (2, 4) for s in STAGES], ids=lambda v: str(v))
def test_engine_level_equals_deepspeed_ulysses(deepspeed_runs, world, stage):
    """DeepSpeed's engine with its sp mpu and transformers' SP loss, and fnzero.train_step, take the
    same 2 steps (accumulation 2, clipping, AdamW) on the same shards at sp 2 x dp world/2: the
    same parameters and losses (stage 3: DeepSpeed with transformers' x sp compensation).

    Tolerance 2e-7 absolute on parameters of size ~0.1 (float32 on both sides: summation order
    through 2 steps); measured <= 6e-8, as far as DeepSpeed's ZeRO-3 run is from its own ZeRO-1 run.
    The steps move every parameter by 5e-4 or more; DeepSpeed's ZeRO-3 without transformers'
    compensation (its gradients averaged over sp) ends 8.5e-3 away (its second loss 1.9e-4)."""
    # ~0.2 s each here; the DeepSpeed launches (~15 s at world 2, ~20 s at world 4) are shared.
    kv = 2 if world == 2 else 1
    ds = deepspeed_runs(world)[("engine", stage)]
    params, losses = _fnzero_engine_level(kv, stage, world, _samples(STEPS * ACCUM, world // SP, seed=world))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ds["losses"]), rtol=1e-6, atol=0)
    start = build_llama(kv, torch.float32).state_dict()
    for name, p in params.items():
        torch.testing.assert_close(p, ds["params"][name], rtol=0, atol=2e-7, msg=lambda s: f"{name}: {s}")
        assert (p - start[name]).abs().max() > 1e-4, name  # the steps moved it: the agreement is not vacuous
