/* AVX2 loops (with FMA and F16C present, though FMA is deliberately not used: the scalar
 * reference has no FMA and every level must match it bit for bit). Compiled for the baseline
 * ISA with a per-file target pragma, and only called after cpuid said the CPU has AVX2, so the
 * shipped library runs anywhere (no -march=native). Tails go to the scalar loop. */
#include "cpu_adam.h"
#include "kernels.h"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
#include <immintrin.h>

static inline void store16(uint16_t *o, __m256 x, int kind) {
    if (kind == FNZ_OUT_FP16) {
        _mm_storeu_si128((__m128i *)o, _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
    } else { /* bf16: u + 0x7FFF + lsb, >> 16, NaN -> 0x7FC0, as fnz_f32_to_bf16 */
        __m256i u = _mm256_castps_si256(x);
        __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb);
        r = _mm256_srli_epi32(r, 16);
        __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
        r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
        /* Every lane is <= 0xFFFF, so unsigned saturation is a plain narrowing. */
        __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
        _mm_storeu_si128((__m128i *)o, packed);
    }
}

static int64_t adam(const fnz_coef *c, float *p, const float *g, float *m, float *v,
                    uint16_t *o, int64_t n) {
    const __m256 gs = _mm256_set1_ps(c->gscale), wd = _mm256_set1_ps(c->wd_l2);
    const __m256 decay = _mm256_set1_ps(c->decay), omb1 = _mm256_set1_ps(c->omb1);
    const __m256 b2 = _mm256_set1_ps(c->b2), omb2 = _mm256_set1_ps(c->omb2);
    const __m256 ibc = _mm256_set1_ps(c->inv_bc2s), eps = _mm256_set1_ps(c->eps);
    const __m256 nlr = _mm256_set1_ps(c->neg_lr);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 pi = _mm256_loadu_ps(p + i);
        __m256 gi = _mm256_mul_ps(_mm256_loadu_ps(g + i), gs);
        if (c->l2) gi = _mm256_add_ps(gi, _mm256_mul_ps(wd, pi));
        pi = _mm256_mul_ps(pi, decay);
        __m256 mi = _mm256_loadu_ps(m + i);
        mi = _mm256_add_ps(mi, _mm256_mul_ps(omb1, _mm256_sub_ps(gi, mi)));
        __m256 vi = _mm256_mul_ps(_mm256_loadu_ps(v + i), b2);
        vi = _mm256_add_ps(vi, _mm256_mul_ps(_mm256_mul_ps(omb2, gi), gi));
        __m256 denom = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(vi), ibc), eps);
        pi = _mm256_add_ps(pi, _mm256_div_ps(_mm256_mul_ps(nlr, mi), denom));
        _mm256_storeu_ps(m + i, mi);
        _mm256_storeu_ps(v + i, vi);
        _mm256_storeu_ps(p + i, pi);
        if (o) store16(o + i, pi, c->out_kind);
    }
    return i;
}

static int64_t adagrad(const fnz_coef *c, float *p, const float *g, float *s, uint16_t *o,
                       int64_t n) {
    const __m256 gs = _mm256_set1_ps(c->gscale), wd = _mm256_set1_ps(c->wd_l2);
    const __m256 eps = _mm256_set1_ps(c->eps), nlr = _mm256_set1_ps(c->neg_lr);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 pi = _mm256_loadu_ps(p + i);
        __m256 gi = _mm256_mul_ps(_mm256_loadu_ps(g + i), gs);
        if (c->l2) gi = _mm256_add_ps(gi, _mm256_mul_ps(wd, pi));
        __m256 si = _mm256_add_ps(_mm256_loadu_ps(s + i), _mm256_mul_ps(gi, gi));
        __m256 denom = _mm256_add_ps(_mm256_sqrt_ps(si), eps);
        pi = _mm256_add_ps(pi, _mm256_div_ps(_mm256_mul_ps(nlr, gi), denom));
        _mm256_storeu_ps(s + i, si);
        _mm256_storeu_ps(p + i, pi);
        if (o) store16(o + i, pi, c->out_kind);
    }
    return i;
}

static int64_t lion(const fnz_coef *c, float *p, const float *g, float *m, uint16_t *o,
                    int64_t n) {
    const __m256 gs = _mm256_set1_ps(c->gscale), decay = _mm256_set1_ps(c->decay);
    const __m256 b1 = _mm256_set1_ps(c->b1), omb1 = _mm256_set1_ps(c->omb1);
    const __m256 b2 = _mm256_set1_ps(c->b2), omb2 = _mm256_set1_ps(c->omb2);
    const __m256 nlr = _mm256_set1_ps(c->neg_lr), zero = _mm256_setzero_ps();
    const __m256 one = _mm256_set1_ps(1.0f), mone = _mm256_set1_ps(-1.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 gi = _mm256_mul_ps(_mm256_loadu_ps(g + i), gs);
        __m256 mi = _mm256_loadu_ps(m + i);
        __m256 t = _mm256_add_ps(_mm256_mul_ps(mi, b1), _mm256_mul_ps(gi, omb1));
        __m256 u = _mm256_or_ps(_mm256_and_ps(_mm256_cmp_ps(t, zero, _CMP_GT_OQ), one),
                                _mm256_and_ps(_mm256_cmp_ps(t, zero, _CMP_LT_OQ), mone));
        u = _mm256_blendv_ps(u, t, _mm256_cmp_ps(t, t, _CMP_UNORD_Q)); /* NaN passes through */
        __m256 pi = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(p + i), decay), _mm256_mul_ps(nlr, u));
        _mm256_storeu_ps(m + i, _mm256_add_ps(_mm256_mul_ps(mi, b2), _mm256_mul_ps(gi, omb2)));
        _mm256_storeu_ps(p + i, pi);
        if (o) store16(o + i, pi, c->out_kind);
    }
    return i;
}

/* The STREAM-like reference (see fnz_loop_stream), vectorised at this level. */
void fnz_stream_avx2(float *a, const float *b, float *c, float *d, uint16_t *o, int64_t n) {
    const __m256 k1 = _mm256_set1_ps(0.5f), k2 = _mm256_set1_ps(0.9f), k3 = _mm256_set1_ps(0.99f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 bi = _mm256_loadu_ps(b + i);
        __m256 ai = _mm256_add_ps(_mm256_loadu_ps(a + i), _mm256_mul_ps(k1, bi));
        _mm256_storeu_ps(a + i, ai);
        if (o) { /* top halves, packed (each <= 0xFFFF, so the unsigned saturation is exact) */
            __m256i r = _mm256_srli_epi32(_mm256_castps_si256(ai), 16);
            __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
            _mm_storeu_si128((__m128i *)(o + i), h);
        }
        _mm256_storeu_ps(c + i, _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(c + i), k2), bi));
        _mm256_storeu_ps(d + i, _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(d + i), k3), bi));
    }
    fnz_loop_stream(a + i, b + i, c + i, d + i, o ? o + i : 0, n - i);
}

void fnz_loop_avx2(int kind, const fnz_coef *c, float *p, const float *g, float *s1,
                   float *s2, uint16_t *o, int64_t n) {
    int64_t i = 0;
    switch (kind) {
    case FNZ_K_ADAM: i = adam(c, p, g, s1, s2, o, n); break;
    case FNZ_K_ADAGRAD: i = adagrad(c, p, g, s1, o, n); break;
    case FNZ_K_LION: i = lion(c, p, g, s1, o, n); break;
    case FNZ_K_TO16:
        for (; i + 8 <= n; i += 8) store16(o + i, _mm256_loadu_ps(p + i), c->out_kind);
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
void fnz_stream_avx2(float *a, const float *b, float *c, float *d, uint16_t *o, int64_t n) {
    fnz_loop_stream(a, b, c, d, o, n);
}
void fnz_loop_avx2(int kind, const fnz_coef *c, float *p, const float *g, float *s1,
                   float *s2, uint16_t *o, int64_t n) {
    fnz_loop_scalar(kind, c, p, g, s1, s2, o, n);
}
#endif
