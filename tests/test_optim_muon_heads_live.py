"""Muon's `per_head_muon` against DeepSpeed 0.19.8's own functions, live (specs/optim.md §Muon):
`set_optimizer_flags` tags the same parameters with the same head counts as `muon_head_counts`
(and refuses where it refuses), and `muon_update(num_heads=...)` / `_per_head_orthogonalize` give
`scale_by_muon(head_counts=...)`'s numbers. Needs DeepSpeed importable (run with its venv); skipped
where it is not. DeepSpeed's Newton–Schulz runs in fp16/bf16/fp32 by `ns_compute_dtype`; the
float64 comparison sets that oracle's compute dtype to float64 for the test, so the two agree to
1e-9; at DeepSpeed's own fp32 "gram" precision they agree to 2e-5."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from fnzero import optim
from fnzero._errors import ConfigError
from fnzero.testing import GPT

deepspeed = pytest.importorskip("deepspeed", reason="DeepSpeed is not importable here")
original_muon = pytest.importorskip("deepspeed.runtime.zero.muon.original_muon")


@pytest.fixture(autouse=True)
def eager():
    """DeepSpeed's Muon functions are `torch.compile`d; run them eagerly (the same arithmetic) so the
    test takes seconds rather than minutes of compiling."""
    with torch.compiler.set_stance("force_eager"):
        yield


class Attention(nn.Module):
    def __init__(self, hidden, heads, kv_heads):
        super().__init__()
        width = hidden // heads
        self.q_proj, self.o_proj = nn.Linear(hidden, heads * width), nn.Linear(heads * width, hidden)
        self.k_proj, self.v_proj = nn.Linear(hidden, kv_heads * width), nn.Linear(hidden, kv_heads * width)


class LlamaShaped(nn.Module):
    """Llama's parameter names and shapes (hidden 32, 4 heads, 2 kv heads) with its config's fields,
    plus an MLA block whose config fields a second model carries."""

    def __init__(self, config, mla=False):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(64, 32)
        self.self_attn = Attention(32, config.num_attention_heads, config.num_key_value_heads)
        self.mlp = nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 32))
        if mla:
            self.q_b_proj, self.kv_a_proj_with_mqa, self.kv_b_proj = nn.Linear(8, 4 * 5), nn.Linear(32, 6), nn.Linear(6, 4 * 7)
        self.lm_head = nn.Linear(32, 64, bias=False)


def _deepspeeds_counts(model):
    flags = SimpleNamespace(optimizer_name="muon", optimizer_params={"per_head_muon": True})
    deepspeed.set_optimizer_flags(flags, model)
    return {n: p.muon_num_heads for n, p in model.named_parameters() if getattr(p, "muon_num_heads", None)}


@pytest.mark.parametrize("mla", [False, True])
def test_the_same_parameters_and_head_counts_as_set_optimizer_flags(mla):
    config = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, hidden_size=32)
    if mla:
        config = SimpleNamespace(**vars(config), qk_nope_head_dim=3, qk_rope_head_dim=2, v_head_dim=4)
    model = LlamaShaped(config, mla)
    want = _deepspeeds_counts(model)
    assert optim.muon_head_counts(model) == want
    assert len(want) == 3 + 2 * mla


def test_refused_where_deepspeed_refuses():
    """fnzero's GPT (one fused `qkv` matrix): DeepSpeed tags nothing and raises; so does fnzero."""
    model = GPT(vocab_size=32, seq_len=8, d_model=16, n_head=2)
    with pytest.raises(ValueError, match="no attention projection could be tagged"):
        _deepspeeds_counts(model)
    with pytest.raises(ConfigError, match="no attention projection could be resolved"):
        optim.muon_head_counts(model)


def _two_steps(shape, heads, dtype, method, nesterov):
    k = torch.arange(shape[0] * shape[1], dtype=torch.float64)
    g1, g2 = (torch.sin(1.3 * k + 0.2).reshape(shape).to(dtype), torch.cos(0.7 * k - 0.4).reshape(shape).to(dtype))
    momentum = torch.zeros(shape, dtype=dtype)
    for g in (g1, g2):
        want = original_muon.muon_update(g.clone(), momentum, beta=0.95, ns_steps=5, nesterov=nesterov,
                                         ns_method=method, num_heads=heads)
    tx = optim.scale_by_muon(momentum=0.95, nesterov=nesterov, ns_method=method, head_counts={"w": heads})
    state = tx.init({"w": g1})
    _, state = tx.update({"w": g1}, state)
    got, _ = tx.update({"w": g2}, state)
    return got["w"], want


CASES = [((12, 5), 2, "gram", True), ((8, 6), 4, "standard", False), ((16, 32), 4, "gram", True)]


@pytest.mark.parametrize("shape,heads,method,nesterov", CASES, ids=str)
def test_muon_update_with_num_heads_in_float64(monkeypatch, shape, heads, method, nesterov):
    """Tall heads (6 x 5, scaled sqrt(6/5)), wide heads, Llama's q_proj: within 1e-9 of DeepSpeed's
    `muon_update(num_heads=)` (its iteration at float64) after two steps of momentum."""
    monkeypatch.setattr(original_muon, "ns_compute_dtype", lambda ns_method="gram": torch.float64)
    got, want = _two_steps(shape, heads, torch.float64, method, nesterov)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-9)
    whole = original_muon._per_head_orthogonalize(torch.ones(shape, dtype=torch.float64), 1, 5, method)
    assert whole.shape == shape  # the function muon_update calls, reached directly


def test_muon_update_with_num_heads_at_deepspeeds_fp32_precision():
    """DeepSpeed unchanged on its CPU accelerator (fp32 "gram"): 2e-5, as the whole-matrix test."""
    if original_muon.ns_compute_dtype("gram") != torch.float32:
        pytest.skip("DeepSpeed's gram iteration is not fp32 on this accelerator")
    got, want = _two_steps((16, 32), 4, torch.float32, "gram", True)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
