/* What several of the model's C files share. native_lib.py builds each C file on its own
 * (one library each) and keys its cached library by the file and the local headers it
 * includes, so a change here rebuilds every includer. */
#ifndef PRELUDE_NATIVE_SHARED_H
#define PRELUDE_NATIVE_SHARED_H

#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

/* [*u0, *u1): the calling OpenMP thread's contiguous share of `units` work units. */
static inline void this_threads_share(int64_t units, int64_t *u0, int64_t *u1) {
#ifdef _OPENMP
    extern int omp_get_thread_num(void);
    extern int omp_get_num_threads(void);
    const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
#else
    const int64_t t = 0, n = 1;
#endif
    *u0 = units * t / n;
    *u1 = units * (t + 1) / n;
}

/* Whether Linux lets this process use the AMX tile registers (each process asks once; the
 * answer is cached, per library). */
static inline int amx_permitted(void) {
    static int permitted = -1;
    if (permitted < 0) permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return permitted;
}


#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* e^x for 8 floats: range reduction by ln 2 (split in two parts), a degree-6 polynomial
 * (Cephes' coefficients), 2^n built in the exponent bits. x is clamped to [-87.3, 88], so
 * the result stays a normal float (2^-126 .. 2^127 * 1.4). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.33654f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif


#if defined(__AVX512F__)
#include <immintrin.h>

/* The 16 x 16 32-bit words of r transposed in place: r[i][j] becomes r[j][i]. */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[4 + i], 0x88);
        t[4 + i] = _mm512_shuffle_i32x4(r[i], r[4 + i], 0xdd);
        t[8 + i] = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0x88);
        t[12 + i] = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0x88);
        r[8 + i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0xdd);
        r[4 + i] = _mm512_shuffle_i32x4(t[4 + i], t[12 + i], 0x88);
        r[12 + i] = _mm512_shuffle_i32x4(t[4 + i], t[12 + i], 0xdd);
    }
}

/* e^x for 16 floats, cpu_fused.c's exp8 on 16 lanes (range reduction by ln 2, degree-5
 * polynomial, ~1 ulp; inputs clamped to [-87.3, 88]): SiLU's exp, which is bound by exp and
 * the division, so the wider vectors pay. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.33654f)), _mm512_set1_ps(88.0f));
    __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    /* y * 2^fx in one instruction (exact, as the exponent-bits product of exp8 is) */
    return _mm512_scalef_ps(y, fx);
}

/* bias[o0 .. o0+15] (bfloat16) widened to float32 (exact), or zeros without a bias. */
static inline __m512 bias_block(const uint16_t *bias, int64_t o0) {
    if (bias == 0) return _mm512_setzero_ps();
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(bias + o0))), 16));
}
#endif

#if defined(__AMX_TILE__)
#include <immintrin.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* This thread's eight tiles, each 16 rows x 64 bytes. */
static inline void amx_configure(void) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
}
#endif

#endif
