"""Muon's `per_head_muon` (specs/optim.md §Muon): the projections DeepSpeed 0.19.8 selects
(`muon_head_counts(model)`: q/k/v by leaf name, heads from the model's config, confirmed by the
rows) are orthogonalised per head; training a small Llama at ZeRO stages 0 and 3 on a simulated
world of 2 equals a plain float64 reference of DeepSpeed's per-head formula; what cannot be
resolved is refused. DeepSpeed's own functions, called live: tests/test_optim_muon_heads_live.py."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import fnzero
from fnzero import optim
from fnzero._errors import ConfigError
from fnzero.testing import GPT, simulated_world

from test_optim_muon import BASE, ref_orthogonalize, ref_step

H = {**BASE, "wd": BASE["weight_decay"], "nesterov": True, "ns_steps": 5}
STEPS = 2


def ref_per_head(u, heads, steps):
    """DeepSpeed's `_per_head_orthogonalize`, written plainly: head by head, each block's own scale."""
    rows = u.size(0) // heads
    blocks = [ref_orthogonalize(u[i * rows:(i + 1) * rows], steps) * math.sqrt(max(1.0, rows / u.size(1)))
              for i in range(heads)]
    return torch.cat(blocks)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                      num_hidden_layers=1, vocab_size=64, max_position_embeddings=16)
    return LlamaForCausalLM(cfg).double()


def _loss(model_out, labels):  # computed here in float64 (transformers' labels= loss is float32)
    logits = model_out.logits
    return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))


def test_head_counts_are_what_deepspeed_resolves():
    """Llama: q_proj 4 heads, k_proj / v_proj 2 (num_key_value_heads), nothing else (o_proj's
    heads are on its input); an MLA layout by its widths, the down-projection left whole; the
    counts are keyed by the names the chain sees."""
    counts = optim.muon_head_counts(_llama())
    assert counts == {"model.layers.0.self_attn.q_proj.weight": 4, "model.layers.0.self_attn.k_proj.weight": 2,
                      "model.layers.0.self_attn.v_proj.weight": 2}

    class MLA(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = SimpleNamespace(num_attention_heads=2, hidden_size=16, qk_nope_head_dim=3,
                                          qk_rope_head_dim=2, v_head_dim=4)
            self.q_proj = nn.Linear(16, 2 * 5)  # no q_lora_rank: the query up-projection, MLA widths
            self.kv_a_proj_with_mqa = nn.Linear(16, 6)
            self.kv_b_proj = nn.Linear(6, 2 * 7)
            self.o_proj = nn.Linear(8, 16)

    assert optim.muon_head_counts(MLA()) == {"q_proj.weight": 2, "kv_b_proj.weight": 2}


def test_unresolvable_heads_are_refused_by_name():
    """fnzero's GPT holds Q, K and V in one `qkv` matrix, which DeepSpeed does not split (nothing is
    resolved: its ValueError, here a ConfigError); a model without a head count; a count that does
    not divide a parameter's rows; per_head_muon without counts, from the chain and from a config."""
    with pytest.raises(ConfigError, match=r"no attention projection could be resolved.*blocks\.0\.qkv\.weight"):
        optim.muon_head_counts(GPT(vocab_size=32, seq_len=8, d_model=16, n_head=2))
    with pytest.raises(ConfigError, match="no `config` with an attention head count"):
        optim.muon_head_counts(nn.Sequential(nn.Linear(4, 4)))
    tx = optim.muon_chain(per_head_muon=True, head_counts={"q_proj.weight": 3})
    with pytest.raises(ConfigError, match=r"'q_proj.weight' has shape \(8, 4\).*3 heads"):
        tx.init({"q_proj.weight": torch.zeros(8, 4)})
    with pytest.raises(ConfigError, match="per_head_muon=True needs the attention head counts"):
        optim.muon_chain(per_head_muon=True)
    cfg = fnzero.load_config({"train_batch_size": 2, "optimizer": {"type": "Muon", "params": {"per_head_muon": True}}})
    with pytest.raises(ConfigError, match="muon_head_counts"):
        optim.from_config(cfg)
    assert not optim.from_config(cfg, head_counts={"w": 2}).elementwise


def test_per_head_direction_is_deepspeeds_formula():
    """One `scale_by_muon` step with head counts: the named matrix per head (wide and tall heads, each
    with its own aspect-ratio scale), the other whole, within 1e-12 of the reference; and per head is
    not the whole-matrix direction (the test can tell them apart)."""
    gen = torch.Generator().manual_seed(1)
    g = {"q": torch.randn(12, 5, generator=gen, dtype=torch.float64),
         "k": torch.randn(8, 6, generator=gen, dtype=torch.float64),
         "w": torch.randn(6, 4, generator=gen, dtype=torch.float64)}
    tx = optim.scale_by_muon(momentum=0.9, head_counts={"q": 2, "k": 4, "absent": 3})
    out, _ = tx.update(g, tx.init(g))
    u = {n: v * 0.1 + (v * 0.1) * 0.9 for n, v in g.items()}  # nesterov blend of the first step
    torch.testing.assert_close(out["q"], ref_per_head(u["q"], 2, 5), rtol=0, atol=1e-12)  # heads 6 x 5: tall
    torch.testing.assert_close(out["k"], ref_per_head(u["k"], 4, 5), rtol=0, atol=1e-12)  # heads 2 x 6: wide
    torch.testing.assert_close(out["w"], ref_orthogonalize(u["w"], 5) * math.sqrt(6 / 4), rtol=0, atol=1e-12)
    assert (out["q"] - ref_orthogonalize(u["q"], 5) * math.sqrt(12 / 5)).abs().max() > 0.1


def _reference(model, ids, labels, counts):
    """DeepSpeed's MuonWithAuxAdam with per-head Muon, in float64: `ref_step` of test_optim_muon with
    the per-head projections' updates replaced by the per-head formula."""
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {"t": 0}
    for _ in range(STEPS):
        leaves = {n: t.clone().requires_grad_(True) for n, t in params.items()}
        loss = _loss(torch.func.functional_call(model, leaves, (ids,)), labels)
        grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
        momenta = {n: state.get(("m", n), torch.zeros_like(p)) for n, p in params.items()}
        new = ref_step(params, grads, state, H)
        for n, heads in counts.items():  # the same momentum; the direction per head instead
            m = momenta[n] * H["momentum"] + grads[n] * (1 - H["momentum"])
            u = grads[n] * (1 - H["momentum"]) + m * H["momentum"]
            new[n] = params[n] * (1 - H["muon_lr"] * H["wd"]) - H["muon_lr"] * ref_per_head(u, heads, H["ns_steps"])
        params = new
    return params


@pytest.mark.parametrize("stage", [0, 3])
def test_per_head_muon_trains_a_llama_as_deepspeeds_formula(stage):
    """A Llama (hidden 32, 4 heads, 2 kv heads) on 2 simulated ranks, 2 steps, the config's
    `per_head_muon: true` with the model's head counts: every parameter within 1e-9 of the reference
    at stage 0 (the chain given) and at stage 3 (the config alone; the whole-matrix owner partition
    hands the chain whole projections)."""
    model = _llama()
    torch.manual_seed(1)
    ids, labels = torch.randint(0, 64, (4, 6)), torch.randint(0, 64, (4, 6))
    counts = optim.muon_head_counts(model)
    want = _reference(model, ids, labels, counts)
    cfg = fnzero.load_config({
        "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "zero_optimization": {"stage": stage},
        "optimizer": {"type": "Muon", "params": {**BASE, "per_head_muon": True}}}, world_size=2)

    def rank(comm):
        m = _llama()
        m.load_state_dict(model.state_dict())
        sm = fnzero.shard(m, config=cfg, comm=comm)
        # Stage 0 passes the chain built with the model's counts; stage 3 the config alone: `shard`
        # resolves the heads into the state (`Sharding.config_optimizer`), where the step finds them.
        tx = optim.chain_from_config(cfg, head_counts=optim.muon_head_counts(m)) if stage == 0 else None
        state = sm.init_state(optimizer=tx)
        assert state.sharding.config_optimizer.head_counts == counts
        step = fnzero.train_step(lambda p, b: _loss(sm.apply(p, b[0]), b[1]), cfg, optimizer=tx)
        rows = slice(2 * comm.rank, 2 * comm.rank + 2)
        for _ in range(STEPS):
            state, _ = step(state, (ids[rows], labels[rows]))
        return sm.gather(state)

    for got in simulated_world(2).run(rank):
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=0, atol=1e-9, msg=lambda m: f"stage {stage} {n}: {m}")


def test_the_step_never_asks_which_optimizer_type_it_runs():
    """The step asks the optimizer it is given or the state's sharding for what it needs (the
    model's heads live with the config's optimizer, `Sharding.config_optimizer`), never a type name."""
    import pathlib
    import re

    train = pathlib.Path(fnzero.__file__).parent / "train"
    for path in sorted(train.glob("*.py")):
        text = path.read_text()
        assert not re.search(r"[\"']muon[\"']|optimizer\.type\s*[=!]=|per_head_muon\b\W*\)", text, re.IGNORECASE), path.name
