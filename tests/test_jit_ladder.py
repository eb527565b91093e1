"""One ladder (specs/architecture.md §How a batch flows): the eager step and every `fnzero.jit`
scope run the same phases, so every optimizer form gives the eager step's result under each.

The forms: the config's optimizer block, a `fnzero.optim` Optimizer given to `train_step`, and a
chain of gradient transformations, each with and without the config's `scheduler` (without it a
given optimizer keeps its own lr, which the graph holds as a constant). Scopes "units" and "loss"
compile the forward and backward and run the eager rest; scope "step" traces the optimizer too
(`graph_update`; a chain's own `update`).

Cost: the compiles are the test's time, so they are shared where torch.compile allows it. One
model is sharded once and its loss function serves every case, so scope "loss" compiles one graph
for all six forms (its cache is keyed on the function and its guards, which do not involve the
optimizer); every state is a copy of one initial state with the form's optimizer state. Each
"units" step compiles the Linear forward once for all units; each "step" graph is its own (the
optimizer is in it). `aot_eager` (dynamo and AOTAutograd, no code generation) keeps each compile
to a second or two; inductor's code generation for the whole step is checked in
tests/test_jit_step.py.
"""

from __future__ import annotations

import optree
import pytest
import torch

import fnzero
from fnzero import optim

import _worlds as W

KIND, STAGE, K, STEPS = "mlp:4,6,3", 2, 2, 3
WARMUP = {"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 2e-2,
                                                       "warmup_num_steps": 4}}}
FORMS = {
    "config": None,
    "optimizer": lambda: optim.adamw(lr=3e-2, betas=(0.8, 0.9), weight_decay=0.05),
    # every stateful transform the step's extras reach: the global norm, the momentum's first step,
    # Adam's bias corrections from the count, the lr
    "chain": lambda: optim.chain(optim.clip_by_global_norm(0.5), optim.scale_by_adam(b1=0.8), optim.trace(0.5),
                                 optim.add_decayed_weights(0.01), optim.scale_by_learning_rate(3e-2)),
}
SCOPES = ("units", "loss", "step")

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _run(step, state, batches):
    losses, lrs = [], []
    for batch in batches:
        state, m = step(state, batch)
        losses.append(m["loss"])
        lrs.append(m["lr"])
    return state, losses, lrs


def test_every_optimizer_form_gives_the_eager_result_under_every_jit_scope():
    cfg = W.config(STAGE, k=K, clip=0.5)
    sm = fnzero.shard(W.make_model(KIND), config=cfg, comm=fnzero.LocalCollectives())
    state0 = sm.init_state()

    def loss_fn(params, batch):
        return W.loss_of(KIND, sm.apply(params, batch[0]), batch[1])

    batches = []
    for s in range(STEPS):
        x, y = W.global_batch(KIND, s, 1, K, 2, torch.float64)
        batches.append((x[:, 0].flatten(0, 1), y[:, 0].flatten(0, 1)))
    checked = []
    for form, make in FORMS.items():
        opt = make() if make is not None else None
        for sched in (False, True):
            step_cfg = W.config(STAGE, k=K, clip=0.5, extra=WARMUP if sched else None)
            eager = fnzero.train_step(loss_fn, step_cfg, optimizer=opt)
            # The same parameters; the form's own optimizer state (stage 2 on one rank: the
            # optimizer updates each whole unit, so its state is built over the units' buffers).
            start = state0 if opt is None else state0.replace(opt_state=eager.opt.init(state0.params))
            want, want_losses, want_lrs = _run(eager, fnzero.tree_clone(start), batches)
            assert (want_lrs[0] is None) == (opt is not None and not sched), (form, sched, want_lrs)
            for scope in SCOPES:
                what = f"{form}, {'a' if sched else 'no'} scheduler, scope {scope}"
                jitted = fnzero.jit(eager, backend="aot_eager", scope=scope, fullgraph=True)
                got, losses, lrs = _run(jitted, fnzero.tree_clone(start), batches)
                assert lrs == want_lrs, what
                assert max(abs(a - b) for a, b in zip(losses, want_losses)) <= 1e-12, (what, losses, want_losses)
                # the graph's optimizer is `graph_update`: the same formulas, reassociated
                W.assert_close_tree(got.params, want.params, rtol=1e-10, atol=1e-12, what=what)
                got_opt, want_opt = optree.tree_leaves(got.opt_state), optree.tree_leaves(want.opt_state)
                assert len(got_opt) == len(want_opt), what
                W.assert_close_tree(dict(enumerate(got_opt)), dict(enumerate(want_opt)), rtol=1e-10, atol=1e-12,
                                    what=f"{what}: optimizer state")
                assert int(got.step) == STEPS and jitted.graph_breaks == (), what
                checked.append(what)
    assert len(checked) == len(FORMS) * 2 * len(SCOPES)
