/* Portable loops: the reference every SIMD level must match bit for bit, the tail handler of
 * the SIMD loops, and the only level off x86. Built with -O3 -fno-math-errno so the compiler
 * still vectorises them at the baseline ISA (sqrtf is then an instruction, not a libm call). */
#include <math.h>
#include <string.h>

#include "cpu_adam.h"
#include "kernels.h"

static inline uint32_t bits_of(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float float_of(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* torch's c10::BFloat16 rounding: round to nearest even on the dropped 16 bits; NaN -> 0x7FC0. */
uint16_t fnz_f32_to_bf16(float f) {
    uint32_t u = bits_of(f);
    if (f != f) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* IEEE binary16 with round to nearest even, subnormals, overflow to inf and NaN -> quiet NaN,
 * by the float-arithmetic method torch's c10::Half uses (M. Dukhan's FP16 library): scaling by
 * 2^112 then 2^-110 makes the FPU round the mantissa at the binary16 position for us. */
uint16_t fnz_f32_to_fp16(float f) {
    const float scale_to_inf = 0x1.0p+112f;
    const float scale_to_zero = 0x1.0p-110f;
    float base = (fabsf(f) * scale_to_inf) * scale_to_zero;
    uint32_t w = bits_of(f);
    uint32_t shl1_w = w + w;
    uint32_t sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = float_of((bias >> 1) + 0x07800000u) + base;
    uint32_t b = bits_of(base);
    uint32_t nonsign = ((b >> 13) & 0x00007C00u) + (b & 0x00000FFFu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

static inline void store16(uint16_t *o, int64_t i, float x, int kind) {
    if (kind == FNZ_OUT_BF16) o[i] = fnz_f32_to_bf16(x);
    else if (kind == FNZ_OUT_FP16) o[i] = fnz_f32_to_fp16(x);
}

/* The loops below have no branches in their bodies so the compiler vectorises them: the L2
 * choice is made per loop (torch skips the term when weight_decay is 0, which matters for
 * inf/NaN params), and the 16-bit copy-out runs per block of BLOCK elements right after the
 * block's update, while those params are still in L1 cache (one pass over memory still). */
#define BLOCK 512

static void copy_out(const float *p, uint16_t *o, int64_t n, int kind) {
    if (!o) return;
    for (int64_t i = 0; i < n; i++) store16(o, i, p[i], kind);
}

#define ADAM_LOOP(L2)                                                                        \
    for (int64_t i = 0; i < n; i++) {                                                        \
        float pi = p[i];                                                                     \
        float gi = g[i] * gs;                                                                \
        if (L2) gi = gi + wd * pi;                                                           \
        pi = pi * decay;                                                                     \
        float mi = m[i] + omb1 * (gi - m[i]);                                                \
        float vi = v[i] * b2 + (omb2 * gi) * gi;                                             \
        float denom = sqrtf(vi) * ibc + eps;                                                 \
        m[i] = mi;                                                                           \
        v[i] = vi;                                                                           \
        p[i] = pi + (nlr * mi) / denom;                                                      \
    }

static void adam_block(const fnz_coef *c, float *restrict p, const float *restrict g,
                       float *restrict m, float *restrict v, int64_t n) {
    /* Locals, so the compiler sees loop invariants. */
    const float gs = c->gscale, wd = c->wd_l2, decay = c->decay, omb1 = c->omb1;
    const float b2 = c->b2, omb2 = c->omb2, ibc = c->inv_bc2s, eps = c->eps, nlr = c->neg_lr;
    if (c->l2) {
        ADAM_LOOP(1)
    } else {
        ADAM_LOOP(0)
    }
}

#define ADAGRAD_LOOP(L2)                                                                     \
    for (int64_t i = 0; i < n; i++) {                                                        \
        float pi = p[i];                                                                     \
        float gi = g[i] * gs;                                                                \
        if (L2) gi = gi + wd * pi;                                                           \
        float si = s[i] + gi * gi;                                                           \
        s[i] = si;                                                                           \
        p[i] = pi + (nlr * gi) / (sqrtf(si) + eps);                                          \
    }

static void adagrad_block(const fnz_coef *c, float *restrict p, const float *restrict g,
                          float *restrict s, int64_t n) {
    const float gs = c->gscale, wd = c->wd_l2, eps = c->eps, nlr = c->neg_lr;
    if (c->l2) {
        ADAGRAD_LOOP(1)
    } else {
        ADAGRAD_LOOP(0)
    }
}

static void lion_block(const fnz_coef *c, float *restrict p, const float *restrict g,
                       float *restrict m, int64_t n) {
    const float gs = c->gscale, decay = c->decay, b1 = c->b1, omb1 = c->omb1;
    const float b2 = c->b2, omb2 = c->omb2, nlr = c->neg_lr;
    for (int64_t i = 0; i < n; i++) {
        float gi = g[i] * gs;
        float mi = m[i];
        float t = mi * b1 + gi * omb1;
        /* sign(): +1, -1, 0 for +-0, and NaN passes through (as torch.sign). */
        float u = (float)(t > 0.0f) - (float)(t < 0.0f);
        u = t != t ? t : u;
        p[i] = p[i] * decay + nlr * u;
        m[i] = mi * b2 + gi * omb2;
    }
}

void fnz_loop_scalar(int kind, const fnz_coef *c, float *p, const float *g, float *s1,
                     float *s2, uint16_t *o, int64_t n) {
    for (int64_t lo = 0; lo < n; lo += BLOCK) {
        int64_t k = n - lo < BLOCK ? n - lo : BLOCK;
        float *pb = p + lo;
        switch (kind) {
        case FNZ_K_ADAM: adam_block(c, pb, g + lo, s1 + lo, s2 + lo, k); break;
        case FNZ_K_ADAGRAD: adagrad_block(c, pb, g + lo, s1 + lo, k); break;
        case FNZ_K_LION: lion_block(c, pb, g + lo, s1 + lo, k); break;
        case FNZ_K_TO16: break;
        default: return;
        }
        copy_out(pb, o ? o + lo : NULL, k, c->out_kind);
    }
}

/* Adam-shaped traffic (4 streams read, 3 written, 28 bytes per element) with one multiply-add
 * each: what memory alone allows. Kept trivially simple so the compiler vectorises it. */
void fnz_loop_stream(float *restrict a, const float *restrict b, float *restrict c,
                     float *restrict d, uint16_t *restrict o, int64_t n) {
    if (o) { /* with a 16-bit copy of the new a: its top half, the cheapest rounding */
        for (int64_t i = 0; i < n; i++) {
            float bi = b[i], ai = a[i] + 0.5f * bi;
            uint32_t u;
            memcpy(&u, &ai, sizeof u);
            a[i] = ai;
            o[i] = (uint16_t)(u >> 16);
            c[i] = c[i] * 0.9f + bi;
            d[i] = d[i] * 0.99f + bi;
        }
        return;
    }
    for (int64_t i = 0; i < n; i++) {
        float bi = b[i];
        a[i] = a[i] + 0.5f * bi;
        c[i] = c[i] * 0.9f + bi;
        d[i] = d[i] * 0.99f + bi;
    }
}
