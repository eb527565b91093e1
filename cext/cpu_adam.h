/* fnzero CPU optimizer kernels: the ABI (see specs/cext.md).
 *
 * Stateless: every hyper-parameter and the step count come in as arguments, and the SIMD level
 * is an argument too, so any thread may call any function at any time. The one global is a
 * process constant looked up once: where the loaded OpenMP runtime is (fnz_cpu_thread_pool). All buffers are contiguous fp32 arrays of n elements, updated in place.
 *
 * Aliasing: param, grad, state1 (exp_avg / sum / Lion momentum) and state2 (exp_avg_sq) must
 * be pairwise disjoint; out16, when given, must not overlap any of them. Callers check this
 * (fnzero/_ext does); the kernels assume it (they read each element once and write it once, so
 * overlap would silently mix updated and stale values).
 *
 * Numerics: per element, in fp32, without FMA contraction, in the same order on every SIMD
 * level, so all levels give bit-identical results (sqrt and division are correctly rounded
 * everywhere). Scalar coefficients (bias corrections, decay factors) are computed in double
 * and rounded once to float, like torch's fused CPU kernels.
 */
#ifndef FNZERO_CPU_ADAM_H
#define FNZERO_CPU_ADAM_H

#include <stdint.h>

/* SIMD levels. FNZ_SIMD_AUTO picks the best level this CPU and OS support. */
#define FNZ_SIMD_AUTO (-1)
#define FNZ_SIMD_SCALAR 0 /* portable C, auto-vectorised by the compiler at the baseline ISA */
#define FNZ_SIMD_AVX2 1   /* AVX2 + FMA + F16C (x86-64 since 2013) */
#define FNZ_SIMD_AVX512 2 /* AVX-512F */

/* Kinds of the optional 16-bit copy of the updated params. */
#define FNZ_OUT_NONE 0
#define FNZ_OUT_BF16 1 /* bfloat16, round to nearest even, NaN -> 0x7FC0 (as torch) */
#define FNZ_OUT_FP16 2 /* IEEE binary16, round to nearest even, overflow -> +-inf (as torch) */

/* Return codes (0 = success). */
#define FNZ_OK 0
#define FNZ_EINVAL (-22) /* a bad argument: unknown kind, n < 0, NULL buffer with n > 0 */
#define FNZ_ENOSIMD (-95) /* the requested SIMD level is not supported on this CPU */

/* Highest level this CPU supports (checked by cpuid and the OS's saved vector state). */
int fnz_simd_best(void);

/* 1 if `level` can run here, else 0. */
int fnz_simd_supported(int level);

/* Version of this ABI; bumped whenever a signature or a constant above changes. */
int fnz_cpu_abi_version(void);

/* Extras applied in the same memory pass as every kernel below. */
typedef struct fnz_fused {
    float grad_scale; /* grad is multiplied by this first (1/loss_scale * clip_coef); 1 = none.
                         grad itself is read, never written. */
    int out_kind;     /* FNZ_OUT_NONE / FNZ_OUT_BF16 / FNZ_OUT_FP16 */
    uint16_t *out16;  /* n 16-bit values written after the update; NULL iff out_kind == NONE */
    int num_threads;  /* threads to split n over; <= 1 means the calling thread only. Tiles are
                         at least 64K elements, so small n uses fewer threads. */
    int simd;         /* FNZ_SIMD_* level to run, FNZ_SIMD_AUTO for the best */
    int thread_pool;  /* 1: run the threads' tiles on the OpenMP pool the process has already
                         loaded (torch's), when there is one; 0: on new pthreads */
} fnz_fused;

/* 1 if an OpenMP runtime is loaded in this process (found by name among the loaded libraries,
 * never loaded by fnzero), so thread_pool = 1 uses it; 0 if thread_pool = 1 falls back to
 * pthreads. Linux only; elsewhere always 0. */
int fnz_cpu_thread_pool(void);

/* Adam / AdamW, torch.optim.Adam(W) arithmetic:
 *   g = grad * grad_scale;  if !adamw: g += weight_decay * p;  if adamw: p *= 1 - lr*weight_decay
 *   m = m + (1-beta1)*(g - m);   v = v*beta2 + (1-beta2)*g*g
 *   p = p - (lr/bc1) * m / (sqrt(v)/sqrt(bc2) + eps),  bc_i = 1 - beta_i^step (1 if !bias_correction)
 *
 * param, grad, exp_avg, exp_avg_sq: n floats each (exp_avg, exp_avg_sq are the moments).
 * step: the 1-based count of this step, including it (>= 1).
 * lr, beta1, beta2, eps, weight_decay: as torch.optim.Adam.
 * adamw: 1 = decoupled decay (AdamW), 0 = L2 penalty added to the gradient (Adam).
 * bias_correction: 1 = divide by 1 - beta^step (torch), 0 = not (DeepSpeed's option).
 * fused: extras and threading, see fnz_fused; NULL = none, one thread, best SIMD.
 * Returns FNZ_OK, FNZ_EINVAL or FNZ_ENOSIMD; on an error nothing was written. */
int fnz_adam_step(float *param, const float *grad, float *exp_avg, float *exp_avg_sq, int64_t n,
                  int64_t step, double lr, double beta1, double beta2, double eps,
                  double weight_decay, int adamw, int bias_correction, const fnz_fused *fused);

/* Adagrad, torch.optim.Adagrad arithmetic:
 *   clr = lr / (1 + (step-1)*lr_decay);  g = grad*grad_scale + weight_decay*p
 *   sum += g*g;  p = p - clr * g / (sqrt(sum) + eps)
 * param, grad, sum: n floats each; step >= 1 counts this step; the rest as torch. */
int fnz_adagrad_step(float *param, const float *grad, float *sum, int64_t n, int64_t step,
                     double lr, double lr_decay, double eps, double weight_decay,
                     const fnz_fused *fused);

/* Lion (Chen et al. 2023), decoupled weight decay:
 *   g = grad*grad_scale;  u = sign(beta1*m + (1-beta1)*g)   (sign(0) = 0, NaN stays NaN)
 *   p = p*(1 - lr*weight_decay) - lr*u;   m = beta2*m + (1-beta2)*g
 * param, grad, exp_avg: n floats each (exp_avg is the momentum). No step count is needed. */
int fnz_lion_step(float *param, const float *grad, float *exp_avg, int64_t n, double lr,
                  double beta1, double beta2, double weight_decay, const fnz_fused *fused);

/* Conversions on their own (the same code the kernels fuse), for tests and copy-outs:
 * src: n floats; dst: n 16-bit values; kind: FNZ_OUT_BF16 or FNZ_OUT_FP16. */
int fnz_to_16bit(const float *src, uint16_t *dst, int64_t n, int kind, int simd);

/* crc32 as zlib computes it (crc32(crc32(0, a), b) == crc32(0, a + b)), of n bytes at buf:
 * carry-less multiplication (PCLMULQDQ) where the CPU has it and simd is not FNZ_SIMD_SCALAR,
 * else a bytewise table; both give zlib's value. Returns crc unchanged for n <= 0. */
uint32_t fnz_crc32(uint32_t crc, const void *buf, int64_t n, int simd);

/* A STREAM-like reference loop shaped like Adam's memory traffic (reads 4 arrays, writes 3:
 * 28 bytes per element) with trivial arithmetic: the bandwidth ceiling for the benchmark. */
int fnz_stream_adam_shape(float *a, const float *b, float *c, float *d, int64_t n,
                          int num_threads, int thread_pool);
/* The same with a 16-bit copy of each new a into o (30 bytes per element), written as the fused
 * Adam pass writes its copy-out: the reference for that pass (since ABI 4). */
int fnz_stream_adam_shape16(float *a, const float *b, float *c, float *d, uint16_t *o, int64_t n,
                            int num_threads, int thread_pool);

#endif
