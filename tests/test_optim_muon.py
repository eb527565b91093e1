"""Muon (specs/optim.md §Muon): DeepSpeed 0.19.8's `"type": "Muon"` at ZeRO stage 0 equals a plain
float64 reference of DeepSpeed's algorithm written here (Muon for the hidden matrices, AdamW for
embeddings, the LM head and biases), a user's chain with `scale_by_muon` trains, DeepSpeed's own
`muon_update` numbers are reproduced at its compute dtype's precision, and what is not built is
refused. Stages 1-3: tests/test_optim_muon_zero.py."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import fnzero
from fnzero import optim
from fnzero._errors import ConfigError
from fnzero.testing import simulated_world

NS_ABC = (3.4445, -4.7750, 2.0315)


# ---- the reference: DeepSpeed 0.19.8 runtime/zero/muon/original_muon.py, in float64 ----
def ref_orthogonalize(g, steps):
    """The standard quintic iteration (Gram NS is the same polynomial, rearranged)."""
    a, b, c = NS_ABC
    x = g.mT if g.size(0) > g.size(1) else g
    x = x / (torch.linalg.matrix_norm(x) + 1e-7)
    for _ in range(steps):
        s = x @ x.mT
        x = a * x + (b * s + c * s @ s) @ x
    return x.mT if g.size(0) > g.size(1) else x


def ref_step(params, grads, state, h):
    """One step of DeepSpeed's MuonWithAuxAdam on whole parameters (name -> tensor)."""
    state["t"] += 1
    t, out = state["t"], {}
    for n, p in params.items():
        g = grads[n]
        if p.ndim >= 2 and "embed" not in n and "lm_head" not in n:
            m = state.setdefault(("m", n), torch.zeros_like(p)) * h["momentum"] + g * (1 - h["momentum"])
            state[("m", n)] = m
            u = g * (1 - h["momentum"]) + m * h["momentum"] if h["nesterov"] else m
            o = ref_orthogonalize(u, h["ns_steps"]) * math.sqrt(max(1.0, p.size(0) / p.size(1)))
            out[n] = p * (1 - h["muon_lr"] * h["wd"]) - h["muon_lr"] * o
        else:
            b1, b2 = h["betas"]
            m = state.setdefault(("m", n), torch.zeros_like(p)) * b1 + g * (1 - b1)
            v = state.setdefault(("v", n), torch.zeros_like(p)) * b2 + g * g * (1 - b2)
            state[("m", n)], state[("v", n)] = m, v
            d = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + h["eps"])
            out[n] = p * (1 - h["adam_lr"] * h["wd"]) - h["adam_lr"] * d
    return out


class TinyLM(nn.Module):
    """An embedding, a tall and a wide hidden matrix with biases, an LM head: every grouping case."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 6)
        self.up = nn.Linear(6, 10)  # weight 10 x 6: tall, scaled by sqrt(10 / 6)
        self.down = nn.Linear(10, 6)  # weight 6 x 10: wide (Gram NS)
        self.lm_head = nn.Linear(6, 16, bias=False)

    def forward(self, ids):
        return self.lm_head(self.down(torch.tanh(self.up(self.embed(ids)))))


def _loss(logits, labels):  # computed here: float64 throughout
    return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))


CLIP, STEPS = 0.3, 3
BASE = {"muon_lr": 0.05, "adam_lr": 0.01, "momentum": 0.9, "weight_decay": 0.1, "betas": [0.8, 0.95], "eps": 1e-8}


def _reference(model, ids, labels, h):
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {"t": 0}
    for _ in range(STEPS):
        leaves = {n: t.clone().requires_grad_(True) for n, t in params.items()}
        loss = _loss(torch.func.functional_call(model, leaves, (ids,)), labels)
        grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
        coef = min(1.0, CLIP / (float(norm) + 1e-6))
        params = ref_step(params, {n: g * coef for n, g in grads.items()}, state, h)
    return params


CASES = {  # name -> (the config's ns_method, an optimizer= chain of the user's or None, reference hyper-parameters)
    "config-gram-nesterov": ("gram", None, {"nesterov": True, "ns_steps": 5}),
    "config-standard": ("standard", None, {"nesterov": True, "ns_steps": 5}),
    "chain-no-nesterov-3-steps": ("gram", dict(nesterov=False, ns_steps=3), {"nesterov": False, "ns_steps": 3}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_muon_at_zero_0_equals_deepspeeds_algorithm_in_float64(case):
    """2 simulated ranks, 2 micro-batches each, clipping active: every parameter within 1e-9 of
    the reference (Muon with its lr scale for up/down weights, AdamW for embed, biases, lm_head)."""
    ns_method, chain_kwargs, extra = CASES[case]
    h = {**BASE, "wd": BASE["weight_decay"], **extra}
    params = {k: v for k, v in BASE.items()}
    cfg = fnzero.load_config({
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": CLIP,
        "zero_optimization": {"stage": 0}, "optimizer": {"type": "Muon", "params": {**params, "ns_method": ns_method}},
    }, world_size=2)
    torch.manual_seed(0)
    model = TinyLM().double()
    ids, labels = torch.randint(0, 16, (8, 5)), torch.randint(0, 16, (8, 5))
    want = _reference(model, ids, labels, h)
    opt = None
    if chain_kwargs is not None:
        opt = optim.as_optimizer(optim.muon_chain(lr=0.05, adam_lr=0.01, momentum=0.9, weight_decay=0.1,
                                                  betas=(0.8, 0.95), eps=1e-8, **chain_kwargs))

    def rank(comm):
        m = TinyLM().double()
        m.load_state_dict(model.state_dict())
        sm = fnzero.shard(m, config=cfg, comm=comm)
        state = sm.init_state(optimizer=opt)
        step = fnzero.train_step(lambda p, b: _loss(sm.apply(p, b[0]), b[1]), cfg, optimizer=opt)
        rows = slice(4 * comm.rank, 4 * comm.rank + 4)
        for _ in range(STEPS):
            state, _ = step(state, (ids[rows], labels[rows]))
        return sm.gather(state)

    for got in simulated_world(2).run(rank):
        assert sorted(got) == sorted(want)
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=0, atol=1e-9, msg=lambda msg: f"{case} {n}: {msg}")
        assert not torch.allclose(got["up.weight"], model.up.weight), "the Muon half moved"


def test_a_users_chain_with_scale_by_muon_trains():
    """`chain(clip, scale_by_muon, lr)` over matrices only (a bias-free MLP), one rank: equals the
    reference with no decay, Nesterov, and the loss falls."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 8, bias=False), nn.Tanh(), nn.Linear(8, 3, bias=False)).double()
    x, y = torch.randn(16, 4, dtype=torch.float64), torch.randn(16, 3, dtype=torch.float64)
    tx = optim.chain(optim.scale_by_muon(momentum=0.9), optim.scale_by_learning_rate(0.02))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    want, ref_state, state = dict(params), {"t": 0}, tx.init(params)
    h = {"momentum": 0.9, "nesterov": True, "ns_steps": 5, "muon_lr": 0.02, "wd": 0.0}
    losses = []
    for _ in range(6):
        leaves = {n: t.clone().requires_grad_(True) for n, t in params.items()}
        loss = nn.functional.mse_loss(torch.func.functional_call(model, leaves, (x,)), y)
        losses.append(float(loss.detach()))
        grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
        updates, state = tx.update(grads, state, params)
        params = optim.apply_updates(params, updates)
        want = ref_step(want, grads, ref_state, h)
        for n in params:
            torch.testing.assert_close(params[n], want[n], rtol=0, atol=1e-12)
    assert losses[-1] < losses[0]
    with pytest.raises(ConfigError, match=r"'0.bias' has shape \(8,\).*partition"):
        tx.init({"0.weight": torch.zeros(8, 4), "0.bias": torch.zeros(8)})


# DeepSpeed 0.19.8's own `muon_update(g2, m)` after `muon_update(g1, m)` (beta 0.95, 5 steps), run on
# its CPU accelerator, where Gram NS runs in fp32 and the standard iteration in bf16 (`ns_compute_dtype`).
DEEPSPEED_MUON_UPDATE = {
    ((3, 5), "gram", True): [[0.065611, 0.561479, 0.418897, -0.049008, -0.188132],
                             [-0.608347, 0.239677, -0.013838, -0.4009, 0.314474],
                             [0.259472, 0.138978, -0.282254, -0.528262, -0.267721]],
    ((5, 3), "gram", False): [[0.579565, 0.430201, 0.016813], [-0.508783, -0.323381, 0.013323],
                              [-0.240704, 0.455384, -0.652057], [0.295364, -0.123896, 0.908185],
                              [0.780048, -0.90754, -0.025168]],
    ((4, 6), "standard", True): [[0.574219, 0.40625, -0.032959, -0.226562, -0.089355, -0.042725],
                                 [0.355469, 0.170898, 0.119141, 0.523438, 0.769531, 0.15918],
                                 [0.443359, -0.507812, -0.679688, -0.204102, 0.041992, -0.257812],
                                 [0.271484, -0.023315, 0.139648, 0.337891, 0.000694, -0.640625]],
}


@pytest.mark.parametrize("key", list(DEEPSPEED_MUON_UPDATE), ids=str)
def test_scale_by_muon_reproduces_deepspeeds_muon_update(key):
    """fp32 (Gram, as DeepSpeed's fp32) agrees to 2e-5 (the inputs are fp32, the numbers rounded to
    6 places); DeepSpeed's standard iteration ran in bf16 (8 bits of mantissa), so 3e-2 there."""
    shape, method, nesterov = key
    k = torch.arange(shape[0] * shape[1], dtype=torch.float64)
    g1 = torch.sin(1.3 * k + 0.2).reshape(shape).float()
    g2 = torch.cos(0.7 * k - 0.4).reshape(shape).float()
    tx = optim.scale_by_muon(momentum=0.95, nesterov=nesterov, ns_method=method)
    state = tx.init({"w": g1})
    _, state = tx.update({"w": g1}, state)
    got, _ = tx.update({"w": g2}, state)
    assert got["w"].dtype == torch.float32
    tol = 2e-5 if method == "gram" else 3e-2
    torch.testing.assert_close(got["w"], torch.tensor(DEEPSPEED_MUON_UPDATE[key]), rtol=0, atol=tol)


def test_gram_and_standard_agree_in_float64():
    """The two iterations are one polynomial: in float64 they agree to rounding, wide, tall, batched."""
    from fnzero.optim._newton_schulz import orthogonalize

    gen = torch.Generator().manual_seed(3)
    for shape in [(3, 7), (7, 3), (2, 4, 9), (5, 5)]:
        g = torch.randn(shape, generator=gen, dtype=torch.float64)
        torch.testing.assert_close(orthogonalize(g, 5, "gram"), orthogonalize(g, 5, "standard"), rtol=0, atol=1e-12)


MINIMAL = {"train_batch_size": 2}


def test_muon_config_defaults_and_shared_lr():
    """DeepSpeed 0.19.8: Muon's lr 0.02 and Adam's 3e-4 when lr is absent; a shared lr sets both."""
    cfg = fnzero.load_config({**MINIMAL, "optimizer": {"type": "muon"}}, world_size=2)
    assert cfg.to_dict()["optimizer"]["params"] == {
        "lr": 0.02, "muon_lr": 0.02, "adam_lr": 0.0003, "momentum": 0.95, "weight_decay": 0.0, "ns_method": "gram",
        "betas": [0.9, 0.95], "eps": 1e-10, "adam_w_mode": True, "torch_adam": False, "per_head_muon": False,
    }
    shared = fnzero.load_config({**MINIMAL, "optimizer": {"type": "Muon", "params": {"lr": 1e-3, "adam_lr": 5e-4}}})
    assert (shared.optimizer.params.muon_lr, shared.optimizer.params.adam_lr) == (1e-3, 5e-4)
    assert fnzero.load_config(shared.to_json(), world_size=shared.world_ranks) == shared
    assert fnzero.schedules.from_config(shared)(0) == 1e-3  # the schedule is Muon's lr


@pytest.mark.parametrize("params,match", [
    ({"ns_method": "svd"}, "ns_method"),
    ({"nesterov": False}, "nesterov"),  # not a DeepSpeed 0.19.8 key (it always uses Nesterov)
    ({"momentum": 1.0}, "momentum"),
])
def test_muon_config_refusals(params, match):
    with pytest.raises(ConfigError, match=match):
        fnzero.load_config({**MINIMAL, "optimizer": {"type": "Muon", "params": params}})


def test_adam_follows_the_schedule_as_deepspeed_schedulers_set_it():
    """WarmupCosineLR scales each group's own lr (Adam's stays in proportion); WarmupLR sets every
    group's lr to the schedule's (DeepSpeed's `_format_param`), Adam's too."""
    def adam_step_lr(scheduler):
        cfg = fnzero.load_config({**MINIMAL, "scheduler": scheduler,
                                  "optimizer": {"type": "Muon", "params": {"muon_lr": 0.02, "adam_lr": 0.002}}})
        tx = optim.chain_from_config(cfg)
        p = {"b": torch.zeros(3, dtype=torch.float64)}
        g = {"b": torch.ones(3, dtype=torch.float64)}
        upd, _ = tx.update(g, tx.init(p), p, lr=0.01)
        return -float(upd["b"][0])  # Adam's first step is lr * 1 / (1 + eps')

    cosine = {"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_num_steps": 1}}
    assert adam_step_lr(cosine) == pytest.approx(0.001, rel=1e-6)
    assert adam_step_lr({"type": "WarmupLR", "params": {"warmup_num_steps": 1}}) == pytest.approx(0.01, rel=1e-6)
