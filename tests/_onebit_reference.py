"""A plain float64 simulation of DeepSpeed's 1-bit Adam, 0/1 Adam and 1-bit LAMB and of their
compressed all-reduce, over N workers' local gradients at once (the mirror's
deepspeed/runtime/fp16/onebit/*.py and runtime/comm/nccl.py, written out without fnzero):
what tests/test_optim_onebit.py holds fnzero's step to."""

from __future__ import annotations

import math

import torch
from torch import nn


# ---- the reference: DeepSpeed's compressed_allreduce (runtime/comm/nccl.py), over all ranks at once ----
def padded_unit(numel, n):
    return -(-numel // n) * n


def padded(numel, n):
    step = n * math.lcm(n, 8)
    return -(-numel // step) * step


def sign(x):
    return torch.where(x >= 0, 1.0, -1.0).to(x.dtype)


def ref_compressed(xs, workers, servers):
    """xs[r]: rank r's tensor; workers[r], servers[r]: its errors (None: zeros). Returns (the result
    every rank gets, flat over the padded length; new worker errors; new server errors)."""
    n = len(xs)
    if n == 1:
        return xs[0].reshape(-1).clone(), workers, servers
    m = padded(xs[0].numel(), n)
    ys = [torch.cat([x.reshape(-1), x.new_zeros(m - x.numel())]) + (0 if w is None else w) for x, w in zip(xs, workers)]
    scales = [torch.linalg.vector_norm(y) / math.sqrt(m) for y in ys]
    new_workers = [y - s * sign(y) for y, s in zip(ys, scales)]
    c = m // n
    chunks, new_servers = [], []
    for j in range(n):
        signs = torch.stack([sign(y[j * c:(j + 1) * c]) for y in ys])
        z = (signs * (torch.stack(scales) * (1 / n)).unsqueeze(1)).sum(0) + (0 if servers[j] is None else servers[j])
        s = torch.linalg.vector_norm(z) / math.sqrt(c)
        new_servers.append(z - s * sign(z))
        chunks.append(s * sign(z))
    return torch.cat(chunks), new_workers, new_servers


def ref_allreduce_tensors(per_rank, workers, servers, name):
    """`ref_compressed` of tensor `name` of each rank's dict, in its shape, errors updated in place."""
    n = len(per_rank)
    out, w, s = ref_compressed([d[name] for d in per_rank], [wr.get(name) for wr in workers],
                               [sr.get(name) for sr in servers])
    for r in range(n):
        workers[r][name], servers[r][name] = w[r], s[r]
    like = per_rank[0][name]
    return out[:like.numel()].view_as(like)


# ---- the model and its local gradients ----
class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(7, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def loss_of(out, y):
    return ((out - y) ** 2).mean()


def local_grads(model, params, x, y, k):
    """One rank's gradient: the mean over k micro-batches of the mean loss's gradient."""
    total = {n: torch.zeros_like(p) for n, p in params.items()}
    for xm, ym in zip(x.chunk(k), y.chunk(k)):
        leaves = {n: p.clone().requires_grad_(True) for n, p in params.items()}
        loss = loss_of(torch.func.functional_call(model, leaves, (xm,)), ym)
        for n, g in zip(leaves, torch.autograd.grad(loss, list(leaves.values()))):
            total[n] += g
    return {n: g / k for n, g in total.items()}


def mean(ds):
    return clip({n: sum(d[n] for d in ds) / len(ds) for n in ds[0]})


CLIP = 0.5  # active on most steps


def norm(g):
    return math.sqrt(sum(float(x.pow(2).sum()) for x in g.values()))


def clip(g, by=None):
    """`g` clipped to CLIP as DeepSpeed's clip_grad_norm_ (runtime/utils.py): times
    CLIP / (norm + 1e-6) where that is below 1; the norm is `g`'s own unless given (`by`)."""
    coef = CLIP / ((norm(g) if by is None else by) + 1e-6)
    return {n: x * coef for n, x in g.items()} if coef < 1 else g


# ---- the references of the three optimizers (DeepSpeed's runtime/fp16/onebit/*.py) ----
def rank_grads(model, params_of, data, n):
    """Every rank's gradient at its parameters (`params_of(r)`): as computed, and clipped as
    DeepSpeed's fp32 engine clips the gradients each rank holds alone (the steps it does not
    all-reduce): clip_grad_norm_ all-reduces norm / N over the data-parallel group, so every rank
    divides by the mean of the ranks' norms. (The averaged gradients of the other steps are
    clipped by their own norm, in `mean`.)"""
    raw = [local_grads(model, params_of(r), *data(r), 2) for r in range(n)]
    by = sum(norm(g) for g in raw) / n
    return raw, [clip(g, by) for g in raw]


def adam_moments(m, v, g, b1, b2):
    """Both moments follow the (averaged) gradient, in place, without bias correction."""
    for k in m:
        m[k] = b1 * m[k] + (1 - b1) * g[k]
        v[k] = b2 * v[k] + (1 - b2) * g[k] * g[k]


def ref_onebit_adam(model, data, n, steps, h):
    p = {k: v.detach().clone() for k, v in model.named_parameters()}
    m = {k: torch.zeros_like(v) for k, v in p.items()}
    v = {k: torch.zeros_like(x) for k, x in p.items()}
    workers, servers = [{} for _ in range(n)], [{} for _ in range(n)]
    b1, b2 = h["betas"]
    for t in range(1, steps + 1):
        raw, grads = rank_grads(model, lambda r: p, data, n)
        if t == 1:
            continue
        if t - 1 < max(h["freeze_step"], 2):
            adam_moments(m, v, mean(raw), b1, b2)
        else:
            mr = [{k: b1 * m[k] + (1 - b1) * gr[k] for k in p} for gr in grads]
            m = {k: ref_allreduce_tensors(mr, workers, servers, k) for k in p}
        for k in p:
            p[k] = p[k] - h["lr"] * (m[k] / (v[k].sqrt() + h["eps"]) + h["weight_decay"] * p[k])
    return [p] * n


def ref_zero_one_adam(model, data, n, steps, h):
    p0 = {k: v.detach().clone() for k, v in model.named_parameters()}
    P = [dict(p0) for _ in range(n)]
    M = [{k: torch.zeros_like(x) for k, x in p0.items()} for _ in range(n)]
    A = [{k: torch.zeros_like(x) for k, x in p0.items()} for _ in range(n)]
    v = {k: torch.zeros_like(x) for k, x in p0.items()}
    workers, servers = [{} for _ in range(n)], [{} for _ in range(n)]
    b1, b2, eps, wd, lr = *h["betas"], h["eps"], h["weight_decay"], h["lr"]
    var_interval, var_counter, lsi, ls_counter, lrs = 1, 0, 1, 0, 0.0
    frozen = lambda c: c >= 2 and c > h["var_freeze_step"]  # noqa: E731
    for t in range(1, steps + 1):
        raw, grads = rank_grads(model, lambda r: P[r], data, n)
        if t == 1:
            continue
        fz = frozen(t - 1)
        if not fz and t % var_interval == 0:
            g = mean(raw)
            for r in range(n):
                M[r] = {k: b1 * M[r][k] + (1 - b1) * g[k] for k in p0}
            v = {k: b2 * v[k] + (1 - b2) * g[k] * g[k] for k in p0}
        elif not fz:
            avg = {k: ref_allreduce_tensors(grads, workers, servers, k) for k in p0}
            M = [{k: b1 * M[r][k] + (1 - b1) * avg[k] for k in p0} for r in range(n)]
        else:
            M = [{k: b1 * M[r][k] + (1 - b1) * grads[r][k] for k in p0} for r in range(n)]
            lrs += lr
        for r in range(n):
            for k in p0:
                upd = M[r][k] / (v[k].sqrt() + eps) + wd * P[r][k]
                P[r][k] = P[r][k] - lr * upd
                if fz:
                    A[r][k] = A[r][k] - lr * upd
        if fz and t % lsi == 0:
            scaled = [{k: A[r][k] * (v[k].sqrt() + eps) for k in p0} for r in range(n)]
            for r in range(n):
                P[r] = {k: P[r][k] - A[r][k] for k in p0}
            avg = {k: ref_allreduce_tensors(scaled, workers, servers, k) for k in p0}
            for r in range(n):
                M[r] = {k: -(avg[k] / lrs) for k in p0}
                P[r] = {k: P[r][k] + avg[k] / (v[k].sqrt() + eps) for k in p0}
                A[r] = {k: torch.zeros_like(x) for k, x in p0.items()}
            lrs = 0.0
        if not fz:
            if t % var_interval == 0:
                var_counter += 1
                if var_counter == h["var_update_scaler"]:
                    var_counter, var_interval = 0, var_interval * 2
        else:
            ls_counter += 1
            if ls_counter == h["local_step_scaler"]:
                ls_counter, lsi = 0, min(h["local_step_clipper"], lsi * 2)
        if not fz and frozen(t):
            workers, servers = [{} for _ in range(n)], [{} for _ in range(n)]
    return P


def ref_onebit_lamb(model, data, n, steps, h):
    # Long: DeepSpeed's OnebitLamb.step, warm-up and compressed halves, written out plainly.
    p = {k: v.detach().clone() for k, v in model.named_parameters()}
    names = list(p)
    z = lambda: {k: torch.zeros_like(x) for k, x in p.items()}  # noqa: E731
    m, v, fresh = z(), z(), z()
    coeff_freeze, last_factor, scaling = dict.fromkeys(names, 0.0), dict.fromkeys(names, 1.0), {}
    workers, servers, tail = [None] * n, [None] * n, None
    b1, b2, eps, wd, lr = *h["betas"], h["eps"], h["weight_decay"], h["lr"]
    for t in range(1, steps + 1):
        raw, grads = rank_grads(model, lambda r: p, data, n)
        if t == 1:
            continue
        if t - 1 < max(h["freeze_step"], 2):
            adam_moments(m, v, mean(raw), b1, b2)
            for k in names:
                if t == h["freeze_step"]:
                    fresh[k] = v[k].clone()
                upd = m[k] / (v[k].sqrt() + eps) + wd * p[k]
                wn, un = p[k].pow(2).sum().sqrt(), upd.pow(2).sum().sqrt()
                c = min(max(float(wn / un), h["min_coeff"]), h["max_coeff"]) if wn != 0 and un != 0 else 1.0
                if c != 1.0:
                    coeff_freeze[k] = h["coeff_beta"] * coeff_freeze[k] + (1 - h["coeff_beta"]) * c
                p[k] = p[k] - lr * c * upd
            continue
        last = dict(m)
        if not scaling:
            sc = {k: float(torch.linalg.vector_norm(m[k]) / math.sqrt(m[k].numel())) for k in names}
            united = sum(sc.values()) / len(sc)
            scaling = {k: united / sc[k] for k in names}
        flats = [torch.cat([((b1 * m[k] + (1 - b1) * gr[k]) * scaling[k]).reshape(-1) for k in names]
                           + ([] if tail is None else [tail])) for gr in grads]
        out, workers, servers = ref_compressed(flats, workers, servers)
        off = 0
        for k in names:
            m[k] = out[off:off + p[k].numel()].view_as(p[k]) / scaling[k]
            off += p[k].numel()
        tail = out[off:]
        for k in names:
            gr = (m[k] - last[k] * b1) / (1 - b1)
            fresh[k] = b2 * fresh[k] + (1 - b2) * gr * gr
            denom = v[k].sqrt() + eps
            prelim = m[k] / denom
            upd = prelim + wd * p[k]
            f = float((denom / (fresh[k].sqrt() + eps)).max())
            ratio = min(1.0, float(prelim.pow(2).sum().sqrt() / upd.pow(2).sum().sqrt()))
            f = f * ratio + (1 - ratio)
            f = min(max(f, h["factor_min"]), h["factor_max"])
            f = min(max(f, last_factor[k] * (1 - h["factor_threshold"])), last_factor[k] * (1 + h["factor_threshold"]))
            last_factor[k] = f
            p[k] = p[k] - lr * (coeff_freeze[k] * f) * upd
    return [p] * n
