"""The C optimizer kernels (cext/cpu_adam.c via fnzero._ext) against torch.optim and the
pure-torch fallback, at every SIMD level this CPU has."""

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fnzero import _ext
from fnzero._ext import _lib

needs_c = pytest.mark.skipif(not _ext.available(), reason="C extension not built")
LEVELS = _ext.supported_levels() or ["none"]
ODD_LENGTHS = [0, *range(1, 18), 31, 33, 63, 64, 65, 1037]


def close(a, ref, rel=1e-6):
    """Elementwise |a - ref| <= rel * max|ref|: relative to the tensor's scale (an elementwise
    ratio is meaningless for params crossing zero, where 1 ulp of the update is all of them)."""
    scale = ref.abs().max().item() if ref.numel() else 0.0
    err = (a.double() - ref.double()).abs().max().item() if ref.numel() else 0.0
    assert err <= rel * max(scale, 1e-30), f"max abs error {err:.3e} > {rel} * {scale:.3e}"


def level_ctx(level):
    return _ext.force_simd(level) if level != "none" else _nullctx()


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def run_adam(n, steps, level, *, adamw, wd, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, num_threads=1, seed=0, **kw):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    m, v = torch.zeros(n), torch.zeros(n)
    grads = [torch.randn(n, generator=gen) for _ in range(steps)]
    with level_ctx(level):
        for s, g in enumerate(grads, 1):
            _ext.adam_step_(p, g, m, v, step=s, lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=wd,
                            adamw=adamw, num_threads=num_threads, **kw)  # fmt: skip
    return p, m, v, grads


def torch_adam(n, grads, *, adamw, wd, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, seed=0, **opt_kw):
    p = torch.randn(n, generator=torch.Generator().manual_seed(seed)).requires_grad_()
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = cls([p], lr=lr, betas=betas, eps=eps, weight_decay=wd, **opt_kw)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    st_ = opt.state[p]
    return p.detach(), st_["exp_avg"], st_["exp_avg_sq"]


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("adamw,wd", [(True, 0.0), (True, 0.1), (False, 0.0), (False, 0.05)])
def test_adam_matches_torch_100_steps(level, adamw, wd):
    p, m, v, grads = run_adam(1037, 100, level, adamw=adamw, wd=wd)
    for opt_kw in ({"foreach": False}, {"fused": True}):
        tp, tm, tv = torch_adam(1037, grads, adamw=adamw, wd=wd, **opt_kw)
        close(p, tp)
        close(m, tm)
        close(v, tv)


def test_adam_other_hyperparameters_match_torch():
    kw = dict(adamw=True, wd=0.3, lr=3e-4, betas=(0.8, 0.95), eps=1e-6)
    p, m, v, grads = run_adam(257, 30, LEVELS[-1], **kw)
    tp, tm, tv = torch_adam(257, grads, foreach=False, **kw)
    close(p, tp)
    close(v, tv)


@pytest.mark.parametrize("n", ODD_LENGTHS)
def test_every_level_and_the_fallback_give_identical_bits(n):
    kw = dict(adamw=False, wd=0.01, grad_scale=0.5)
    ref = run_adam(n, 3, "none", use_cext=False, **kw)[:3]
    for level in LEVELS:
        got = run_adam(n, 3, level, **kw)[:3]
        for a, b in zip(got, ref):
            assert torch.equal(a, b), level


@needs_c
def test_threads_split_gives_identical_bits():
    n = 3 * 65536 + 77  # three tiles, ragged end
    one = run_adam(n, 2, LEVELS[-1], adamw=True, wd=0.1, num_threads=1)[:3]
    two = run_adam(n, 2, LEVELS[-1], adamw=True, wd=0.1, num_threads=2)[:3]
    many = run_adam(n, 2, LEVELS[-1], adamw=True, wd=0.1, num_threads=7)[:3]
    pthreads = run_adam(n, 2, LEVELS[-1], adamw=True, wd=0.1, num_threads=2, thread_pool=False)[:3]
    for a, b, c, d in zip(one, two, many, pthreads):
        assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d)


@needs_c
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the pool is looked up on Linux only")
def test_threads_come_from_torchs_openmp_pool():
    """torch is loaded, so its OpenMP runtime is: the kernels' threads are its pool's (specs/cext.md)."""
    assert _lib.lib.fnz_cpu_thread_pool() == 1
    assert "OpenMP pool" in _ext.build_info()["threads"]


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_out16_equals_torch_conversion(level, dtype):
    n = 1037
    p, m, v = torch.randn(n) * 100, torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=dtype)
    with level_ctx(level):
        _ext.adam_step_(p, torch.randn(n), m, v, step=1, lr=1e-3, out16=out)
    assert torch.equal(out, p.to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shift", [0, 1, 13])
def test_a_large_copy_out_streamed_past_the_cache_has_every_levels_bits(dtype, shift):
    """From 2^20 elements per tile the AVX-512 loop writes the 16-bit copy-out with non-temporal
    stores after a scalar head that aligns it to a cache line: the copy-out still equals torch's
    conversion of the new parameters, and parameters and moments every level's, for an output
    `shift` elements past an aligned address, on one thread and two (two tiles)."""
    n = (2 << 20) + 37
    for threads in (1, 2):
        results = []
        for level in LEVELS:
            gen = torch.Generator().manual_seed(5)
            p, g = torch.randn(n, generator=gen) * 10, torch.randn(n, generator=gen)
            m, v = torch.zeros(n), torch.zeros(n)
            buf = torch.empty(n + 64, dtype=dtype)
            out = buf[shift:shift + n]
            with level_ctx(level):
                _ext.adam_step_(p, g, m, v, step=1, lr=1e-3, out16=out, num_threads=threads)
            assert torch.equal(out, p.to(dtype)), (level, threads)
            results.append((p, m, v))
        for level, got in zip(LEVELS, results):
            assert all(torch.equal(a, b) for a, b in zip(got, results[0])), (level, threads)


@pytest.mark.skipif(not _ext.available(), reason="no C extension")
def test_the_stream_reference_with_a_16bit_copy_moves_what_it_says():
    """bench_cpu_adam's reference for the fused pass: a += b/2 (and c, d), and the top half of each
    new a in the 16-bit output, past the streamed-store threshold and misaligned, on two tiles."""
    n = (2 << 20) + 5
    gen = torch.Generator().manual_seed(0)
    a, b, c, d = (torch.randn(n, generator=gen) for _ in range(4))
    want = a + 0.5 * b
    out = torch.empty(n + 8, dtype=torch.bfloat16)[3:n + 3]
    _ext.stream_adam_shape_(a, b, c, d, out16=out, num_threads=2)
    assert torch.equal(a, want)
    assert torch.equal(out.view(torch.int16), (want.view(torch.int32) >> 16).to(torch.int16))


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_conversion_edge_values(level, dtype):
    specials = [0.0, -0.0, 1.0, -1.0, 65504.0, 65519.99, 65520.0, 70000.0, -1e6, 1e-5, 6e-8, 3e-8, 1e-8,
                1e-40, 3.4e38, float("inf"), float("-inf"), 1.00048828125, 1.001953125, 2049.0, 2051.0]  # fmt: skip
    x = torch.tensor(specials * 3 + [float("nan")], dtype=torch.float32)
    x = torch.cat([x, torch.randn(1000) * torch.logspace(-10, 10, 1000)])
    out = torch.empty(x.numel(), dtype=dtype)
    with level_ctx(level):
        _ext.to_16bit(x, out)
    ref = x.to(dtype)
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(out), nan)
    assert torch.equal(out[~nan], ref[~nan])
    assert torch.equal(out.view(torch.int16)[~nan], ref.view(torch.int16)[~nan])  # signs of zeros too


@pytest.mark.parametrize("level", LEVELS)
def test_grad_scale_equals_scaling_the_grad_first(level):
    n = 333
    g = torch.randn(n)
    a = [torch.randn(n, generator=torch.Generator().manual_seed(1)), torch.zeros(n), torch.zeros(n)]
    b = [t.clone() for t in a]
    scale = 1.0 / 1024 * 0.37
    with level_ctx(level):
        _ext.adam_step_(a[0], g, a[1], a[2], step=1, lr=1e-2, adamw=False, weight_decay=0.1, grad_scale=scale)
        _ext.adam_step_(b[0], g * _ext._fallback.f32(scale), b[1], b[2], step=1, lr=1e-2, adamw=False, weight_decay=0.1)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_no_bias_correction_matches_formula():
    n = 100
    p, m, v, grads = run_adam(n, 5, LEVELS[-1], adamw=True, wd=0.0, bias_correction=False)
    rp = torch.randn(n, generator=torch.Generator().manual_seed(0)).double()
    rm, rv = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    for g in grads:
        rm = 0.9 * rm + 0.1 * g.double()
        rv = 0.999 * rv + 0.001 * g.double() ** 2
        rp = rp - 1e-2 * rm / (rv.sqrt() + 1e-8)
    close(p, rp.float(), rel=1e-5)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("lr_decay,wd", [(0.0, 0.0), (0.01, 0.1)])
def test_adagrad_matches_torch(level, lr_decay, wd):
    n, gen = 517, torch.Generator().manual_seed(3)
    p0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) for _ in range(50)]
    p, s = p0.clone(), torch.full((n,), 0.1)
    with level_ctx(level):
        for k, g in enumerate(grads, 1):
            _ext.adagrad_step_(p, g, s, step=k, lr=0.05, lr_decay=lr_decay, eps=1e-10, weight_decay=wd)
    tp = p0.clone().requires_grad_()
    opt = torch.optim.Adagrad([tp], lr=0.05, lr_decay=lr_decay, weight_decay=wd, initial_accumulator_value=0.1,
                              eps=1e-10, foreach=False)  # fmt: skip
    for g in grads:
        tp.grad = g.clone()
        opt.step()
    close(p, tp.detach())
    close(s, opt.state[tp]["sum"])


def lion_reference(p, g, m, lr, b1, b2, wd):
    u = torch.sign(b1 * m + (1 - b1) * g)
    p = p * (1 - lr * wd) - lr * u
    return p, b2 * m + (1 - b2) * g


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_lion_matches_reference(level, wd):
    n, gen = 517, torch.Generator().manual_seed(4)
    p = torch.randn(n, generator=gen)
    rp, rm = p.double(), torch.zeros(n, dtype=torch.float64)
    m = torch.zeros(n)
    with level_ctx(level):
        for _ in range(30):
            g = torch.randn(n, generator=gen)
            _ext.lion_step_(p, g, m, lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=wd)
            rp, rm = lion_reference(rp, g.double(), rm, 1e-3, 0.9, 0.99, wd)
    close(p, rp.float())
    close(m, rm.float(), rel=1e-5)


@pytest.mark.parametrize("level", LEVELS)
def test_lion_sign_of_zero_and_nan(level):
    p = torch.ones(9)
    g = torch.tensor([0.0, -0.0, 1.0, -1.0, float("nan"), 0.0, 0.0, 0.0, 0.0])
    m = torch.zeros(9)
    with level_ctx(level):
        _ext.lion_step_(p, g, m, lr=0.5, beta1=0.9, beta2=0.99)
    assert p[:4].tolist() == [1.0, 1.0, 0.5, 1.5] and torch.isnan(p[4])


@given(
    n=st.integers(0, 300),
    lr=st.floats(1e-5, 1e-1),
    b1=st.floats(0.0, 0.99),
    b2=st.floats(0.5, 0.9999),
    eps=st.sampled_from([1e-8, 1e-6, 1e-3]),
    wd=st.sampled_from([0.0, 1e-2, 0.5]),
    adamw=st.booleans(),
    scale=st.floats(1e-3, 4.0),
    step=st.integers(1, 10_000),
)
def test_hypothesis_c_equals_fallback_and_torch_formula(n, lr, b1, b2, eps, wd, adamw, scale, step):
    gen = torch.Generator().manual_seed(n)
    init = [torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 0.1, torch.rand(n, generator=gen)]
    g = torch.randn(n, generator=gen)
    kw = dict(step=step, lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd, adamw=adamw, grad_scale=scale)
    fb = [t.clone() for t in init]
    _ext.adam_step_(fb[0], g, fb[1], fb[2], use_cext=False, **kw)
    for level in LEVELS:
        c = [t.clone() for t in init]
        with level_ctx(level):
            _ext.adam_step_(c[0], g, c[1], c[2], **kw)
        for x, y in zip(c, fb):
            assert torch.equal(x, y)
    # and the textbook formula in float64
    p, m, v = (t.double() for t in init)
    gd = g.double() * scale
    if adamw:
        p = p * (1 - lr * wd)
    else:
        gd = gd + wd * p
    m = b1 * m + (1 - b1) * gd
    v = b2 * v + (1 - b2) * gd * gd
    p = p - lr / (1 - b1**step) * m / (v.sqrt() / (1 - b2**step) ** 0.5 + eps)
    close(fb[0], p.float(), rel=2e-6)


# -- argument checks ---------------------------------------------------------------------------
def bufs(n=10):
    return [torch.zeros(n) for _ in range(4)]


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda b: b.__setitem__(1, torch.zeros(11)), "grad has 11 elements"),
        (lambda b: b.__setitem__(0, torch.zeros(10, dtype=torch.float64)), "must be float32"),
        (lambda b: b.__setitem__(2, torch.zeros(20)[::2]), "contiguous"),
        (lambda b: b.__setitem__(1, b[0]), "param and grad overlap"),
        (lambda b: b.__setitem__(3, torch.cat([b[2], torch.zeros(1)])[1:]), None),  # separate storage: fine
        (lambda b: b.__setitem__(0, [0.0] * 10), "torch.Tensor"),
    ],
)
def test_bad_arguments_raise_value_error(mutate, match):
    b = bufs()
    mutate(b)
    if match is None:
        _ext.adam_step_(*b, step=1, lr=0.1)
        return
    with pytest.raises(ValueError, match=match):
        _ext.adam_step_(*b, step=1, lr=0.1)


def test_overlapping_views_and_bad_out16_and_step():
    big = torch.zeros(30)
    with pytest.raises(ValueError, match="exp_avg and exp_avg_sq overlap"):
        _ext.adam_step_(torch.zeros(10), torch.zeros(10), big[0:10], big[5:15], step=1, lr=0.1)
    with pytest.raises(ValueError, match="out16"):
        _ext.adam_step_(*bufs(), step=1, lr=0.1, out16=torch.zeros(10, dtype=torch.float32))
    with pytest.raises(ValueError, match="step"):
        _ext.adam_step_(*bufs(), step=0, lr=0.1)
    with pytest.raises(ValueError, match="unknown level"):
        with _ext.force_simd("sse9"):
            pass


def test_disable_env_uses_fallback_with_same_numbers():
    code = (
        "import torch, fnzero._ext as e\n"
        "assert not e.available() and 'FNZERO_DISABLE_CEXT' in e.build_info()['reason']\n"
        "p=torch.linspace(-1,1,37); g=torch.linspace(2,-1,37); m=torch.zeros(37); v=torch.zeros(37)\n"
        "e.adam_step_(p,g,m,v,step=3,lr=0.1,weight_decay=0.1)\n"
        "print(p.tolist())\n"
    )
    env = dict(os.environ, FNZERO_DISABLE_CEXT="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    p, g, m, v = torch.linspace(-1, 1, 37), torch.linspace(2, -1, 37), torch.zeros(37), torch.zeros(37)
    _ext.adam_step_(p, g, m, v, step=3, lr=0.1, weight_decay=0.1)
    assert eval(out) == p.tolist()


def test_build_info_and_report():
    info = _ext.build_info()
    assert info["available"] == _ext.available()
    assert info["simd"] == _ext.simd_level()
    lines = _ext.report_lines()
    assert lines and all(isinstance(x, str) for x in lines)


@given(data=st.binary(max_size=700), crc=st.integers(0, 2**32 - 1), cut=st.integers(0, 700))
def test_crc32_is_zlibs_at_every_length_and_start(data, crc, cut):
    # cext/crc32.c folds 64 bytes at a time with carry-less multiplication; any length, any
    # running value, and a message split in two must give exactly zlib's crc32.
    import zlib

    assert _ext.crc32(data, crc) == zlib.crc32(data, crc)
    a, b = data[:cut], data[cut:]
    assert _ext.crc32(b, _ext.crc32(a)) == zlib.crc32(data)


@needs_c
def test_crc32_of_a_large_tensor_and_the_bytewise_path_agree():
    import zlib

    from fnzero.checkpoint._io import tensor_bytes

    t = torch.randn(3 << 20)
    buf = tensor_bytes(t)
    assert _ext.crc32(buf) == zlib.crc32(buf)
    with _lib.force_simd("scalar"):  # the table, not PCLMULQDQ
        assert _ext.crc32(buf[:100_003], 7) == zlib.crc32(buf[:100_003], 7)
