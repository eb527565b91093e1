"""Frozen parameters at ZeRO stage 3 are sharded per unit like the trainable ones
(`specs/sharding.md` §Frozen parameters, `specs/checkpoint-format.md` §Frozen parameters).

LoRA through peft (r=4 on q/v of a tiny float64 Llama, and GPT-2's fused `c_attn` Conv1D): the
adapters after a few steps equal plain PyTorch's, with the model's own checkpointing and under
`fnzero.jit`; each rank holds its share of the frozen base only; checkpoints of the frozen
shards load at other world sizes and stages, or are left out and come from pretrained files.
Losses are computed here (cross entropy of the logits), in float64.
"""

from __future__ import annotations

import os
import threading
import warnings

import optree
import peft
import pytest
import torch
import torch.nn.functional as F
import transformers

import fnzero
from fnzero import checkpoint
from fnzero.testing import run_world, simulated_world

import _worlds as W

transformers.logging.set_verbosity_error()

RTOL, ATOL = 1e-9, 1e-12
VOCAB, SEQ, LR, CLIP = 64, 8, 1e-2, 0.5
_BUILD = threading.Lock()


def lora_model(kind: str = "llama", gc: str = "off", seed: int = 0, dtype=torch.float64) -> torch.nn.Module:
    """A tiny float64 peft LoRA model; `gc`: the model's own checkpointing ("off", "reentrant",
    "non-reentrant")."""
    with _BUILD:
        torch.manual_seed(seed)
        t = transformers
        if kind == "llama":
            base = t.LlamaForCausalLM(t.LlamaConfig(hidden_size=16, intermediate_size=36, num_hidden_layers=2,
                                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                                    max_position_embeddings=32))
            lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False)
        else:
            base = t.GPT2LMHeadModel(t.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=16,
                                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
            lora = peft.LoraConfig(r=8, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True,
                                   init_lora_weights=False)
        base = base.to(dtype).train()
        if gc != "off":  # transformers' layer checkpointing (`gradient_checkpointing_enable` before 5.x)
            base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": gc == "reentrant"})
        with warnings.catch_warnings():  # peft reads transformers' deprecated `is_gradient_checkpointing`
            warnings.simplefilter("ignore", FutureWarning)
            return peft.get_peft_model(base, lora)


def chunk(step: int, index: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1000 * step + index))


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def cfg(world: int, stage: int = 3, extra: dict | None = None) -> fnzero.Config:
    return fnzero.load_config({
        "train_micro_batch_size_per_gpu": 2, "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **(extra or {})},
    }, world_size=world)


def reference(kind: str, world: int, steps: int) -> dict[str, torch.Tensor]:
    model = lora_model(kind)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for s in range(steps):
        opt.zero_grad()
        for r in range(world):
            ids = chunk(s, r)
            (lm_loss(model(input_ids=ids).logits, ids) / world).backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train(sm, state, config, steps: int, rank: int, jit: dict | None = None):
    step = fnzero.train_step(lambda p, ids: lm_loss(sm.apply(p, input_ids=ids).logits, ids), config)
    if jit is not None:
        step = fnzero.jit(step, **jit)
    for s in range(steps):
        state, _ = step(state, chunk(s, rank))
    return state


def run_lora(kind: str, world: int, gc: str, steps: int = 3, jit: dict | None = None, extra: dict | None = None,
             dtype=torch.float64, inspect=None):
    """Each rank's (plan, consolidated state_dict after `steps`, bytes of its state's tensors), and
    `inspect(sm, first state)` last when given."""
    config = cfg(world, extra=extra)

    def rank(comm):
        model = lora_model(kind, gc, dtype=dtype)
        comm.barrier()  # every rank built its model before any checkpointed backward forks the RNG
        sm = fnzero.shard(model, config=config, comm=comm)
        first = sm.init_state()
        seen = () if inspect is None else (inspect(sm, first),)
        state = train(sm, first, config, steps, comm.rank, jit)
        return (sm.plan, sm.state_dict(state), _state_bytes(state), *seen)

    return simulated_world(world).run(rank)


def _state_bytes(state) -> int:
    fields = (state.params, state.master, state.opt_state, state.frozen, state.buffers)
    return sum(t.numel() * t.element_size() for t in optree.tree_leaves(fields) if isinstance(t, torch.Tensor))


def check(kind, world, gc, steps=3, **kw):
    want = reference(kind, world, steps)
    for r, (plan, got, _) in enumerate(run_lora(kind, world, gc, steps, **kw)):
        assert plan.frozen == () and plan.frozen_units, "stage 3 holds the frozen base in frozen units"
        W.assert_close_tree(got, want, rtol=RTOL, atol=ATOL, what=f"{kind} lora gc={gc} rank {r}/{world}")


@pytest.mark.parametrize("world,gc", [(2, "non-reentrant"), (4, "reentrant"), (2, "off")])
def test_peft_lora_llama_equals_torch(world, gc):
    check("llama", world, gc)


def test_peft_lora_gpt2_fused_attention_equals_torch():
    check("gpt2", 2, "non-reentrant")


@pytest.mark.filterwarnings("ignore:fnzero.jit. graph break:fnzero.JitWarning")  # the gathering apply stays eager
def test_peft_lora_under_jit_whole_loss():
    # One rank: torch.compile is not thread-safe (per-unit graphs run on real ranks below). The
    # whole loss as one graph, the gathering apply eager inside it.
    check("llama", 1, "off", steps=2, jit={"backend": "aot_eager", "scope": "loss"})


def _lora_under_jit_on_a_gloo_rank(world: int, steps: int) -> dict[str, torch.Tensor]:
    import torch.distributed as dist

    config = cfg(world)
    sm = fnzero.shard(lora_model("llama", "non-reentrant"), config=config)
    state = train(sm, sm.init_state(), config, steps, dist.get_rank(), {"backend": "aot_eager"})
    return sm.state_dict(state)


@pytest.mark.multiprocess
# World 4 (24 s: four compiling processes on two cores) runs with -m slow; world 4 without jit is in
# test_peft_lora_llama_equals_torch, and the jitted path is the same at every world size.
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_peft_lora_under_jit_on_gloo_ranks(world):
    """Real processes (torch.compile per process): per-unit graphs with the model's checkpointing
    inside, the frozen base gathered and re-gathered around them, equal to plain torch."""
    want = reference("llama", world, 2)
    for r, got in enumerate(run_world(_lora_under_jit_on_a_gloo_rank, world, world, 2, timeout=300)):
        W.assert_close_tree(got, want, rtol=RTOL, atol=ATOL, what=f"jit lora rank {r}/{world}")


def test_a_rank_holds_its_share_of_the_frozen_base():
    """Every tensor of a rank's state together: at most 1.15 x its quarter of the frozen base plus
    one unit (the largest decoder layer, frozen and trainable parts), where the whole base was
    held before (here about 1.5 x that bound)."""
    world = 4
    results = run_lora("llama", world, "off", steps=1)
    plan = results[0][0]
    esize = 8
    frozen_bytes = plan.num_frozen * esize
    layer = max(u.padded_numel + (plan.trainable_unit(u.name).padded_numel if plan.trainable_unit(u.name) else 0)
                for u in plan.frozen_units if u.module != "") * esize
    bound = 1.15 * frozen_bytes / world + layer
    assert frozen_bytes > bound  # holding the whole base would fail below
    for r, (_, _, held) in enumerate(results):
        assert held <= bound, (r, held, bound)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A stage-3 run on 2 ranks saved twice: whole, and without its frozen parameters; its
    frozen base also written as a pretrained file (the names the sharded model has)."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("frozen_ckpt")
    config = cfg(2)

    def rank(comm):
        sm = fnzero.shard(lora_model(), config=config, comm=comm)
        state = train(sm, sm.init_state(), config, 2, comm.rank)
        checkpoint.save(root / "full", state, tag="t")
        checkpoint.save(root / "small", state, tag="t", exclude_frozen_parameters=True)
        return sm.state_dict(state)

    whole = simulated_world(2).run(rank)[0]
    frozen = {n for n, p in lora_model().named_parameters() if not p.requires_grad}
    save_file({n: whole[n].contiguous() for n in frozen}, root / "base.safetensors")
    return root, whole, frozen


def _load(root, like_world: int, stage: int, tag_dir: str, pretrained=None, **kw):
    config = cfg(like_world, stage)

    def rank(comm):
        sm = fnzero.shard(lora_model(seed=7), config=config, comm=comm)  # other weights: loading replaces them
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", fnzero.PretrainedWarning)  # the base file has no adapters
            like = sm.init_state(pretrained=pretrained)
        state, _ = checkpoint.load(root / tag_dir, like, tag="t", restore_rng=False, **kw)
        return sm.plan, sm.state_dict(state)

    return simulated_world(like_world).run(rank)


@pytest.mark.parametrize("world,stage", [(4, 3), (2, 1), (1, 0)])
def test_frozen_shards_load_at_other_world_sizes_and_stages(saved, world, stage):
    root, whole, _ = saved
    for plan, got in _load(root, world, stage, "full"):
        assert bool(plan.frozen_units) == (stage == 3)
        W.assert_close_tree(got, whole, rtol=0, atol=0, what=f"stage 3 x2 -> stage {stage} x{world}")


def test_checkpoint_without_frozen_is_smaller_and_loads_onto_a_pretrained_base(saved):
    root, whole, frozen = saved
    size = {d: sum(os.path.getsize(root / d / "t" / f) for f in os.listdir(root / d / "t")) for d in ("full", "small")}
    frozen_bytes = sum(whole[n].numel() * 8 for n in frozen)
    assert size["full"] - size["small"] >= frozen_bytes, size
    for stage, world in ((3, 4), (1, 2)):
        for _, got in _load(root, world, stage, "small", pretrained=root / "base.safetensors", keep_frozen=True):
            W.assert_close_tree(got, whole, rtol=0, atol=0, what=f"no-frozen checkpoint -> stage {stage} x{world}")
    with pytest.raises(fnzero.DistributedError, match="CheckpointError: .* saved without its frozen parameters"):
        _load(root, 2, 3, "small")


def _held_and_stored(sm, state):
    """(whether every sharded frozen unit's entry is a placeholder, the state's model_state_bytes)."""
    from fnzero.sharding.zero._param_store import is_placeholder

    units = [u for u in sm.plan.frozen_units if sm.plan.params_sharded(u)]
    return bool(units) and all(is_placeholder(state.frozen[u.name]) for u in units), fnzero.memory.model_state_bytes(state)


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_offload_param_with_a_frozen_base_equals_no_offload(tmp_path, device):
    """`offload_param` (cpu; nvme, with the optimizer on nvme) trains a LoRA model as without it.
    float32: the host optimizer's kernels take fp32 only, so the two runs differ by the rounding of
    their Adam arithmetic. With nvme the trainable shards are read from the optimizer's store and
    the frozen shards from the parameter store: the state holds placeholders for both, which count
    no memory, and `stored` is what the run without offload holds (`specs/offload.md` §Parameters)."""
    where = {"device": device} if device == "cpu" else {"device": "nvme", "nvme_path": str(tmp_path)}
    off = run_lora("llama", 2, "non-reentrant", 2, extra={"offload_param": where, "offload_optimizer": dict(where)},
                   dtype=torch.float32, inspect=_held_and_stored)
    plain = run_lora("llama", 2, "non-reentrant", 2, dtype=torch.float32, inspect=_held_and_stored)
    for (_, got, _, (stored, m)), (_, want, _, (_, p)) in zip(off, plain):
        W.assert_close_tree(got, want, rtol=1e-5, atol=1e-7, what=f"offload_param {device}")
        assert p.frozen > 0 and p.stored == 0
        if device == "nvme":
            assert stored and (m.params, m.frozen, m.stored) == (0, 0, p.params + p.frozen), (m, p)
        else:
            assert not stored and (m.frozen, m.stored) == (p.frozen, 0)


def test_a_lora_state_with_its_frozen_base_on_nvme_saves_loads_and_exports(tmp_path):
    """A stage-3 LoRA state whose frozen shards are in the parameter store, 2 ranks: `checkpoint.save`
    reads them; `checkpoint.load` into a model built under another seed writes them into that
    state's store (its frozen entries stay placeholders; `keep_frozen` leaves the store as it was)
    and the loaded model computes what the saved one did; `export_live` and `load_into` read
    through the store too."""
    from safetensors.torch import load_file

    from fnzero.sharding.zero._param_store import is_placeholder

    nvme = {"device": "nvme", "nvme_path": str(tmp_path / "nvme")}
    config = cfg(2, extra={"offload_param": nvme, "offload_optimizer": nvme})
    ids = chunk(9, 0)

    def rank(comm):
        sm = fnzero.shard(lora_model(dtype=torch.float32), config=config, comm=comm)
        state = train(sm, sm.init_state(), config, 1, comm.rank)
        want, logits = sm.state_dict(state), sm.apply(state.params, input_ids=ids).logits.detach()
        checkpoint.save(tmp_path / "c", state, tag="t")
        paths = checkpoint.export_live(sm, state, tmp_path / "export", hf_config=False)
        other = fnzero.shard(lora_model(seed=7, dtype=torch.float32), config=config, comm=comm)
        like = other.init_state()
        before = other.state_dict(like)
        kept, _ = checkpoint.load(tmp_path / "c", like, tag="t", restore_rng=False, keep_frozen=True)
        kept = other.state_dict(kept)  # (read before the next load writes the store)
        loaded, _ = checkpoint.load(tmp_path / "c", like, tag="t", restore_rng=False)
        placeholders = all(is_placeholder(loaded.frozen[u.name]) for u in other.plan.frozen_units)
        again = other.apply(loaded.params, input_ids=ids).logits.detach()
        fresh = other.load_into(lora_model(seed=3, dtype=torch.float32), loaded).state_dict()
        transient = set(sm.plan.saved.non_persistent)
        return want, logits, before, kept, other.state_dict(loaded), again, placeholders, paths, fresh, transient

    for want, logits, before, kept, got, again, placeholders, paths, fresh, transient in simulated_world(2).run(rank):
        frozen = [n for n in want if "lora_" not in n]
        assert any(not torch.equal(before[n], want[n]) for n in frozen), "the other seed built another base"
        W.assert_close_tree(kept, {n: before[n] if n in frozen else want[n] for n in want}, rtol=0, atol=0,
                            what="keep_frozen keeps the store's base")
        assert placeholders
        W.assert_close_tree(got, want, rtol=0, atol=0, what="loaded through the store")
        W.assert_close_tree(fresh, want, rtol=0, atol=0, what="load_into")
        torch.testing.assert_close(again, logits, rtol=0, atol=0)
        exported = {k: v for p in paths if p.endswith(".safetensors") for k, v in load_file(p).items()}
        # Every state_dict name (a PEFT model's own save writes adapters only), less the
        # non-persistent buffers (rotary inv_freq), which no save writes.
        assert exported.keys() == want.keys() - transient and transient
        W.assert_close_tree(exported, {k: want[k] for k in exported}, rtol=0, atol=0, what="export_live")


def _gpt2_frozen_embeddings() -> torch.nn.Module:
    with _BUILD:
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0)).double()
    model.transformer.wte.weight.requires_grad_(False)  # and so lm_head.weight, the same tensor
    return model


@pytest.mark.parametrize("stage", [1, 3])
def test_a_tied_frozen_weight_serves_every_name(stage):
    """GPT-2's `lm_head.weight` is `transformer.wte.weight`: frozen, it is held once and bound under
    both names at every stage (held whole by name it was bound under the first only, and the head
    computed with an unset tensor)."""
    ref = _gpt2_frozen_embeddings()
    params = [p for p in ref.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for r in range(2):
        (lm_loss(ref(input_ids=chunk(0, r)).logits, chunk(0, r)) / 2).backward()
    torch.nn.utils.clip_grad_norm_(params, CLIP)
    opt.step()
    config = cfg(2, stage)

    def rank(comm):
        sm = fnzero.shard(_gpt2_frozen_embeddings(), config=config, comm=comm)
        return sm.state_dict(train(sm, sm.init_state(), config, 1, comm.rank))

    want = dict(ref.state_dict())
    for r, got in enumerate(simulated_world(2).run(rank)):
        assert "lm_head.weight" in got
        W.assert_close_tree({k: got[k] for k in want}, want, rtol=RTOL, atol=ATOL, what=f"stage {stage} rank {r}")


@pytest.mark.parametrize("stage", [0, 3])
def test_loaded_frozen_weights_and_buffers_are_what_the_model_computes_with(tmp_path, stage):
    """`checkpoint.load` writes frozen parameters and buffers into the tensors the module binds
    (`specs/checkpoint-format.md` §Frozen parameters): a model built under another seed, loaded,
    computes what the saved one did (frozen weight, BatchNorm running statistics)."""
    def build(seed):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2)).double()
        m[0].weight.requires_grad_(False)
        return m

    x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    config = cfg(1, stage)
    sm = fnzero.shard(build(0), config=config)
    state = sm.init_state()
    with torch.no_grad():
        sm.apply(state.params, x)  # the running statistics move
    want = sm.apply(state.params, x)
    checkpoint.save(tmp_path / "c", state)
    other = fnzero.shard(build(1), config=config)
    loaded, _ = checkpoint.load(tmp_path / "c", like=other.init_state())
    torch.testing.assert_close(other.apply(loaded.params, x), want, rtol=0, atol=0)


def test_frozen_shards_held_on_the_host_train_as_in_memory():
    """`offload_param: cpu` on an accelerator keeps the frozen shards in a host store
    (`offload/_host_params.py`) and the state's placeholders on the device. A CPU run has no
    device apart from the host, so `init_state` makes no store there; this builds the state as it
    does on an accelerator and trains: equal to plain torch, the frozen shards placeholders."""
    from fnzero.offload._nvme_params import store_shards
    from fnzero.sharding.zero._param_store import is_placeholder

    config = cfg(2)
    want = reference("llama", 2, 2)

    def rank(comm):
        sm = fnzero.shard(lora_model("llama", "non-reentrant"), config=config, comm=comm)
        state = sm.init_state()
        store_shards(sm, where="cpu")  # what init_state does on an accelerator (`state/_init.py`)
        state = state.replace(frozen=sm.constants[0])
        assert all(is_placeholder(t) for t in state.frozen.values())
        return sm.state_dict(train(sm, state, config, 2, comm.rank))

    for r, got in enumerate(simulated_world(2).run(rank)):
        W.assert_close_tree(got, want, rtol=RTOL, atol=ATOL, what=f"host-held frozen shards rank {r}")
