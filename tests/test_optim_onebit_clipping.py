"""`gradient_clipping` on the steps where a 1-bit optimizer's ranks hold their own gradients
(specs/optim.md §1-bit optimizers, Clipping), as DeepSpeed's engine clips them: in fp32 every rank
divides by the mean of the ranks' norms (`clip_grad_norm_` all-reduces norm / N over the
data-parallel group), in fp16/bf16 each by its own norm (its FP16 optimizers' norm is local).

Two ranks whose gradients differ several-fold in norm (7x at the start), clipping active after the
freeze: the two rules give clearly different updates there."""

from __future__ import annotations

import pytest
import torch

import fnzero
from fnzero.testing import simulated_world

from _onebit_reference import CLIP, Tiny, local_grads, loss_of, norm
from test_optim_onebit import CASES, config

N = 2


def _data():
    """Rank 1's targets five times rank 0's scale: its gradients' norm is several times rank 0's."""
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(4 * N, 5, generator=g, dtype=torch.float64), torch.randn(4 * N, 3, generator=g, dtype=torch.float64)
    y[4:] *= 5.0
    return lambda r: (x[4 * r:4 * r + 4], y[4 * r:4 * r + 4])


def _model():
    torch.manual_seed(0)
    return Tiny().double()


def _run(cfg, steps, dtype, data, loss_weight=lambda step, rank: 1.0):
    """Each rank's gathered parameters, master weights and step metrics; rank r's loss at step i is
    times `loss_weight(i, r)`."""
    model = _model()

    def rank(comm):
        m = Tiny().to(dtype)
        m.load_state_dict(model.state_dict())
        sm = fnzero.shard(m, config=cfg, comm=comm)
        state = sm.init_state()
        step = fnzero.train_step(lambda p, b: loss_of(sm.apply(p, b[0]).double(), b[1]) * b[2], cfg)
        metrics = []
        for i in range(steps):
            x, y = data(comm.rank)
            state, out = step(state, (x.to(dtype), y, loss_weight(i, comm.rank)))
            metrics.append(out)
        master = state.master if state.master is not None else state.params
        return sm.gather(state), {k: v.double().clone() for k, v in master.items()}, metrics

    return simulated_world(N).run(rank)


@pytest.mark.parametrize("kind", list(CASES))
def test_fp32_ranks_clip_their_own_gradients_by_the_mean_of_the_ranks_norms(kind):
    """Every rank's parameters equal the float64 reference of DeepSpeed's algorithm (`_onebit_reference`,
    whose local gradients are clipped by the mean of the ranks' norms) within 1e-9; for 1-bit Adam the
    last step's `grad_norm` is that mean, computed here by hand from each rank's gradient."""
    params, ref, steps = CASES[kind]
    model, data, h = _model(), _data(), {**params, "betas": tuple(params["betas"])}
    want = ref(model, data, N, steps, h)
    got = _run(config(kind, params, N), steps, torch.float64, data)
    for r, (params_r, _, _) in enumerate(got):
        for k in want[r]:
            torch.testing.assert_close(params_r[k], want[r][k], rtol=0, atol=1e-9, msg=lambda m: f"{kind} r{r} {k}: {m}")
    if kind == "OneBitAdam":  # its ranks' parameters agree, so the reference's previous step is every rank's
        before = ref(model, data, N, steps - 1, h)[0]
        norms = [norm(local_grads(model, before, *data(r), 2)) for r in range(N)]
        assert max(norms) > 3 * min(norms) and min(norms) > CLIP  # clipping active, the ranks far apart
        for _, _, metrics in got:
            assert metrics[-1]["grad_norm"] == pytest.approx(sum(norms) / N, rel=1e-12)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("kind", list(CASES))
def test_16_bit_ranks_clip_their_own_gradients_by_their_own_norm(kind, precision):
    """After the freeze rank 1's loss is scaled by 4 (its gradients exactly 4x: a power of two): a rank
    clipped by its own norm sends the same clipped gradient (up to the 1e-6 beside the norm), so every
    rank's fp32 master weights are those of the unscaled run to 1e-6; by the mean of the norms, rank
    0's coefficient would change too, moving them by about the learning rate."""
    params, _, steps = CASES[kind]
    frozen_from = params.get("freeze_step", params.get("var_freeze_step")) + 1
    extra = {"fp16": {"enabled": True, "initial_scale_power": 4}} if precision == "fp16" else {"bf16": {"enabled": True}}
    cfg = config(kind, params, N, **extra)
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    plain = _run(cfg, steps, dtype, _data())
    scaled = _run(cfg, steps, dtype, _data(), lambda i, r: 4.0 if r == 1 and i >= frozen_from else 1.0)
    for (_, want, m1), (_, got, m2) in zip(plain, scaled):
        assert not any(m["skipped"] for m in m1 + m2)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6, msg=lambda m: f"{kind} {k}: {m}")
