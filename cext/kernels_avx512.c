/* AVX-512F loops (FMA deliberately not used: the scalar
 * reference has no FMA and every level must match it bit for bit). Compiled for the baseline
 * ISA with a per-file target pragma, and only called after cpuid said the CPU has AVX-512F, so the
 * shipped library runs anywhere (no -march=native). Tails go to the scalar loop. */
#include <stdint.h>

#include "cpu_adam.h"
#include "kernels.h"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f")
#endif
#include <immintrin.h>

/* 16 results to 16-bit at o. `nt`: a non-temporal store (o 32-byte aligned), which skips reading
 * the destination line in before writing it: 2 of the fused pass's 32 bytes per element. */
static inline __attribute__((always_inline)) void put16(uint16_t *o, __m256i h, int nt) {
    if (nt) _mm256_stream_si256((__m256i *)o, h);
    else _mm256_storeu_si256((__m256i *)o, h);
}

static inline __attribute__((always_inline)) void store16(uint16_t *o, __m512 x, int kind, int nt) {
    if (kind == FNZ_OUT_FP16) {
        put16(o, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), nt);
    } else { /* bf16: u + 0x7FFF + lsb, >> 16, NaN -> 0x7FC0, as fnz_f32_to_bf16 */
        __m512i u = _mm512_castps_si512(x);
        __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
        r = _mm512_srli_epi32(r, 16);
        __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
        r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7FC0));
        put16(o, _mm512_cvtepi32_epi16(r), nt); /* lanes <= 0xFFFF */
    }
}

typedef struct adam_v {
    __m512 gs, wd, decay, omb1, b2, omb2, ibc, eps, nlr;
} adam_v;

/* One vector of 16 elements at i. Inlined four times per loop turn below: the same operations
 * per element (so the same bits), but four independent chains in flight, which keeps more
 * memory requests outstanding (measured ~7-20% on 2 threads, where the loop is memory-bound). */
static inline __attribute__((always_inline)) void adam16(const adam_v *k, int l2, int out_kind, float *p,
                                                          const float *g, float *m, float *v,
                                                          uint16_t *o, int64_t i, int nt) {
    __m512 pi = _mm512_loadu_ps(p + i);
    __m512 gi = _mm512_mul_ps(_mm512_loadu_ps(g + i), k->gs);
    if (l2) gi = _mm512_add_ps(gi, _mm512_mul_ps(k->wd, pi));
    pi = _mm512_mul_ps(pi, k->decay);
    __m512 mi = _mm512_loadu_ps(m + i);
    mi = _mm512_add_ps(mi, _mm512_mul_ps(k->omb1, _mm512_sub_ps(gi, mi)));
    __m512 vi = _mm512_mul_ps(_mm512_loadu_ps(v + i), k->b2);
    vi = _mm512_add_ps(vi, _mm512_mul_ps(_mm512_mul_ps(k->omb2, gi), gi));
    __m512 denom = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(vi), k->ibc), k->eps);
    pi = _mm512_add_ps(pi, _mm512_div_ps(_mm512_mul_ps(k->nlr, mi), denom));
    _mm512_storeu_ps(m + i, mi);
    _mm512_storeu_ps(v + i, vi);
    _mm512_storeu_ps(p + i, pi);
    if (o) store16(o + i, pi, out_kind, nt);
}

/* Elements of scalar head before a 16-bit output streamed with non-temporal stores is cache-line
 * aligned, or -1 where it is not streamed (under FNZ_NT_MIN elements, or not 2-byte aligned). */
static inline int64_t nt_head(const uint16_t *o, int64_t n) {
    if (!o || n < FNZ_NT_MIN || ((uintptr_t)o & 1)) return -1;
    return (int64_t)((64 - ((uintptr_t)o & 63)) & 63) / 2;
}

static inline __attribute__((always_inline)) int64_t adam_loop(const adam_v *k, int l2, int kind, float *p,
                                                                const float *g, float *m, float *v,
                                                                uint16_t *o, int64_t i, int64_t n, int nt) {
    for (; i + 64 <= n; i += 64) {
        adam16(k, l2, kind, p, g, m, v, o, i, nt);
        adam16(k, l2, kind, p, g, m, v, o, i + 16, nt);
        adam16(k, l2, kind, p, g, m, v, o, i + 32, nt);
        adam16(k, l2, kind, p, g, m, v, o, i + 48, nt);
    }
    for (; i + 16 <= n; i += 16) adam16(k, l2, kind, p, g, m, v, o, i, nt);
    return i;
}

static int64_t adam(const fnz_coef *c, float *p, const float *g, float *m, float *v,
                    uint16_t *o, int64_t n) {
    const adam_v k = {_mm512_set1_ps(c->gscale), _mm512_set1_ps(c->wd_l2), _mm512_set1_ps(c->decay),
                      _mm512_set1_ps(c->omb1), _mm512_set1_ps(c->b2), _mm512_set1_ps(c->omb2),
                      _mm512_set1_ps(c->inv_bc2s), _mm512_set1_ps(c->eps), _mm512_set1_ps(c->neg_lr)};
    const int l2 = c->l2, kind = c->out_kind;
    /* A 16-bit copy-out larger than the caches is written with non-temporal stores after a scalar
     * head that aligns it to a cache line (the same bits: every level computes each element alike);
     * a small one is better left in cache for whoever reads it next. */
    const int64_t head = nt_head(o, n);
    if (head >= 0) {
        fnz_loop_scalar(FNZ_K_ADAM, c, p, g, m, v, o, head);
        int64_t i = adam_loop(&k, l2, kind, p, g, m, v, o, head, n, 1);
        _mm_sfence(); /* the streamed lines are visible before this tile is reported done */
        return i;
    }
    return adam_loop(&k, l2, kind, p, g, m, v, o, 0, n, 0);
}

static int64_t adagrad(const fnz_coef *c, float *p, const float *g, float *s, uint16_t *o,
                       int64_t n) {
    const __m512 gs = _mm512_set1_ps(c->gscale), wd = _mm512_set1_ps(c->wd_l2);
    const __m512 eps = _mm512_set1_ps(c->eps), nlr = _mm512_set1_ps(c->neg_lr);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 pi = _mm512_loadu_ps(p + i);
        __m512 gi = _mm512_mul_ps(_mm512_loadu_ps(g + i), gs);
        if (c->l2) gi = _mm512_add_ps(gi, _mm512_mul_ps(wd, pi));
        __m512 si = _mm512_add_ps(_mm512_loadu_ps(s + i), _mm512_mul_ps(gi, gi));
        __m512 denom = _mm512_add_ps(_mm512_sqrt_ps(si), eps);
        pi = _mm512_add_ps(pi, _mm512_div_ps(_mm512_mul_ps(nlr, gi), denom));
        _mm512_storeu_ps(s + i, si);
        _mm512_storeu_ps(p + i, pi);
        if (o) store16(o + i, pi, c->out_kind, 0);
    }
    return i;
}

static int64_t lion(const fnz_coef *c, float *p, const float *g, float *m, uint16_t *o,
                    int64_t n) {
    const __m512 gs = _mm512_set1_ps(c->gscale), decay = _mm512_set1_ps(c->decay);
    const __m512 b1 = _mm512_set1_ps(c->b1), omb1 = _mm512_set1_ps(c->omb1);
    const __m512 b2 = _mm512_set1_ps(c->b2), omb2 = _mm512_set1_ps(c->omb2);
    const __m512 nlr = _mm512_set1_ps(c->neg_lr), zero = _mm512_setzero_ps();
    const __m512 one = _mm512_set1_ps(1.0f), mone = _mm512_set1_ps(-1.0f);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 gi = _mm512_mul_ps(_mm512_loadu_ps(g + i), gs);
        __m512 mi = _mm512_loadu_ps(m + i);
        __m512 t = _mm512_add_ps(_mm512_mul_ps(mi, b1), _mm512_mul_ps(gi, omb1));
        /* AVX-512F has no float and/or (that is DQ), so sign() is built from mask blends. */
        __m512 u = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(t, zero, _CMP_GT_OQ), zero, one);
        u = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(t, zero, _CMP_LT_OQ), u, mone);
        u = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(t, t, _CMP_UNORD_Q), u, t); /* NaN passes */
        __m512 pi = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(p + i), decay), _mm512_mul_ps(nlr, u));
        _mm512_storeu_ps(m + i, _mm512_add_ps(_mm512_mul_ps(mi, b2), _mm512_mul_ps(gi, omb2)));
        _mm512_storeu_ps(p + i, pi);
        if (o) store16(o + i, pi, c->out_kind, 0);
    }
    return i;
}

/* The STREAM-like reference (see fnz_loop_stream), vectorised at this level. */
static inline __attribute__((always_inline)) int64_t stream_loop(float *a, const float *b, float *c, float *d,
                                                                   uint16_t *o, int64_t i, int64_t n, int nt) {
    const __m512 k1 = _mm512_set1_ps(0.5f), k2 = _mm512_set1_ps(0.9f), k3 = _mm512_set1_ps(0.99f);
    for (; i + 16 <= n; i += 16) {
        __m512 bi = _mm512_loadu_ps(b + i);
        __m512 ai = _mm512_add_ps(_mm512_loadu_ps(a + i), _mm512_mul_ps(k1, bi));
        _mm512_storeu_ps(a + i, ai);
        if (o) put16(o + i, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(ai), 16)), nt);
        _mm512_storeu_ps(c + i, _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(c + i), k2), bi));
        _mm512_storeu_ps(d + i, _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(d + i), k3), bi));
    }
    return i;
}

void fnz_stream_avx512(float *a, const float *b, float *c, float *d, uint16_t *o, int64_t n) {
    int64_t i;
    const int64_t head = nt_head(o, n);
    if (head >= 0) { /* the 16-bit stream as the Adam loop writes it */
        fnz_loop_stream(a, b, c, d, o, head);
        i = stream_loop(a, b, c, d, o, head, n, 1);
        _mm_sfence();
    } else {
        i = stream_loop(a, b, c, d, o, 0, n, 0);
    }
    fnz_loop_stream(a + i, b + i, c + i, d + i, o ? o + i : 0, n - i);
}

void fnz_loop_avx512(int kind, const fnz_coef *c, float *p, const float *g, float *s1,
                   float *s2, uint16_t *o, int64_t n) {
    int64_t i = 0;
    switch (kind) {
    case FNZ_K_ADAM: i = adam(c, p, g, s1, s2, o, n); break;
    case FNZ_K_ADAGRAD: i = adagrad(c, p, g, s1, o, n); break;
    case FNZ_K_LION: i = lion(c, p, g, s1, o, n); break;
    case FNZ_K_TO16:
        for (; i + 16 <= n; i += 16) store16(o + i, _mm512_loadu_ps(p + i), c->out_kind, 0);
        break;
    default: return;
    }
    if (i < n)
        fnz_loop_scalar(kind, c, p + i, g ? g + i : 0, s1 ? s1 + i : 0, s2 ? s2 + i : 0,
                        o ? o + i : 0, n - i);
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else /* not x86: never dispatched to (fnz_simd_supported says no) */
void fnz_stream_avx512(float *a, const float *b, float *c, float *d, uint16_t *o, int64_t n) {
    fnz_loop_stream(a, b, c, d, o, n);
}
void fnz_loop_avx512(int kind, const fnz_coef *c, float *p, const float *g, float *s1,
                   float *s2, uint16_t *o, int64_t n) {
    fnz_loop_scalar(kind, c, p, g, s1, s2, o, n);
}
#endif
