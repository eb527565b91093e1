/* crc32 (zlib's: reflected polynomial 0xEDB88320, pre- and post-inverted), for checkpoint
 * checksums. zlib's own runs at ~2 GB/s per core here, which made verified checkpoint loads
 * checksum-bound; carry-less multiplication (PCLMULQDQ, x86-64 since 2010) folds 64 bytes per
 * step at memory speed.
 *
 * Method (Gopal et al., "Fast CRC Computation for Generic Polynomials Using PCLMULQDQ", Intel
 * 2009): four 128-bit accumulators fold 64 bytes at a time, then into one, then 16 bytes at a
 * time. Folding keeps the value congruent to the message modulo the polynomial, so the CRC of the
 * 16-byte remainder, computed bytewise, is the CRC of everything folded; the last (< 16) bytes
 * follow bytewise too. The folding constants are x^(512+32), x^(512-32), x^(128+32) and
 * x^(128-32) mod P, bit-reflected (the ones the Linux kernel and zlib-ng use). A bytewise table
 * is the portable path and the reference the tests compare with zlib. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "cpu_adam.h"

static uint32_t table[256];
static pthread_once_t table_once = PTHREAD_ONCE_INIT;

static void make_table(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        table[n] = c;
    }
}

/* The raw (not inverted) register after `n` more bytes. */
static uint32_t bytewise(uint32_t r, const uint8_t *p, size_t n) {
    while (n--) r = table[(r ^ *p++) & 0xFF] ^ (r >> 8);
    return r;
}

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

static int has_pclmul(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
}

__attribute__((target("pclmul,sse4.1"))) static __m128i fold(__m128i x, __m128i k, __m128i next) {
    return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11)), next);
}

/* Folds the first (n / 16) * 16 >= 64 bytes; returns the register after them. */
__attribute__((target("pclmul,sse4.1"))) static uint32_t folded(uint32_t r, const uint8_t *p, size_t n) {
    const __m128i k512 = _mm_set_epi64x(0x1c6e41596LL, 0x154442bd4LL);
    const __m128i k128 = _mm_set_epi64x(0x0ccaa009eLL, 0x1751997d0LL);
    __m128i x1 = _mm_loadu_si128((const __m128i *)p), x2 = _mm_loadu_si128((const __m128i *)(p + 16));
    __m128i x3 = _mm_loadu_si128((const __m128i *)(p + 32)), x4 = _mm_loadu_si128((const __m128i *)(p + 48));
    x1 = _mm_xor_si128(x1, _mm_cvtsi32_si128((int)r));
    p += 64, n -= 64;
    for (; n >= 64; p += 64, n -= 64) {
        x1 = fold(x1, k512, _mm_loadu_si128((const __m128i *)p));
        x2 = fold(x2, k512, _mm_loadu_si128((const __m128i *)(p + 16)));
        x3 = fold(x3, k512, _mm_loadu_si128((const __m128i *)(p + 32)));
        x4 = fold(x4, k512, _mm_loadu_si128((const __m128i *)(p + 48)));
    }
    x1 = fold(fold(fold(x1, k128, x2), k128, x3), k128, x4);
    for (; n >= 16; p += 16, n -= 16) x1 = fold(x1, k128, _mm_loadu_si128((const __m128i *)p));
    uint8_t rest[16];
    _mm_storeu_si128((__m128i *)rest, x1);
    return bytewise(0, rest, 16);
}
#else
static int has_pclmul(void) { return 0; }
static uint32_t folded(uint32_t r, const uint8_t *p, size_t n) { return bytewise(r, p, n / 16 * 16); }
#endif

static int pclmul = -1;
static pthread_once_t pclmul_once = PTHREAD_ONCE_INIT;
static void look_up_pclmul(void) { pclmul = has_pclmul(); }

uint32_t fnz_crc32(uint32_t crc, const void *buf, int64_t n, int simd) {
    pthread_once(&table_once, make_table);
    pthread_once(&pclmul_once, look_up_pclmul);
    const uint8_t *p = (const uint8_t *)buf;
    uint32_t r = ~crc;
    if (n <= 0 || !p) return crc;
    size_t len = (size_t)n, head = 0;
    if (simd != FNZ_SIMD_SCALAR && pclmul && len >= 64) {
        head = len / 16 * 16;
        r = folded(r, p, head);
    }
    return ~bytewise(r, p + head, len - head);
}
