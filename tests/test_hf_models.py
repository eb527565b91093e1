"""Hugging Face transformers models train under fnzero exactly like plain PyTorch
(`specs/sharding.md` §Models from the ecosystem).

Four architectures built from small configs (nothing is downloaded): GPT-2 (tied embeddings,
Conv1D), Llama (RoPE with a non-persistent `inv_freq`, RMSNorm, grouped-query attention), a
BERT-style masked-LM encoder (tied decoder, padding mask) and a T5-style encoder-decoder (shared
embeddings, relative position bias). Keyword inputs go in, `ModelOutput`s come out, and the
model's own gradient checkpointing (`gradient_checkpointing_enable()`, reentrant and not) runs
inside fnzero's sharded forward.

The reference is plain PyTorch on the global batch: torch.optim.AdamW, `loss.backward()` per
(rank, micro-batch) chunk weighted as DDP weighs it, `clip_grad_norm_`. float64, so the only
difference is reduction order (~1e-16 per operation): 1e-9 relative is far above that noise and
far below any sharding bug.
"""

from __future__ import annotations

import functools
import threading

import pytest
import torch
import transformers
from optree import tree_leaves as optree_leaves

import fnzero
from fnzero.sharding.comm._collectives import PendingTensor
from fnzero.sharding.zero._plan import default_unit_modules
from fnzero.testing import simulated_world

import _worlds as W

transformers.logging.set_verbosity_error()  # "use_cache=True is incompatible with ..." per layer

RTOL, ATOL = 1e-9, 1e-12  # float64 reduction order, see the module docstring
VOCAB, SEQ, LR, CLIP = 64, 8, 1e-2, 0.5
_BUILD = threading.Lock()


def build(kind: str, gc: str = "off") -> torch.nn.Module:
    """A small float64 model of `kind`, seeded; `gc`: "off", "reentrant" or "non-reentrant"."""
    with _BUILD:
        torch.manual_seed(0)
        t = transformers
        if kind == "gpt2":
            m = t.GPT2LMHeadModel(t.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=16,
                                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
        elif kind == "llama":
            m = t.LlamaForCausalLM(t.LlamaConfig(hidden_size=16, intermediate_size=36, num_hidden_layers=2,
                                                 num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                                 max_position_embeddings=32))
        elif kind == "bert":
            m = t.BertForMaskedLM(t.BertConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                               intermediate_size=36, vocab_size=VOCAB, max_position_embeddings=16,
                                               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
        elif kind == "t5":
            m = t.T5ForConditionalGeneration(t.T5Config(d_model=16, d_kv=8, d_ff=36, num_layers=2, num_decoder_layers=2,
                                                        num_heads=2, vocab_size=VOCAB, dropout_rate=0.0,
                                                        decoder_start_token_id=0, pad_token_id=0))
        else:
            raise ValueError(kind)
        m = m.double().train()
        if gc != "off":
            enable_checkpointing(m, reentrant=gc == "reentrant")
        return m


def enable_checkpointing(model, reentrant: bool) -> None:
    """transformers' layer checkpointing: `activation_checkpointing_enable` since 5.x, which
    deprecates the older name (still what most scripts call, and the same mechanism)."""
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})


def chunk(kind: str, step: int, index: int, rows: int = 2) -> dict[str, torch.Tensor]:
    """The keyword batch of one (rank, micro-batch) chunk."""
    g = torch.Generator().manual_seed(1000 * step + index)
    ids = torch.randint(1, VOCAB, (rows, SEQ), generator=g)
    if kind == "bert":
        mask = torch.ones(rows, SEQ, dtype=torch.int64)
        mask[0, -2:] = 0  # padding: the attention mask reaches every layer
        labels = torch.where(torch.rand(rows, SEQ, generator=g) < 0.5, ids, torch.full_like(ids, -100))
        labels[:, 0] = ids[:, 0]  # at least one position counts in every row
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if kind == "t5":
        return {"input_ids": ids, "labels": torch.randint(1, VOCAB, (rows, SEQ // 2), generator=g)}
    return {"input_ids": ids, "labels": ids}


def config(stage: int, world: int, k: int, extra: dict | None = None) -> fnzero.Config:
    return fnzero.load_config({
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": k,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **(extra or {})},
    }, world_size=world)


@functools.lru_cache(maxsize=None)
def reference(kind: str, world: int, k: int, steps: int) -> dict[str, torch.Tensor]:
    model = build(kind)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for s in range(steps):
        opt.zero_grad()
        for i in range(world * k):
            (model(**chunk(kind, s, i)).loss / (world * k)).backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train(kind: str, stage: int, world: int, gc: str, *, k: int = 2, steps: int = 2, jit: dict | None = None,
          extra: dict | None = None) -> list[dict[str, torch.Tensor]]:
    """fnzero on a simulated world: rank r's micro-batch i is chunk r * k + i, as in `reference`."""
    cfg = config(stage, world, k, extra)

    def rank(comm):
        model = build(kind, gc)
        # Every rank has built its model before any trains: torch.utils.checkpoint forks and
        # restores torch's global RNG in backward, which would reseed a rank still building.
        comm.barrier()
        sm = fnzero.shard(model, config=cfg, comm=comm)
        state = sm.init_state()
        step = fnzero.train_step(lambda params, batch: sm.apply(params, **batch).loss, cfg)
        if jit is not None:
            step = fnzero.jit(step, **jit)
        for s in range(steps):
            state, _ = step(state, [chunk(kind, s, comm.rank * k + i) for i in range(k)])
        return sm.gather(state)

    return simulated_world(world).run(rank)


def check(kind, stage, world, gc, k=2, steps=2, **kw):
    want = reference(kind, world, k, steps)
    for r, got in enumerate(train(kind, stage, world, gc, k=k, steps=steps, **kw)):
        W.assert_close_tree(got, want, rtol=RTOL, atol=ATOL, what=f"{kind} stage {stage} gc={gc} rank {r}/{world}")


KINDS = ["gpt2", "llama", "bert", "t5"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_two_ranks_with_and_without_checkpointing(kind, stage):
    for gc in ("off", "reentrant", "non-reentrant"):
        check(kind, stage, 2, gc)


@pytest.mark.parametrize("world", [1, 4])
@pytest.mark.parametrize("kind", KINDS)
def test_one_and_four_ranks(kind, world):
    # Every stage at each world size, the checkpointing mode rotating with the stage.
    modes = ("reentrant", "non-reentrant", "off", "reentrant") if world == 1 else ("non-reentrant", "reentrant", "reentrant", "non-reentrant")
    for stage, gc in enumerate(modes):
        check(kind, stage, world, gc, k=1)


@pytest.mark.parametrize("stage", [0, 3])
def test_checkpointing_under_jit(stage):
    # Per-unit graphs (the default scope) with the model's checkpoint inside each layer's graph.
    # One rank: torch.compile is not thread-safe, so it does not run on a thread-simulated world.
    for gc in ("reentrant", "non-reentrant"):
        check("llama", stage, 1, gc, jit={"backend": "aot_eager"})


def test_default_units_are_the_models_layers():
    # specs/sharding.md §Plan: as FSDP's transformer wrap policy, the _no_split_modules layers; an
    # untied language model's input embedding and head are units too (FSDP2/torchtitan wrap them).
    assert default_unit_modules(build("llama")) == ["model.embed_tokens", "model.layers.0", "model.layers.1", "lm_head"]
    # BertForMaskedLM declares nothing itself; its BertModel names BertEmbeddings and BertLayer.
    assert default_unit_modules(build("bert")) == ["bert.embeddings", "bert.encoder.layer.0", "bert.encoder.layer.1"]
    t5 = default_unit_modules(build("t5"))  # tied: `shared` serves both, so the root keeps it
    assert t5 == [f"{s}.block.{i}" for s in ("encoder", "decoder") for i in (0, 1)]
    # A stage-3 plan gathers one layer at a time; embeddings, final norm and the tied head are root.
    sm = fnzero.shard(build("gpt2"), config=config(3, 1, 1))
    root = sm.plan.unit("<root>")
    assert [s.name for s in root.slots] == ["transformer.wte.weight", "transformer.wpe.weight",
                                            "transformer.ln_f.weight", "transformer.ln_f.bias"]
    assert root.slots[0].aliases == ("lm_head.weight",)
    assert len(sm.plan.units) == 3
    # Untied: the embedding and the head are sharded units gathered for their own forward; only
    # the final norm stays in the root.
    plan = fnzero.shard(build("llama"), config=config(3, 1, 1)).plan
    assert plan.unit_names == ("<root>", "model.embed_tokens", "model.layers.0", "model.layers.1", "lm_head")
    assert [s.name for s in plan.unit("<root>").slots] == ["model.norm.weight"]
    for name in ("model.embed_tokens", "lm_head"):
        assert [s.name for s in plan.unit(name).slots] == [f"{name}.weight"] and plan.params_sharded(plan.unit(name))
    # The same Llama with its head tied to its embedding: one tensor, kept in the root.
    tied = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=16, intermediate_size=36, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, tie_word_embeddings=True))
    assert default_unit_modules(tied) == ["model.layers.0", "model.layers.1"]


class _Lora(torch.nn.Module):
    """A frozen linear layer plus a trainable low-rank update, as LoRA adapters do."""

    def __init__(self, base: torch.nn.Linear, r: int = 2):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.a = torch.nn.Parameter(torch.randn(r, base.in_features, dtype=base.weight.dtype) * 0.1)
        self.b = torch.nn.Parameter(torch.randn(base.out_features, r, dtype=base.weight.dtype) * 0.1)

    def forward(self, x):
        return self.base(x) + x @ self.a.t() @ self.b.t()


def _llama_lora(gc="off"):
    model = build("llama", gc)
    with _BUILD:
        torch.manual_seed(1)
        model.requires_grad_(False)
        for layer in model.model.layers:
            layer.self_attn.q_proj = _Lora(layer.self_attn.q_proj)
            layer.self_attn.v_proj = _Lora(layer.self_attn.v_proj)
    return model


@pytest.mark.parametrize("stage", [0, 3])
def test_lora_adapters_train_alone(stage):
    """Only the adapters are trainable: the optimizer holds them and nothing else, the frozen base
    is unchanged, and the adapters equal plain PyTorch's (with checkpointing on)."""
    model = _llama_lora()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for s in range(2):
        opt.zero_grad()
        for i in range(2):
            (model(**chunk("llama", s, i)).loss / 2).backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
    want = {n: p.detach() for n, p in model.named_parameters()}
    cfg = config(stage, 2, 1)

    def rank(comm):
        m = _llama_lora("non-reentrant")
        comm.barrier()
        sm = fnzero.shard(m, config=cfg, comm=comm)
        state = sm.init_state()
        step = fnzero.train_step(lambda p, b: sm.apply(p, **b).loss, cfg)
        for s in range(2):
            state, _ = step(state, chunk("llama", s, comm.rank))
        opt_numel = sum(t.numel() for t in optree_leaves(state.opt_state))
        return sm.plan, opt_numel, sm.state_dict(state)

    adapters = {n for n, p in model.named_parameters() if p.requires_grad}
    assert adapters and all(n.rsplit(".", 1)[-1] in ("a", "b") for n in adapters)
    for plan, opt_numel, got in simulated_world(2).run(rank):
        assert {s.name for u in plan.units for s in u.slots} == adapters
        # Adam's two moments over this rank's slice of the adapters (plus its step count).
        shard = plan.num_padded // (2 if stage else 1)
        assert opt_numel - 2 * shard in (0, 1), (opt_numel, shard)
        W.assert_close_tree(got, want, rtol=RTOL, atol=ATOL, what=f"lora stage {stage}")


class _SharedInsideAndOutside(torch.nn.Module):
    """A unit whose weight is used inside a reentrant checkpoint and again outside it, so
    reentrant checkpointing accumulates its gradient twice in one backward."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(6, 6, dtype=torch.float64)
        self.out = torch.nn.Linear(6, 3, dtype=torch.float64)

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.inner(t)), x, use_reentrant=True)
        return self.out(self.inner(h))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gradient_reaching_a_unit_twice(stage):
    def batch(s, r):
        g = torch.Generator().manual_seed(10 * s + r)
        return torch.randn(2, 6, generator=g, dtype=torch.float64).requires_grad_(), torch.randn(2, 3, generator=g, dtype=torch.float64)

    torch.manual_seed(0)
    model = _SharedInsideAndOutside()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for s in range(2):
        opt.zero_grad()
        for r in range(2):
            x, y = batch(s, r)
            (torch.nn.functional.mse_loss(model(x), y) / 2).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    want = dict(model.named_parameters())
    cfg = config(stage, 2, 1)

    def rank(comm):
        with _BUILD:
            torch.manual_seed(0)
            m = _SharedInsideAndOutside()
        sm = fnzero.shard(m, config=cfg, comm=comm)
        state = sm.init_state()
        step = fnzero.train_step(lambda p, b: torch.nn.functional.mse_loss(sm.apply(p, b[0]), b[1]), cfg)
        for s in range(2):
            state, _ = step(state, batch(s, comm.rank))
        return sm.gather(state)

    for got in simulated_world(2, wrap_comm=_InPlace).run(rank):
        W.assert_close_tree(got, want, rtol=RTOL, atol=ATOL, what=f"stage {stage}")


class _InPlace:
    """Simulated collectives that reduce a donated buffer in place, as gloo and NCCL do: a
    gradient added to a buffer already on the wire would be lost or corrupt it."""

    def __init__(self, comm):
        self.comm = comm
        self.rank, self.world_size = comm.rank, comm.world_size

    def __getattr__(self, name):
        return getattr(self.comm, name)

    def all_reduce_async(self, t, donate=False, label=""):
        out = self.comm.all_reduce(t)
        return PendingTensor(t.copy_(out) if donate else out)


class _Block(torch.nn.Module):
    def __init__(self, probe):
        super().__init__()
        self.lin = torch.nn.Linear(6, 6, dtype=torch.float64)
        self.probe = probe

    def forward(self, x):
        self.probe(self)
        return torch.tanh(self.lin(x))


class _CheckpointsItsBlocks(torch.nn.Module):
    """Checkpoints each block by calling the block itself (the unit's hooked module), as
    transformers 4.x and torch's checkpoint_wrapper do."""

    def __init__(self, reentrant):
        super().__init__()
        self.seen: list[int] = []
        self.blocks = torch.nn.ModuleList(_Block(self._probe) for _ in range(4))
        self.reentrant = reentrant

    def _probe(self, block):
        # How many blocks hold gathered (non-placeholder) weights right now.
        self.seen.append(sum(not dict.__getitem__(b.lin._parameters, "weight").is_meta for b in self.blocks))

    def forward(self, x):
        for b in self.blocks:
            x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=self.reentrant)
        return x


@pytest.mark.parametrize("reentrant", [True, False])
def test_stage3_recomputation_holds_one_unit_at_a_time(reentrant):
    cfg = config(3, 1, 1)
    with _BUILD:
        torch.manual_seed(0)
        model = _CheckpointsItsBlocks(reentrant)
    sm = fnzero.shard(model, config=cfg)
    step = fnzero.train_step(lambda p, b: sm.apply(p, b).square().mean(), cfg)
    model.seen.clear()
    step(sm.init_state(), torch.randn(2, 6, dtype=torch.float64, requires_grad=True))
    # Forward sees one block at a time; so must every recomputation in backward.
    assert len(model.seen) == 8 and max(model.seen) == 1, model.seen
    assert all(p.is_meta for p in model.parameters())  # placeholders again after the step


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("reentrant", [True, False])
def test_two_applies_in_one_loss_with_checkpointing(stage, reentrant):
    """A loss that runs the model twice (contrastive and preference losses do): both backward
    bindings come off in order, the model is left with its placeholders, and two steps equal
    plain PyTorch."""

    def loss(run, batch):
        a, b = batch
        return run(a).square().mean() + (run(b) * a).mean()

    def batch(s):
        g = torch.Generator().manual_seed(s)
        return tuple(torch.randn(2, 6, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2))

    with _BUILD:
        torch.manual_seed(0)
        ref = _CheckpointsItsBlocks(reentrant)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for s in range(2):
        opt.zero_grad()
        loss(ref, batch(s)).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        opt.step()
    cfg = config(stage, 1, 1)
    with _BUILD:
        torch.manual_seed(0)
        model = _CheckpointsItsBlocks(reentrant)
    sm = fnzero.shard(model, config=cfg)
    step = fnzero.train_step(lambda p, b: loss(lambda x: sm.apply(p, x), b), cfg)
    state = sm.init_state()
    for s in range(2):
        state, _ = step(state, batch(s))
        assert all(type(m._parameters) is dict for m in model.modules())
        assert all(p.is_meta for p in model.parameters())
    W.assert_close_tree(sm.gather(state), dict(ref.named_parameters()), rtol=RTOL, atol=ATOL, what=f"stage {stage}")


class _ChecksItsLinear(torch.nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.lin = torch.nn.Linear(6, 6, dtype=torch.float64)
        self.out = torch.nn.Linear(6, 6, dtype=torch.float64)
        self.reentrant = reentrant

    def forward(self, x):
        # The recomputation starts inside the unit, at a module owning some of its parameters.
        h = torch.utils.checkpoint.checkpoint(self.lin, x, use_reentrant=self.reentrant)
        return self.out(torch.tanh(h))


class _ChecksInsideItsBlocks(torch.nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_ChecksItsLinear(reentrant) for _ in range(3))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


@pytest.mark.parametrize("reentrant", [True, False])
def test_stage3_leaves_the_modules_as_built(reentrant):
    """specs/sharding.md §Apply: stage 3 hooks its unit modules and rewrites nothing of them: no
    module's forward, class or parameter-table dict changes, at `shard` or while a recomputation
    runs in backward; a recomputation that starts inside a unit (at a submodule) gathers the unit
    too, and two steps equal plain PyTorch."""

    def batch(s):
        return torch.randn(2, 6, generator=torch.Generator().manual_seed(s), dtype=torch.float64).requires_grad_()

    def build():
        with _BUILD:
            torch.manual_seed(0)
            return _ChecksInsideItsBlocks(reentrant)

    ref = build()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for s in range(2):
        opt.zero_grad()
        ref(batch(s)).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        opt.step()
    model = build()
    built = {name: (type(m), id(m._parameters), type(m._parameters)) for name, m in model.named_modules()}
    seen = []  # (module, its table's id and type, whether it has a forward of its own), at each call
    for m in model.modules():
        m.register_forward_pre_hook(lambda m, a: seen.append((m, id(m._parameters), type(m._parameters),
                                                              "forward" in vars(m))))
    cfg = config(3, 1, 1)
    sm = fnzero.shard(model, config=cfg)
    step = fnzero.train_step(lambda p, b: sm.apply(p, b).square().mean(), cfg)
    state = sm.init_state()
    for s in range(2):
        state, _ = step(state, batch(s))
    assert {name: (type(m), id(m._parameters), type(m._parameters)) for name, m in model.named_modules()} == built
    assert not any("forward" in vars(m) for m in model.modules())
    assert all(t is dict and not own and built_id == built[n][1] for m, built_id, t, own in seen
               for n in [next(k for k, v in model.named_modules() if v is m)])
    assert sum(m is model.blocks[0].lin for m, *_ in seen) == 4  # each step: forward, recomputation
    assert all(p.is_meta for p in model.parameters())
    W.assert_close_tree(sm.gather(state), dict(ref.named_parameters()), rtol=RTOL, atol=ATOL, what="stage 3")
