"""The checks of `gpu_check.py` as each rank runs them.

Every function here runs on every rank of a world that `fnzero.testing.run_world` started (NCCL
on CUDA, gloo for a dry run on the CPU), raises AssertionError naming what differs, and returns
the figures the check's line prints. Rank r trains on device r. The model is fnzero.testing's
GPT (a vocabulary and widths that no world size divides), the batch its `ModelFactory.batch`,
and every rank compares against a reference it computes itself on its own device.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time

import optree
import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel

import fnzero
from fnzero.checkpoint import load, save
from fnzero.testing import ModelFactory, assert_trees_close, assert_trees_equal, default_tolerances, step_loss

from _common import rank_device  # benchmarks/_common.py, beside this file

LR, BETAS, EPS, WD, CLIP = 1e-2, (0.9, 0.95), 1e-8, 0.1, 1.0
ROWS = 8  # global rows per step; each rank trains on its contiguous ROWS / world
GPT64 = ModelFactory("gpt", gpt=tuple(dict(vocab_size=97, seq_len=16, d_model=32, n_layer=2, n_head=2).items()),
                     dtype=torch.float64)
GPT32 = dataclasses.replace(GPT64, dtype=torch.float32)
MLP32 = ModelFactory("mlp", sizes=(8, 16, 4), dtype=torch.float32)


def config(stage: int, precision: str = "fp32", k: int = 1, zero: dict | None = None) -> fnzero.Config:
    c = {
        "train_micro_batch_size_per_gpu": ROWS // (k * dist.get_world_size()),
        "gradient_accumulation_steps": k,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD}},
        # Persistence threshold 0: at stage 3 every unit of the small model is sharded.
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **(zero or {})},
    }
    if precision == "bf16":
        c["bf16"] = {"enabled": True}
    if precision == "fp16":  # hysteresis 1: the first overflow halves the scale (fp16_overflow)
        c["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    return fnzero.load_config(c, world_size=dist.get_world_size())


def batches(factory: ModelFactory, steps: int, dev: torch.device) -> list[tuple[dict, dict]]:
    """Each step's (global batch, this rank's contiguous slice of it), on `dev`."""
    world, rank = dist.get_world_size(), dist.get_rank()
    n = ROWS // world
    out = []
    for s in range(steps):
        b = optree.tree_map(lambda x: x.to(dev), factory.batch(ROWS, seed=s))
        out.append((b, {key: x[rank * n:(rank + 1) * n] for key, x in b.items()}))
    return out


def train(factory, cfg, dev, data, *, jit: dict | None = None, gather: bool = True) -> dict:
    """fnzero's step on this rank's slices: losses, metrics, wall times, the consolidated
    parameters after the last step, and the module, step and states to go on with."""
    model = factory()
    if cfg.precision != "fp32":
        model = model.float()  # fp32 master weights, 16-bit compute
    sm = fnzero.shard(model.to(dev), config=cfg, device=dev)
    state = sm.init_state()
    step = fnzero.train_step(step_loss(sm, factory.loss), cfg)
    if jit is not None:
        step = fnzero.jit(step, **jit)
    out = {"losses": [], "metrics": [], "times": [], "states": [], "sm": sm, "step": step, "initial": state}
    for _, mine in data:
        t = time.perf_counter()
        state, m = step(state, mine)  # m["loss"] is a float: the step has finished on the device
        out["times"].append(time.perf_counter() - t)
        out["losses"].append(m["loss"])
        out["metrics"].append(m)
        out["states"].append(state)
    if gather:
        out["params"] = sm.gather(state)
    return out


def torch_reference(factory, dev, data) -> dict:
    """Plain PyTorch on the global batch: loss.backward, clip_grad_norm_, torch.optim.AdamW."""
    model = factory().to(dev)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    losses = []
    for full, _ in data:
        opt.zero_grad(set_to_none=True)
        loss = factory.loss(model, full)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": {name: p.detach() for name, p in model.named_parameters()}}


def max_diff(got: dict, want: dict) -> float:
    return max(float((got[n].double() - want[n].double()).abs().max()) for n in want)


def rel_diff(got: list[float], want: list[float]) -> float:
    return max(abs(g - w) / abs(w) for g, w in zip(got, want))


def zero_equivalence(device: str, steps: int = 3) -> dict:
    """ZeRO stages 0-3 on this world equal plain PyTorch on the global batch, in float64: the
    stages differ from it only in reduction order (~1e-16), a sharding bug by O(1)."""
    dev = rank_device(device)
    data = batches(GPT64, steps, dev)
    ref = torch_reference(GPT64, dev, data)
    figures = {"loss_rel": 0.0, "param_abs": 0.0}
    for stage in range(4):
        got = train(GPT64, config(stage), dev, data)
        what = f"ZeRO-{stage}, rank {dist.get_rank()} of {dist.get_world_size()}, {dev}"
        assert_trees_close(got["losses"], ref["losses"], rtol=1e-9, what=f"{what}: losses")
        assert_trees_close(got["params"], ref["params"], rtol=1e-9, atol=1e-12, what=f"{what}: parameters after {steps} steps")
        figures["loss_rel"] = max(figures["loss_rel"], rel_diff(got["losses"], ref["losses"]))
        figures["param_abs"] = max(figures["param_abs"], max_diff(got["params"], ref["params"]))
    return figures


def sixteen_bit(device: str, precision: str, steps: int = 3) -> dict:
    """bf16/fp16 at stages 0-3: each stage's losses and gradient norms equal stage 0's, and the
    losses follow plain fp32 PyTorch within the precision's rounding (`default_tolerances`)."""
    dev = rank_device(device)
    data = batches(GPT32, steps, dev)
    ref = torch_reference(GPT32, dev, data)
    rtol, atol, _ = default_tolerances(precision, False)
    base, figures = None, {"vs_fp32_rel": 0.0, "vs_stage0_rel": 0.0}
    for stage in range(4):
        got = train(GPT32, config(stage, precision), dev, data, gather=False)
        what = f"{precision} ZeRO-{stage}, rank {dist.get_rank()}, {dev}"
        norms = [m["grad_norm"] for m in got["metrics"]]
        assert not any(m["skipped"] for m in got["metrics"]), f"{what}: a step was skipped: {got['metrics']}"
        assert_trees_close(got["losses"], ref["losses"], rtol=rtol, atol=atol, what=f"{what}: losses vs fp32 torch")
        figures["vs_fp32_rel"] = max(figures["vs_fp32_rel"], rel_diff(got["losses"], ref["losses"]))
        if base is None:
            base = (got["losses"], norms)
            figures["loss_scale"] = got["metrics"][-1]["loss_scale"]
            continue
        assert_trees_close((got["losses"], norms), base, rtol=rtol, atol=atol, what=f"{what}: (losses, grad norms) vs ZeRO-0")
        figures["vs_stage0_rel"] = max(figures["vs_stage0_rel"], rel_diff(got["losses"], base[0]))
    if precision == "fp16":
        figures.update(fp16_overflow(dev))
    return figures


def fp16_overflow(dev: torch.device) -> dict:
    """An infinity in rank 0's slice at step 1 overflows the fp16 gradients: every rank skips that
    step (parameters unchanged bit for bit) and the next step runs at half the loss scale."""
    data = batches(MLP32, 3, dev)
    full, mine = data[1]
    full = dict(full, x=full["x"].clone())
    full["x"][0, 0] = math.inf
    n = ROWS // dist.get_world_size()
    r = dist.get_rank()
    data[1] = (full, {key: x[r * n:(r + 1) * n] for key, x in full.items()})
    got = train(MLP32, config(2, "fp16"), dev, data, gather=False)
    skipped = [m["skipped"] for m in got["metrics"]]
    scales = [m["loss_scale"] for m in got["metrics"]]
    assert skipped == [False, True, False], f"rank {r}: skipped {skipped} (an inf on rank 0 at step 1)"
    assert scales[2] == scales[1] / 2, f"rank {r}: loss scales {scales}: not halved after the overflow"
    sm = got["sm"]
    assert_trees_equal(sm.gather(got["states"][1]), sm.gather(got["states"][0]), what=f"rank {r}: the skipped step changed parameters")
    return {"overflow_scales": scales}


def whole_step_jit(device: str, backend: str = "inductor", steps: int = 4) -> dict:
    """`fnzero.jit(step, scope="step", fullgraph=True)` at ZeRO-1 with accumulation 2 (one graph:
    forward, backward, the gradients' reduce-scatter, clipping, AdamW, the all-gather) equals the
    eager step to float64 reassociation."""
    dev = rank_device(device)
    data = batches(GPT64, steps, dev)
    eager = train(GPT64, config(1, k=2), dev, data)
    jitted = train(GPT64, config(1, k=2), dev, data, jit={"scope": "step", "backend": backend, "fullgraph": True})
    what = f"jit(scope='step', backend={backend!r}), rank {dist.get_rank()}, {dev}"
    assert jitted["step"].graph_breaks == (), f"{what}: graph breaks {jitted['step'].graph_breaks}"
    assert_trees_close(jitted["losses"], eager["losses"], rtol=1e-10, what=f"{what}: losses vs eager")
    assert_trees_close(jitted["params"], eager["params"], rtol=1e-9, atol=1e-12, what=f"{what}: parameters vs eager")
    return {"loss_rel": rel_diff(jitted["losses"], eager["losses"]),
            "param_abs": max_diff(jitted["params"], eager["params"]),
            "compile_s": jitted["times"][0],
            "eager_s": sorted(eager["times"][1:])[(steps - 1) // 2],
            "jit_s": sorted(jitted["times"][1:])[(steps - 1) // 2]}


def _leaves(tree) -> list[torch.Tensor]:
    return [x for x in optree.tree_leaves(tree, none_is_leaf=True) if isinstance(x, torch.Tensor)]


# (loss and grad-norm rtol, parameter rtol, parameter atol) of the offloaded step against the
# on-device one. fp32: two AdamW kernels (torch's on the device, fnzero's C kernel on the host)
# differ by ulps per step, which Adam turns into at most ~1e-5 on near-zero-gradient parameters
# over 4 steps at lr 1e-2 (tests/test_offload_cpu.py). bf16: parameters are not compared
# elementwise: the attention key bias has a gradient that is truly 0, and bf16 rounding noise in
# it (~1e-5, above AdamW's eps) becomes lr-sized steps of either sign (measured: 1e-2 apart at
# stage 3 after 4 steps, with losses 7e-6 apart). A wrong 16-bit copy-out or a missed update moves
# the next loss by ~lr = 1e-2 relative, far outside 1e-3.
OFFLOAD_TOL = {"fp32": (1e-5, 1e-4, 5e-5), "bf16": (1e-3, None, None)}


def offload_pinned(device: str, steps: int = 4) -> dict:
    """`offload_optimizer: {device: cpu, pin_memory: true}` at stages 1 and 3, fp32 and bf16: the
    optimizer state lives on the host and the step equals the on-device step (`OFFLOAD_TOL`)."""
    dev = rank_device(device)
    data = batches(GPT32, steps, dev)
    offload = {"offload_optimizer": {"device": "cpu", "pin_memory": True}}
    figures = {"pinned": False}
    for precision, (loss_rtol, rtol, atol) in OFFLOAD_TOL.items():
        figures[precision] = (0.0, 0.0)
        for stage in (1, 3):
            what = f"offload stage {stage} {precision}, rank {dist.get_rank()}, {dev}"
            on_device = train(GPT32, config(stage, precision), dev, data)
            host = train(GPT32, config(stage, precision, zero=offload), dev, data)
            state = host["states"][-1]
            kept = _leaves(state.opt_state) + _leaves(state.master)
            assert kept and {t.device.type for t in kept} == {"cpu"}, (
                f"{what}: optimizer state on {sorted({str(t.device) for t in kept})}, not the host")
            assert {t.device for t in _leaves(state.params)} == {dev}, f"{what}: parameters left {dev}"
            norms = [[m["grad_norm"] for m in r["metrics"]] for r in (host, on_device)]
            assert_trees_close((host["losses"], norms[0]), (on_device["losses"], norms[1]), rtol=loss_rtol,
                               what=f"{what}: (losses, grad norms) vs on-device")
            if rtol is not None:
                assert_trees_close(host["params"], on_device["params"], rtol=rtol, atol=atol, what=f"{what}: parameters")
            figures[precision] = (max(figures[precision][0], rel_diff(host["losses"], on_device["losses"])),
                                  max(figures[precision][1], max_diff(host["params"], on_device["params"])))
            figures["pinned"] |= any(t.is_pinned() for t in kept)
    return figures


def checkpoint_roundtrip(device: str, root: str, steps: int = 2) -> dict:
    """Save after `steps` steps, load into a fresh state: every tensor bit-identical and on the
    same device; the next step from the loaded state equals the next step from the saved one,
    bit for bit (ZeRO-3 bf16 with fp32 master weights, ZeRO-2 fp16 with its loss scale)."""
    dev = rank_device(device)
    # The two next steps must run alike: deterministic kernels where torch has them, and the math
    # attention (a fused attention backward may accumulate in a varying order on an accelerator).
    torch.use_deterministic_algorithms(True, warn_only=True)
    with sdpa_kernel(SDPBackend.MATH):
        return _checkpoint_cases(dev, root, steps)


def _checkpoint_cases(dev: torch.device, root: str, steps: int) -> dict:
    data = batches(GPT32, steps + 1, dev)
    figures = {}
    for stage, precision in ((3, "bf16"), (2, "fp16")):
        what = f"checkpoint ZeRO-{stage} {precision}, rank {dist.get_rank()}, {dev}"
        run = train(GPT32, config(stage, precision), dev, data[:steps], gather=False)
        state, sm, step = run["states"][-1], run["sm"], run["step"]
        path = os.path.join(root, f"z{stage}_{precision}")
        t = time.perf_counter()
        save(path, state, tag="mid")
        loaded, _ = load(path, like=run["initial"], tag="mid")  # the step is pure: the initial state is intact
        figures[f"z{stage}_{precision}_s"] = time.perf_counter() - t
        assert_trees_equal(loaded, state, what=f"{what}: loaded state")
        devices = [t.device for t in _leaves(loaded)], [t.device for t in _leaves(state)]
        assert devices[0] == devices[1], f"{what}: loaded onto {devices[0]}, saved from {devices[1]}"
        after_saved, m1 = step(state, data[steps][1])
        after_loaded, m2 = step(loaded, data[steps][1])
        assert m1["loss"] == m2["loss"], f"{what}: next loss {m2['loss']!r} after load, {m1['loss']!r} without"
        assert_trees_equal(after_loaded, after_saved, what=f"{what}: the next step's state")
    return figures
