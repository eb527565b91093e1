/* Public entry points of cpu_adam.h: argument checks, the float coefficients, SIMD dispatch and
 * the split of one flat buffer into a few large per-thread tiles.
 *
 * Where do the tiles run? On the OpenMP pool the process already has (torch's libgomp), found
 * among the loaded libraries, never linked: a second OpenMP runtime in the process would keep a
 * second pool, and many small regions of two pools under CPU contention were measured to
 * collapse 10-20x. Plain pthreads, created per call, are the fallback. Reusing torch's pool is
 * not only tidy: its workers spin for a few ms after each torch op, and a new pthread started
 * in that window shares a core with a spinning worker (10M params, 2 cores: 11.3 ms right after
 * torch's fused AdamW against 6.6 ms after a pause; on the pool, the same workers take the
 * tiles). Tiles are fixed by the size and thread count, so results never depend on which
 * threads run them. */
#define _GNU_SOURCE /* glibc: declares pthread and the rest under -std=c99 */
#include <math.h>
#include <pthread.h>
#include <stddef.h>
#include <string.h>
#if defined(__linux__)
#include <dlfcn.h>
#include <link.h>
#endif

#include "cpu_adam.h"
#include "kernels.h"

#define ABI_VERSION 4
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
        if (t->simd == FNZ_SIMD_AVX512) fnz_stream_avx512(t->p, t->g, t->s1, t->s2, t->o, t->n);
        else if (t->simd == FNZ_SIMD_AVX2) fnz_stream_avx2(t->p, t->g, t->s1, t->s2, t->o, t->n);
        else fnz_loop_stream(t->p, t->g, t->s1, t->s2, t->o, t->n);
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

typedef struct tile_set {
    const tile *tiles;
    int64_t count;
} tile_set;

/* The process's OpenMP runtime, if one is loaded: GNU's entry point (Intel's and LLVM's runtimes
 * export it too) and the two queries a region body needs. Looked up once. */
typedef void (*omp_parallel_fn)(void (*)(void *), void *, unsigned, unsigned);
typedef int (*omp_query_fn)(void);
static omp_parallel_fn omp_parallel;
static omp_query_fn omp_thread_num, omp_num_threads;
static pthread_once_t omp_once = PTHREAD_ONCE_INIT;

#if defined(__linux__)
/* The loaded library's name only: dlopen is not called from inside dl_iterate_phdr's callback
 * (it takes the loader's lock, which another thread's dlopen may hold). */
static char omp_name[4096];

static int find_omp(struct dl_phdr_info *info, size_t size, void *unused) {
    (void)size;
    (void)unused;
    const char *name = info->dlpi_name;
    if (!name || !(strstr(name, "libgomp") || strstr(name, "libiomp") || strstr(name, "libomp")))
        return 0;
    if (strlen(name) >= sizeof omp_name) return 0;
    strcpy(omp_name, name);
    return 1;
}

static void look_up_omp(void) {
    if (!dl_iterate_phdr(find_omp, NULL)) return;
    void *h = dlopen(omp_name, RTLD_NOW | RTLD_NOLOAD); /* already loaded: only a handle, no load */
    if (!h) return;
    omp_parallel_fn par = (omp_parallel_fn)dlsym(h, "GOMP_parallel");
    omp_query_fn num = (omp_query_fn)dlsym(h, "omp_get_thread_num");
    omp_query_fn count = (omp_query_fn)dlsym(h, "omp_get_num_threads");
    if (par && num && count) omp_parallel = par, omp_thread_num = num, omp_num_threads = count;
}
#else
static void look_up_omp(void) {}
#endif

int fnz_cpu_thread_pool(void) {
    pthread_once(&omp_once, look_up_omp);
    return omp_parallel != NULL;
}

/* The body of one parallel region: thread t of T runs tiles t, t+T, ... (T may be below the
 * tile count if the runtime gave fewer threads than asked). */
static void region_main(void *arg) {
    const tile_set *set = (const tile_set *)arg;
    int64_t t = omp_thread_num(), count = omp_num_threads();
    for (int64_t k = t; k < set->count; k += count) run_tile(&set->tiles[k]);
}

/* Split [0, n) into nt contiguous tiles (multiples of 64 elements, so no two threads share a
 * cache line of any buffer) and run them on the OpenMP pool, or else tile 0 on the caller and
 * the rest on new threads. A thread that fails to start has its tile run by the caller. */
static void run_split(int kind, int simd, const fnz_coef *c, float *p, const float *g,
                      float *s1, float *s2, uint16_t *o, int64_t n, int num_threads, int pool) {
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
    if (nt > 1 && pool && fnz_cpu_thread_pool()) {
        tile_set set = {tiles, nt};
        omp_parallel(region_main, &set, (unsigned)nt, 0);
        return;
    }
    for (int64_t k = 1; k < nt; k++) started[k] = pthread_create(&ids[k], NULL, tile_main, &tiles[k]) == 0;
    run_tile(&tiles[0]);
    for (int64_t k = 1; k < nt; k++) {
        if (started[k]) pthread_join(ids[k], NULL);
        else run_tile(&tiles[k]);
    }
}

/* Common checks and defaults of the fused extras; fills out_kind/o/threads/simd. */
static int resolve(const fnz_fused *f, int64_t n, fnz_coef *c, uint16_t **o, int *threads, int *simd,
                   int *pool) {
    c->gscale = f ? f->grad_scale : 1.0f;
    c->out_kind = f ? f->out_kind : FNZ_OUT_NONE;
    *o = f ? f->out16 : NULL;
    *threads = f ? f->num_threads : 1;
    *simd = f ? f->simd : FNZ_SIMD_AUTO;
    *pool = f ? f->thread_pool : 0;
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
    int threads, simd, pool, rc = resolve(fused, n, &c, &o, &threads, &simd, &pool);
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
    run_split(FNZ_K_ADAM, simd, &c, param, grad, exp_avg, exp_avg_sq, o, n, threads, pool);
    return FNZ_OK;
}

int fnz_adagrad_step(float *param, const float *grad, float *sum, int64_t n, int64_t step,
                     double lr, double lr_decay, double eps, double weight_decay,
                     const fnz_fused *fused) {
    fnz_coef c = {0};
    uint16_t *o;
    int threads, simd, pool, rc = resolve(fused, n, &c, &o, &threads, &simd, &pool);
    if (rc) return rc;
    if (step < 1) return FNZ_EINVAL;
    if (n > 0 && (!param || !grad || !sum)) return FNZ_EINVAL;
    c.l2 = weight_decay != 0.0;
    c.wd_l2 = (float)weight_decay;
    c.decay = 1.0f;
    c.eps = (float)eps;
    c.neg_lr = (float)(-lr / (1.0 + (double)(step - 1) * lr_decay));
    run_split(FNZ_K_ADAGRAD, simd, &c, param, grad, sum, NULL, o, n, threads, pool);
    return FNZ_OK;
}

int fnz_lion_step(float *param, const float *grad, float *exp_avg, int64_t n, double lr,
                  double beta1, double beta2, double weight_decay, const fnz_fused *fused) {
    fnz_coef c = {0};
    uint16_t *o;
    int threads, simd, pool, rc = resolve(fused, n, &c, &o, &threads, &simd, &pool);
    if (rc) return rc;
    if (n > 0 && (!param || !grad || !exp_avg)) return FNZ_EINVAL;
    c.decay = weight_decay != 0.0 ? (float)(1.0 - lr * weight_decay) : 1.0f;
    c.b1 = (float)beta1;
    c.omb1 = (float)(1.0 - beta1);
    c.b2 = (float)beta2;
    c.omb2 = (float)(1.0 - beta2);
    c.neg_lr = (float)(-lr);
    run_split(FNZ_K_LION, simd, &c, param, grad, exp_avg, NULL, o, n, threads, pool);
    return FNZ_OK;
}

int fnz_to_16bit(const float *src, uint16_t *dst, int64_t n, int kind, int simd) {
    fnz_coef c = {0};
    if (n < 0 || (kind != FNZ_OUT_BF16 && kind != FNZ_OUT_FP16)) return FNZ_EINVAL;
    if (n > 0 && (!src || !dst)) return FNZ_EINVAL;
    if (simd == FNZ_SIMD_AUTO) simd = fnz_simd_best();
    else if (!fnz_simd_supported(simd)) return FNZ_ENOSIMD;
    c.out_kind = kind;
    run_split(FNZ_K_TO16, simd, &c, (float *)src, NULL, NULL, NULL, dst, n, 1, 0);
    return FNZ_OK;
}

int fnz_stream_adam_shape(float *a, const float *b, float *c, float *d, int64_t n,
                          int num_threads, int thread_pool) {
    if (n < 0 || (n > 0 && (!a || !b || !c || !d))) return FNZ_EINVAL;
    run_split(-1, fnz_simd_best(), NULL, a, b, c, d, NULL, n, num_threads, thread_pool);
    return FNZ_OK;
}

int fnz_stream_adam_shape16(float *a, const float *b, float *c, float *d, uint16_t *o, int64_t n,
                            int num_threads, int thread_pool) {
    if (n < 0 || (n > 0 && (!a || !b || !c || !d || !o))) return FNZ_EINVAL;
    run_split(-1, fnz_simd_best(), NULL, a, b, c, d, o, n, num_threads, thread_pool);
    return FNZ_OK;
}
