/* Internal to fnzero's C extension (not ABI): the per-ISA loops behind cpu_adam.h.
 *
 * The public functions turn hyper-parameters into the float coefficients below once, split n
 * into per-thread tiles, and call one loop per tile. Each loop exists per ISA; all of them do
 * the same fp32 operations in the same order (no FMA), so their results are bit-identical. */
#ifndef FNZERO_KERNELS_H
#define FNZERO_KERNELS_H

#include <stdint.h>

/* Elements per tile from which the AVX-512 Adam loop writes its 16-bit copy-out with non-temporal
 * stores (2 MiB of output: past what a core's caches would keep for the next reader anyway). */
#define FNZ_NT_MIN ((int64_t)1 << 20)

enum { FNZ_K_ADAM = 0, FNZ_K_ADAGRAD = 1, FNZ_K_LION = 2, FNZ_K_TO16 = 3, FNZ_K_COUNT = 4 };

typedef struct fnz_coef {
    float gscale;   /* g = grad * gscale (1 is exact, so it is always applied) */
    int l2;         /* 1: g += wd_l2 * p (Adam L2, Adagrad); skipped at 0 like torch */
    float wd_l2;
    float decay;    /* p *= decay before the update (AdamW, Lion); 1 is exact */
    float b1, omb1; /* beta1 and 1 - beta1 (Adam lerp weight, Lion interpolation) */
    float b2, omb2; /* beta2 and 1 - beta2 */
    float inv_bc2s; /* 1 / sqrt(1 - beta2^step) (Adam) */
    float eps;
    float neg_lr;   /* -lr / (1 - beta1^step) for Adam, -clr for Adagrad, -lr for Lion */
    int out_kind;   /* FNZ_OUT_* */
} fnz_coef;

/* One loop over n elements of `kind`; the pointers are already offset to the tile. s1/s2 are
 * the state buffers (s2 unused by Adagrad and Lion); o is NULL when out_kind is FNZ_OUT_NONE.
 * For FNZ_K_TO16, p is the source (read only) and o the destination. */
void fnz_loop_scalar(int kind, const fnz_coef *c, float *p, const float *g, float *s1,
                     float *s2, uint16_t *o, int64_t n);
void fnz_loop_avx2(int kind, const fnz_coef *c, float *p, const float *g, float *s1,
                   float *s2, uint16_t *o, int64_t n);
void fnz_loop_avx512(int kind, const fnz_coef *c, float *p, const float *g, float *s1,
                     float *s2, uint16_t *o, int64_t n);
/* The benchmark's STREAM-like reference (cpu_adam.h: fnz_stream_adam_shape), per level; o, when
 * not NULL, takes the top 16 bits of each new a (fnz_stream_adam_shape16: 30 bytes per element). */
void fnz_loop_stream(float *a, const float *b, float *c, float *d, uint16_t *o, int64_t n);
void fnz_stream_avx2(float *a, const float *b, float *c, float *d, uint16_t *o, int64_t n);
void fnz_stream_avx512(float *a, const float *b, float *c, float *d, uint16_t *o, int64_t n);

/* Scalar conversions (shared by every ISA for tails). */
uint16_t fnz_f32_to_bf16(float f);
uint16_t fnz_f32_to_fp16(float f);

#endif
