"""fnzero.jit(step, scope="units"): each unit module's forward (and its backward) is its own
torch.compile graph, shared by units of one structure, around the eager step (specs/jit.md
§Per unit). Results equal the eager step's: bit for bit with aot_eager, at every stage on 1 and 2
ranks; within float64 reassociation with inductor, at stages 0 and 3 on 2 ranks (one cold compile
of the unit graphs in the suite: a single-rank inductor run would compile the same graphs again).
"""

from __future__ import annotations

import contextvars

import pytest
import torch

import fnzero
from fnzero.testing import run_world

import _worlds as W

STEPS = 3
UNITS = {"backend": "aot_eager", "scope": "units"}

# The loss-scope cases at stage 3 break at each unit by design (test_jit.py checks those breaks).
pytestmark = [pytest.mark.usefixtures("fresh_dynamo"),
              pytest.mark.filterwarnings("ignore:fnzero.jit. graph break:fnzero.JitWarning")]



class _GraphCounter:
    """A backend that records each forward graph dynamo hands it, then runs it with aot_eager."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_func

        self.graphs.append(gm)
        return aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g.forward))(gm, example_inputs)

    def count(self, fragment: str) -> int:
        return sum(any(fragment in str(n.target) for n in gm.graph.nodes) for gm in self.graphs)


def _max_param_diff(a, b):
    return max((a["params"][n] - b["params"][n]).abs().max().item() for n in a["params"])


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_per_unit_graphs_match_eager_bit_for_bit(stage):
    # float64, accumulation 2, clipping: aot_eager runs the eager aten ops, so any difference
    # means a unit ran other math, or with another unit's parameters.
    a = W.train_fnzero("gpt", stage, STEPS, fnzero.LocalCollectives(), k=2)
    b = W.train_fnzero("gpt", stage, STEPS, fnzero.LocalCollectives(), k=2, jit=dict(UNITS, fullgraph=True))
    assert a["losses"] == b["losses"]
    assert _max_param_diff(a, b) == 0.0
    assert b["graph_breaks"] == ()  # every unit is one graph, stage 3 included


def test_repeated_blocks_share_one_graph():
    # The test GPT's units: wte, wpe (both Embedding, of different input rank), two blocks,
    # ln_f and head. Five graphs, not six: the second block reuses the first block's.
    counter = _GraphCounter()
    b = W.train_fnzero("gpt", 2, 2, fnzero.LocalCollectives(), k=2, jit={"backend": counter, "scope": "units"})
    a = W.train_fnzero("gpt", 2, 2, fnzero.LocalCollectives(), k=2)
    assert a["losses"] == b["losses"]
    assert len(counter.graphs) == 5, [gm.code for gm in counter.graphs]
    assert counter.count("scaled_dot_product_attention") == 1
    assert counter.count("embedding") == 2


# Both backends on two gloo ranks in one world (a world costs seconds to start). The unit graphs
# themselves are the same at every stage (gathers, reductions and hooks run around them, eagerly):
# aot_eager, exact, runs every stage, so each stage's eager machinery meets compiled units on real
# ranks; inductor runs stage 0 (the unit graphs of stages 0-2, node for node) and stage 3.
_REAL_RANK_RUNS = ([(("aot_eager", s), "aot_eager", "units", s, None) for s in (0, 1, 2, 3)]
                   + [(("inductor", s), "inductor", "units", s, None) for s in (0, 3)])


@pytest.fixture(scope="module")
def two_real_ranks():
    (out, _) = run_world(W.spawned_jit_runs, 2, _REAL_RANK_RUNS, STEPS, timeout=600)
    return out


def _real_rank_results(out, backend):
    got = {stage: r for (b, stage), r in out.items() if b == backend}
    assert sorted(got) == sorted(s for (b, s), *_ in _REAL_RANK_RUNS if b == backend)
    return got


def test_per_unit_graphs_match_eager_on_two_real_ranks(two_real_ranks):
    for stage, r in _real_rank_results(two_real_ranks, "aot_eager").items():
        assert r["param"] == 0.0 and r["loss"] == 0.0, (stage, r)
        assert r["breaks"] == (), (stage, r["breaks"])


def test_inductor_per_unit_graphs_match_eager_on_two_real_ranks(two_real_ranks):
    # The real compiler on two gloo ranks.
    for stage, r in _real_rank_results(two_real_ranks, "inductor").items():
        assert r["param"] < 1e-12 and r["loss"] < 1e-12, (stage, r)
        assert r["breaks"] == (), (stage, r["breaks"])


@pytest.mark.parametrize("precision,stage", [("fp16", 2), ("fp16", 3), ("bf16", 3)])
def test_mixed_precision_and_loss_scaling_match_eager(precision, stage):
    kw = dict(k=2, dtype=torch.float32, precision=precision)
    a = W.train_fnzero("gpt", stage, 4, fnzero.LocalCollectives(), **kw)
    b = W.train_fnzero("gpt", stage, 4, fnzero.LocalCollectives(), jit=UNITS, **kw)
    assert a["losses"] == b["losses"]
    assert [m["loss_scale"] for m in a["metrics"]] == [m["loss_scale"] for m in b["metrics"]]
    assert _max_param_diff(a, b) == 0.0


@pytest.mark.parametrize("scope", ["units", "loss"])
@pytest.mark.parametrize("offload", ["cpu", "nvme+params"])
def test_offloaded_steps_match_eager(offload, scope, tmp_path):
    # ZeRO-Offload (host optimizer, C kernel) and ZeRO-Infinity (optimizer state and stage-3
    # parameter shards on NVMe): the compiled graphs sit between the same host-side reads,
    # gathers and writes as the eager forward, so results are bit-identical with aot_eager.
    z = {"stage": 3, "stage3_param_persistence_threshold": 0, "offload_optimizer": {"device": offload.split("+")[0]}}
    if offload != "cpu":
        z["offload_optimizer"]["nvme_path"] = str(tmp_path / "a")
        z["offload_param"] = {"device": "nvme", "nvme_path": str(tmp_path / "a")}
    kw = dict(k=2, dtype=torch.float32, precision="bf16", donate=True)
    a = W.train_fnzero("gpt", 3, 3, fnzero.LocalCollectives(), extra={"zero_optimization": z}, **kw)
    if offload != "cpu":
        z = dict(z, offload_optimizer=dict(z["offload_optimizer"], nvme_path=str(tmp_path / "b")),
                 offload_param={"device": "nvme", "nvme_path": str(tmp_path / "b")})
    b = W.train_fnzero("gpt", 3, 3, fnzero.LocalCollectives(), extra={"zero_optimization": z},
                       jit={"backend": "aot_eager", "scope": scope}, **kw)
    assert a["losses"] == b["losses"]
    assert _max_param_diff(a, b) == 0.0


def test_unit_hooks_leave_other_scopes_and_eager_steps_as_they_were():
    # The unit modules of a model once run with scope="units" keep their compile hooks; outside
    # that scope they open no window, and inside a trace they are traced through: a whole-loss
    # graph stays one graph, and the eager step compiles nothing.
    r = W.train_fnzero("gpt", 0, 1, fnzero.LocalCollectives(), jit=UNITS, return_state=True)
    sm, state = r["sm"], r["state"]
    cfg = W.config(0, 1, 2, 1, 1.0, "fp32", None)

    def loss_fn(params, batch):
        x, y = batch
        return W.loss_of("gpt", sm.apply(params, x), y)

    batch = tuple(t[0, 0] for t in W.global_batch("gpt", 1, 1, 1, 2, torch.float64))
    eager = fnzero.train_step(loss_fn, cfg)
    counter = _GraphCounter()
    whole = fnzero.jit(eager, backend=counter, fullgraph=True, scope="loss")
    s1, m1 = eager(fnzero.tree_clone(state), batch)
    assert counter.graphs == []
    s2, m2 = whole(fnzero.tree_clone(state), batch)
    assert m1["loss"] == m2["loss"] and whole.graph_breaks == ()
    assert len(counter.graphs) == 1 and counter.count("scaled_dot_product_attention") == 1


def test_a_model_without_unit_modules_compiles_its_loss_function():
    # One nn.Linear is a single root unit: its one graph is the loss function's, by default.
    torch.manual_seed(0)
    cfg = fnzero.load_config({"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    sm = fnzero.shard(torch.nn.Linear(4, 2).double(), config=cfg)
    step = fnzero.train_step(lambda p, b: (sm.apply(p, b[0]) - b[1]).square().mean(), cfg)
    counter = _GraphCounter()
    jitted = fnzero.jit(step, backend=counter)
    batch = (torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64))
    state = sm.init_state()
    _, m = jitted(fnzero.tree_clone(state), batch)
    _, e = step(state, batch)
    assert m["loss"] == e["loss"] and len(counter.graphs) == 1 and jitted.graph_breaks == ()


def test_units_is_the_default_scope():
    assert fnzero.jit(fnzero.train_step(lambda p, b: b, W.config(0))).scope == "units"


def test_recomputation_off_the_step_thread_uses_the_runs_compiler():
    # On CUDA autograd runs backward (and so a recomputation inside the model) on its device
    # thread, where the step's context variable is unset: the run's own compiler must serve, or
    # the recomputed forward would be eager while the first was compiled (dropout draws differ).
    from types import SimpleNamespace

    from fnzero.sharding.zero._ambient import ambient, within
    from fnzero.sharding.zero._unit_hooks import unit_compiler

    compiler, other = (lambda: "window"), (lambda: "other")
    assert ambient().unit_compiler is None
    assert unit_compiler(None) is None
    assert unit_compiler(SimpleNamespace(unit_compiler=None)) is None
    assert unit_compiler(SimpleNamespace(unit_compiler=compiler)) is compiler
    with within(unit_compiler=other):  # the step's own thread: the ambient's
        assert unit_compiler(SimpleNamespace(unit_compiler=compiler)) is other


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 6).double()

    def forward(self, x):
        return torch.tanh(self.lin(x))


class _ChecksItsBlocks(torch.nn.Module):
    """Checkpoints each block's call from outside the block, as transformers' checkpointing layers
    do: the recomputation in backward calls the unit module again, hooks and all."""

    def __init__(self, reentrant):
        super().__init__()
        self.blocks, self.reentrant = torch.nn.ModuleList(_Block() for _ in range(2)), reentrant

    def forward(self, x):
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.reentrant)
        return x


class _ForwardRunCounter:
    """A backend that counts how often its compiled forward graphs run (aot_eager underneath)."""

    def __init__(self):
        self.forward_runs = 0

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_func

        def forward_compiler(g, _):
            boxed = make_boxed_func(g.forward)

            def run(args):
                self.forward_runs += 1
                return boxed(args)

            run._boxed_call = True
            return run

        return aot_autograd(fw_compiler=forward_compiler,
                            bw_compiler=lambda g, _: make_boxed_func(g.forward))(gm, example_inputs)


@pytest.mark.parametrize("stage,reentrant", [(0, True), (3, False)])
def test_recomputation_in_backward_runs_the_units_compiled_graph(stage, reentrant):
    # specs/jit.md §Per unit: a unit recomputed in backward runs in its compile window again, so the
    # recomputation is the compiled graph (two blocks: two forwards and two recomputations per step).
    def run(jit):
        torch.manual_seed(0)
        cfg = W.config(stage, 1, 2)
        sm = fnzero.shard(_ChecksItsBlocks(reentrant), config=cfg, wrap=[_Block])
        step = fnzero.train_step(lambda p, b: sm.apply(p, b).square().mean(), cfg)
        step = step if jit is None else fnzero.jit(step, backend=jit, fullgraph=True)
        state, losses = sm.init_state(), []
        for s in range(2):
            x = torch.randn(2, 6, generator=torch.Generator().manual_seed(s), dtype=torch.float64)
            state, m = step(state, x.requires_grad_(reentrant))  # (reentrant checkpointing wants an input that does)
            losses.append(m["loss"])
        return losses, sm.gather(state)

    counter = _ForwardRunCounter()
    (jit_losses, jit_params), (losses, params) = run(counter), run(None)
    assert counter.forward_runs == 2 * 4
    assert jit_losses == losses
    W.assert_close_tree(jit_params, params, rtol=0, atol=0, what=f"stage {stage}")


@pytest.mark.parametrize("stage", [0, 3])
def test_units_scope_leaves_every_module_as_built(stage):
    # specs/jit.md §Per unit: hooks registered on the unit modules compile their forwards; after
    # units-scope steps no module has a forward of its own, another class or another parameter
    # table, and the results are the eager step's, bit for bit.
    def run(jit):
        cfg = W.config(stage, 2)
        model = W.make_model("gpt")
        built = {name: (type(m), id(m._parameters)) for name, m in model.named_modules()}
        sm = fnzero.shard(model, config=cfg)
        step = fnzero.train_step(lambda p, b: W.loss_of("gpt", sm.apply(p, b[0]), b[1]), cfg)
        step = step if not jit else fnzero.jit(step, **UNITS, fullgraph=True)
        state, losses = sm.init_state(), []
        for s in range(2):
            x, y = W.global_batch("gpt", s, 1, 2, 2, torch.float64)
            state, m = step(state, (x[:, 0].flatten(0, 1), y[:, 0].flatten(0, 1)))
            losses.append(m["loss"])
        assert [name for name, m in model.named_modules() if "forward" in vars(m)] == []
        assert {name: (type(m), id(m._parameters)) for name, m in model.named_modules()} == built
        return losses, sm.gather(state)

    (jit_losses, jit_params), (losses, params) = run(True), run(False)
    assert jit_losses == losses
    W.assert_close_tree(jit_params, params, rtol=0, atol=0, what=f"stage {stage}")


class _Selector:
    """A switch set and restored around a forward, the way the `kernels` package's
    `use_kernelized_func` wrapper does around every Hugging Face attention layer (transformers 5.2x):
    a context variable when eager, a plain attribute while torch.compile traces."""

    def __init__(self):
        self.context_var = contextvars.ContextVar("selector", default=None)
        self.traced_value, self.tracing = None, False

    def set(self, value):
        if self.tracing or torch.compiler.is_compiling():
            previous, self.traced_value, self.tracing = self.traced_value, value, True
            return previous
        return self.context_var.set(value)

    def reset(self, token):
        if self.tracing:
            self.traced_value, self.tracing = token, token is not None
        else:
            self.context_var.reset(token)


_SELECTOR = _Selector()


class _CheckpointedBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 6).double()

    def _inner(self, x):
        token = _SELECTOR.set({"kernel": self.lin})  # outside state, restored below
        try:
            return torch.tanh(self.lin(x))
        finally:
            _SELECTOR.reset(token)

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self._inner, x, use_reentrant=False)


@pytest.mark.parametrize("scope", ["units", "loss"])
def test_a_checkpointed_region_that_restores_outside_state_compiles_whole(scope):
    # specs/jit.md §Checkpointing: dynamo breaks a checkpoint region at any mutation of outside
    # state unless the forward's side effects may run once; a set-and-restore is the same either way.
    torch.manual_seed(0)
    cfg = fnzero.load_config({"train_batch_size": 4, "gradient_clipping": 1.0,
                              "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}})
    model = torch.nn.Sequential(_CheckpointedBlock(), _CheckpointedBlock())
    sm = fnzero.shard(model, config=cfg, wrap=[_CheckpointedBlock])
    step = fnzero.train_step(lambda p, b: sm.apply(p, b).square().mean(), cfg)
    jitted = fnzero.jit(step, backend="aot_eager", scope=scope, fullgraph=True)
    batch = torch.randn(4, 6, dtype=torch.float64)
    state = sm.init_state()
    s_jit, m_jit = jitted(fnzero.tree_clone(state), batch)
    s_eager, m_eager = step(state, batch)
    assert jitted.graph_breaks == () and jitted.fallback_reason is None
    assert m_jit["loss"] == m_eager["loss"] and _SELECTOR.traced_value is None
    W.assert_close_tree(s_jit.params, s_eager.params, rtol=0, atol=0, what=f"scope {scope}")
