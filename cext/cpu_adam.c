/* Public entry points of cpu_adam.h: argument checks, the float coefficients, SIMD dispatch and
 * the split of one flat buffer into a few large per-thread tiles.
 *
 * Threads are plain pthreads created per call, not OpenMP: linking libgomp into a process that
 * already carries torch's bundled libgomp gives two OpenMP runtimes with separate pools, and
 * many small parallel regions under CPU contention were measured to collapse 10-20x. A call
 * here is one big buffer, so thread start-up (~20 us) is noise next to a step (ms). */
#define _GNU_SOURCE /* glibc: declares pthread and the rest under -std=c99 */
#include <math.h>
#include <pthread.h>
#include <stddef.h>

#include "cpu_adam.h"
#include "kernels.h"

#define ABI_VERSION 1
#define MIN_TILE 65536 /* elements per thread at least: below this threads cost more than they give */
#define MAX_THREADS 256

int fnz_cpu_abi_version(void) { return ABI_VERSION; }

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#include <cpuid.h>
/* F16C is not among __builtin_cpu_supports' names in older GCCs: ask cpuid directly. */
static int has_f16c(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    return (c & bit_F16C) != 0;
}
/* __builtin_cpu_supports also checks (via xgetbv) that the OS saves the wide registers. */
int fnz_simd_supported(int level) {
    __builtin_cpu_init();
    switch (level) {
    case FNZ_SIMD_SCALAR: return 1;
    case FNZ_SIMD_AVX2:
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && has_f16c();
    case FNZ_SIMD_AVX512: return __builtin_cpu_supports("avx512f") != 0;
    default: return 0;
    }
}
#else
int fnz_simd_supported(int level) { return level == FNZ_SIMD_SCALAR; }
#endif

int fnz_simd_best(void) {
    if (fnz_simd_supported(FNZ_SIMD_AVX512)) return FNZ_SIMD_AVX512;
    if (fnz_simd_supported(FNZ_SIMD_AVX2)) return FNZ_SIMD_AVX2;
    return FNZ_SIMD_SCALAR;
}

typedef struct tile {
    int kind, simd;
    const fnz_coef *c;
    float *p;
    const float *g;
    float *s1, *s2;
    uint16_t *o;
    int64_t n;
} tile;

static void run_tile(const tile *t) {
    if (t->n <= 0) return;
    if (t->kind < 0) { /* the STREAM reference */
        if (t->simd == FNZ_SIMD_AVX512) fnz_stream_avx512(t->p, t->g, t->s1, t->s2, t->n);
        else if (t->simd == FNZ_SIMD_AVX2) fnz_stream_avx2(t->p, t->g, t->s1, t->s2, t->n);
        else fnz_loop_stream(t->p, t->g, t->s1, t->s2, t->n);
    } else if (t->simd == FNZ_SIMD_AVX512) {
        fnz_loop_avx512(t->kind, t->c, t->p, t->g, t->s1, t->s2, t->o, t->n);
    } else if (t->simd == FNZ_SIMD_AVX2) {
        fnz_loop_avx2(t->kind, t->c, t->p, t->g, t->s1, t->s2, t->o, t->n);
    } else {
        fnz_loop_scalar(t->kind, t->c, t->p, t->g, t->s1, t->s2, t->o, t->n);
    }
}

static void *tile_main(void *arg) {
    run_tile((const tile *)arg);
    return NULL;
}

static const float *offset_c(const float *b, int64_t i) { return b ? b + i : NULL; }
static float *offset(float *b, int64_t i) { return b ? b + i : NULL; }

/* Split [0, n) into nt contiguous tiles (multiples of 64 elements, so no two threads share a
 * cache line of any buffer), run tile 0 on the caller and the rest on new threads. A thread
 * that fails to start has its tile run by the caller: the result never depends on threads. */
static void run_split(int kind, int simd, const fnz_coef *c, float *p, const float *g,
                      float *s1, float *s2, uint16_t *o, int64_t n, int num_threads) {
    int64_t nt = num_threads < 1 ? 1 : (num_threads > MAX_THREADS ? MAX_THREADS : num_threads);
    if (nt > n / MIN_TILE) nt = n / MIN_TILE > 0 ? n / MIN_TILE : 1;
    int64_t per = ((n + nt - 1) / nt + 63) / 64 * 64;
    tile tiles[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS];
    for (int64_t k = 0; k < nt; k++) {
        int64_t lo = k * per < n ? k * per : n;
        int64_t hi = lo + per < n ? lo + per : n;
        tile t = {kind, simd, c, offset(p, lo), offset_c(g, lo), offset(s1, lo), offset(s2, lo),
                  o ? o + lo : NULL, hi - lo};
        tiles[k] = t;
        started[k] = 0;
    }
    for (int64_t k = 1; k < nt; k++) started[k] = pthread_create(&ids[k], NULL, tile_main, &tiles[k]) == 0;
    run_tile(&tiles[0]);
    for (int64_t k = 1; k < nt; k++) {
        if (started[k]) pthread_join(ids[k], NULL);
        else run_tile(&tiles[k]);
    }
}

/* Common checks and defaults of the fused extras; fills out_kind/o/threads/simd. */
static int resolve(const fnz_fused *f, int64_t n, fnz_coef *c, uint16_t **o, int *threads, int *simd) {
    c->gscale = f ? f->grad_scale : 1.0f;
    c->out_kind = f ? f->out_kind : FNZ_OUT_NONE;
    *o = f ? f->out16 : NULL;
    *threads = f ? f->num_threads : 1;
    *simd = f ? f->simd : FNZ_SIMD_AUTO;
    if (n < 0) return FNZ_EINVAL;
    if (c->out_kind != FNZ_OUT_NONE && c->out_kind != FNZ_OUT_BF16 && c->out_kind != FNZ_OUT_FP16)
        return FNZ_EINVAL;
    if ((c->out_kind == FNZ_OUT_NONE) != (*o == NULL) && n > 0) return FNZ_EINVAL;
    if (c->out_kind == FNZ_OUT_NONE) *o = NULL;
    if (*simd == FNZ_SIMD_AUTO) *simd = fnz_simd_best();
    else if (!fnz_simd_supported(*simd)) return FNZ_ENOSIMD;
    return FNZ_OK;
}

int fnz_adam_step(float *param, const float *grad, float *exp_avg, float *exp_avg_sq, int64_t n,
                  int64_t step, double lr, double beta1, double beta2, double eps,
                  double weight_decay, int adamw, int bias_correction, const fnz_fused *fused) {
    fnz_coef c = {0};
    uint16_t *o;
    int threads, simd, rc = resolve(fused, n, &c, &o, &threads, &simd);
    if (rc) return rc;
    if (step < 1) return FNZ_EINVAL;
    if (n > 0 && (!param || !grad || !exp_avg || !exp_avg_sq)) return FNZ_EINVAL;
    double bc1 = bias_correction ? 1.0 - pow(beta1, (double)step) : 1.0;
    double bc2 = bias_correction ? 1.0 - pow(beta2, (double)step) : 1.0;
    c.l2 = !adamw && weight_decay != 0.0;
    c.wd_l2 = (float)weight_decay;
    c.decay = (adamw && weight_decay != 0.0) ? (float)(1.0 - lr * weight_decay) : 1.0f;
    c.b1 = (float)beta1;
    c.omb1 = (float)(1.0 - beta1);
    c.b2 = (float)beta2;
    c.omb2 = (float)(1.0 - beta2);
    c.inv_bc2s = (float)(1.0 / sqrt(bc2));
    c.eps = (float)eps;
    c.neg_lr = (float)(-lr / bc1);
    run_split(FNZ_K_ADAM, simd, &c, param, grad, exp_avg, exp_avg_sq, o, n, threads);
    return FNZ_OK;
}

int fnz_adagrad_step(float *param, const float *grad, float *sum, int64_t n, int64_t step,
                     double lr, double lr_decay, double eps, double weight_decay,
                     const fnz_fused *fused) {
    fnz_coef c = {0};
    uint16_t *o;
    int threads, simd, rc = resolve(fused, n, &c, &o, &threads, &simd);
    if (rc) return rc;
    if (step < 1) return FNZ_EINVAL;
    if (n > 0 && (!param || !grad || !sum)) return FNZ_EINVAL;
    c.l2 = weight_decay != 0.0;
    c.wd_l2 = (float)weight_decay;
    c.decay = 1.0f;
    c.eps = (float)eps;
    c.neg_lr = (float)(-lr / (1.0 + (double)(step - 1) * lr_decay));
    run_split(FNZ_K_ADAGRAD, simd, &c, param, grad, sum, NULL, o, n, threads);
    return FNZ_OK;
}

int fnz_lion_step(float *param, const float *grad, float *exp_avg, int64_t n, double lr,
                  double beta1, double beta2, double weight_decay, const fnz_fused *fused) {
    fnz_coef c = {0};
    uint16_t *o;
    int threads, simd, rc = resolve(fused, n, &c, &o, &threads, &simd);
    if (rc) return rc;
    if (n > 0 && (!param || !grad || !exp_avg)) return FNZ_EINVAL;
    c.decay = weight_decay != 0.0 ? (float)(1.0 - lr * weight_decay) : 1.0f;
    c.b1 = (float)beta1;
    c.omb1 = (float)(1.0 - beta1);
    c.b2 = (float)beta2;
    c.omb2 = (float)(1.0 - beta2);
    c.neg_lr = (float)(-lr);
    run_split(FNZ_K_LION, simd, &c, param, grad, exp_avg, NULL, o, n, threads);
    return FNZ_OK;
}

int fnz_to_16bit(const float *src, uint16_t *dst, int64_t n, int kind, int simd) {
    fnz_coef c = {0};
    if (n < 0 || (kind != FNZ_OUT_BF16 && kind != FNZ_OUT_FP16)) return FNZ_EINVAL;
    if (n > 0 && (!src || !dst)) return FNZ_EINVAL;
    if (simd == FNZ_SIMD_AUTO) simd = fnz_simd_best();
    else if (!fnz_simd_supported(simd)) return FNZ_ENOSIMD;
    c.out_kind = kind;
    run_split(FNZ_K_TO16, simd, &c, (float *)src, NULL, NULL, NULL, dst, n, 1);
    return FNZ_OK;
}

int fnz_stream_adam_shape(float *a, const float *b, float *c, float *d, int64_t n,
                          int num_threads) {
    if (n < 0 || (n > 0 && (!a || !b || !c || !d))) return FNZ_EINVAL;
    run_split(-1, fnz_simd_best(), NULL, a, b, c, d, NULL, n, num_threads);
    return FNZ_OK;
}
