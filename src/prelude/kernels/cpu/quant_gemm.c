/* y[M, N] = x[M, K] . W[N, K]^T (+ bias) with W kept in GGUF's 32-weight blocks
 * (Q4_0, Q4_1, Q8_0), for the few-row calls of decode (AVX2 + FMA, OpenMP over N).
 *
 * Decode on a CPU reads every weight once per step: float32 weights make it memory-bound.
 * The blocks take a quarter to a seventh of float32's bytes. A block's contribution is
 * d * (x . q) + m * sum(x) (gguf's dequantization, d * q + m, distributed), so the
 * result equals x . W^T over the float32 weights the prefill GEMMs use up to float32
 * rounding of the sums (the order differs, as it does between any two GEMM libraries).
 *
 * Layout (see kernels/ggml_quants.py): qs [N, K/2] (4-bit: in each 16-byte block, byte j holds
 * element j in its low nibble and element j + 16 in its high nibble) or [N, K] (int8);
 * d, m [N, K/32] float32 (m only for Q4_1). Built with -mavx2 -mfma -ffp-contract=off.
 */
#include "prelude_kernels.h"
#include <immintrin.h>
#include <stdint.h>

enum { KIND_Q4_0 = 0, KIND_Q4_1 = 1, KIND_Q8_0 = 2 };

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The 32 quants of one block as four vectors of 8 floats (elements 0-7, 8-15, 16-23,
 * 24-31): integers, unscaled. Q4_0's offset of 8 is folded into the block's minimum. */
static inline __attribute__((always_inline)) void quants(const int kind, const uint8_t *q, __m256 w[4]) {
    if (kind == KIND_Q8_0) {
        for (int g = 0; g < 4; g++)
            w[g] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * g))));
        return;
    }
    const __m128i raw = _mm_loadu_si128((const __m128i *)q);
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(raw, low4);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

/* One output feature for `rows` (1-4, a constant after inlining) rows of x:
 * sum_b d_b * (x_b . q_b) in vectors; the blocks' minimums (sum_b m_b * sum(x_b)) are
 * added by the caller from per-block sums of x. */
static inline __attribute__((always_inline)) void dot_rows(const int kind, const int rows, const float *x,
                                                           int64_t K, const uint8_t *q, int64_t block_bytes,
                                                           const float *d, float out[4]) {
    __m256 acc[4];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t blk = 0; blk < K / 32; blk++) {
        __m256 w[4];
        quants(kind, q + blk * block_bytes, w);
        const __m256 vd = _mm256_set1_ps(d[blk]);
        const float *xb = x + blk * 32;
        for (int r = 0; r < rows; r++) {
            const float *xr = xb + r * K;
            __m256 a = _mm256_mul_ps(_mm256_loadu_ps(xr), w[0]);
            __m256 b = _mm256_mul_ps(_mm256_loadu_ps(xr + 8), w[1]);
            a = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), w[2], a);
            b = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), w[3], b);
            acc[r] = _mm256_fmadd_ps(_mm256_add_ps(a, b), vd, acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) out[r] = hsum(acc[r]);
}

static inline __attribute__((always_inline)) void gemm_kind(const int kind, const float *x, int64_t M, int64_t K,
                                                            const uint8_t *qs, const float *d, const float *m,
                                                            int64_t N, const float *bias, float *y, int threads,
                                                            const float *xsum) {
    const int64_t block_bytes = kind == KIND_Q8_0 ? 32 : 16;
    const int64_t row_bytes = K / 32 * block_bytes;
    const int64_t nb = K / 32;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *q = qs + n * row_bytes;
        const float *dn = d + n * nb;
        const float add = bias ? bias[n] : 0.0f;
        for (int64_t r0 = 0; r0 < M; r0 += 4) {
            float out[4];
            const int64_t rows = M - r0 < 4 ? M - r0 : 4;
            const float *xr = x + r0 * K;
            switch (rows) {
                case 1: dot_rows(kind, 1, xr, K, q, block_bytes, dn, out); break;
                case 2: dot_rows(kind, 2, xr, K, q, block_bytes, dn, out); break;
                case 3: dot_rows(kind, 3, xr, K, q, block_bytes, dn, out); break;
                default: dot_rows(kind, 4, xr, K, q, block_bytes, dn, out); break;
            }
            for (int64_t r = 0; r < rows; r++) {
                float mins = 0.0f;
                if (kind == KIND_Q4_1) {
                    const float *mn = m + n * nb, *xs = xsum + (r0 + r) * nb;
                    for (int64_t b = 0; b < nb; b++) mins += mn[b] * xs[b];
                } else if (kind == KIND_Q4_0) {  /* d * (q - 8): a minimum of -8 d */
                    const float *xs = xsum + (r0 + r) * nb;
                    for (int64_t b = 0; b < nb; b++) mins -= 8.0f * dn[b] * xs[b];
                }
                y[(r0 + r) * N + n] = out[r] + mins + add;
            }
        }
    }
}

/* xsum: scratch of M * K / 32 floats. Returns 0, or -1 for an unknown kind, a K that is
 * not a whole number of blocks, or a missing pointer. */
int prelude_blocks_gemm(int kind, const float *x, int64_t M, int64_t K, const uint8_t *qs, const float *d,
                        const float *m, int64_t N, const float *bias, float *y, int threads, float *xsum) {
    if (K % 32 != 0 || threads < 1 || kind < KIND_Q4_0 || kind > KIND_Q8_0 || (kind == KIND_Q4_1 && !m) ||
        !xsum)
        return -1;
    const int64_t nb = K / 32;
    for (int64_t i = 0; i < M * nb; i++) {  /* each block's sum of x, for the minimums */
        float s = 0.0f;
        for (int j = 0; j < 32; j++) s += x[i * 32 + j];
        xsum[i] = s;
    }
    switch (kind) {
        case KIND_Q4_0: gemm_kind(KIND_Q4_0, x, M, K, qs, d, 0, N, bias, y, threads, xsum); break;
        case KIND_Q4_1: gemm_kind(KIND_Q4_1, x, M, K, qs, d, m, N, bias, y, threads, xsum); break;
        default: gemm_kind(KIND_Q8_0, x, M, K, qs, d, 0, N, bias, y, threads, xsum); break;
    }
    return 0;
}

/* --- bfloat16 activations (AVX512-BF16) -------------------------------------------------
 * The same GEMM for bf16 x and y: a block's 32 quants are small integers, exact in bf16,
 * so one vdpbf16ps multiplies 32 quants by 32 activations exactly and sums them in pairs
 * in float32; d scales the block's 16 partial sums into a float32 accumulator. The 4-bit
 * quants become bf16 through a 16-entry table lookup (vpermw). y is rounded to bf16 once,
 * from the float32 sum. Built only where the compiler targets AVX512-BF16 (-march=native
 * on such a CPU); prelude_blocks_gemm_bf16_available() says whether this library has it. */
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <string.h>

int prelude_blocks_gemm_bf16_available(void) { return 1; }

static inline float bf16f(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t to_bf16(float f) {  /* round to nearest even, as torch */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* bf16 of 0..15 in the first 16 words (the rest unused). */
static const uint16_t NIBBLE_BF16[32] = {0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0,
                                         0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};

static inline __attribute__((always_inline)) __m512bh quants_bf16(const int kind, const uint8_t *q, __m512i table) {
    if (kind == KIND_Q8_0) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)q);
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(raw)));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(raw, 1)));
        return _mm512_cvtne2ps_pbh(hi, lo);  /* elements 0-15 from lo, 16-31 from hi */
    }
    const __m128i raw = _mm_loadu_si128((const __m128i *)q);
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(raw, low4);                      /* elements 0-15 */
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);   /* elements 16-31 */
    const __m512i idx = _mm512_cvtepu8_epi16(_mm256_set_m128i(hi, lo));
    return (__m512bh)_mm512_permutexvar_epi16(idx, table);
}

/* Two accumulators per row (even and odd blocks): one row's chain of dependent FMAs
 * would otherwise bound the loop by the FMA latency, not its throughput. */
static inline __attribute__((always_inline)) void dot_rows_bf16(const int kind, const int rows, const uint16_t *x,
                                                                int64_t K, const uint8_t *q, int64_t block_bytes,
                                                                const float *d, __m512i table, float out[4]) {
    __m512 acc[4], acc2[4];
    for (int r = 0; r < rows; r++) acc[r] = acc2[r] = _mm512_setzero_ps();
    const int64_t nb = K / 32;
    int64_t blk = 0;
    for (; blk + 2 <= nb; blk += 2) {
        const __m512bh w0 = quants_bf16(kind, q + blk * block_bytes, table);
        const __m512bh w1 = quants_bf16(kind, q + (blk + 1) * block_bytes, table);
        const __m512 d0 = _mm512_set1_ps(d[blk]), d1 = _mm512_set1_ps(d[blk + 1]);
        for (int r = 0; r < rows; r++) {
            const uint16_t *xr = x + r * K + blk * 32;
            const __m512bh x0 = (__m512bh)_mm512_loadu_si512((const void *)xr);
            const __m512bh x1 = (__m512bh)_mm512_loadu_si512((const void *)(xr + 32));
            acc[r] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), x0, w0), d0, acc[r]);
            acc2[r] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), x1, w1), d1, acc2[r]);
        }
    }
    if (blk < nb) {
        const __m512bh w = quants_bf16(kind, q + blk * block_bytes, table);
        const __m512 vd = _mm512_set1_ps(d[blk]);
        for (int r = 0; r < rows; r++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + r * K + blk * 32));
            acc[r] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), xv, w), vd, acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r], acc2[r]));
}

/* sum_b a[b] * c[b] over a row's blocks, 16 at a time (the minimums' term; a scalar loop
 * here was a chain of dependent adds as long as the row's block count). */
static inline float dot_blocks(const float *a, const float *c, int64_t nb) {
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= nb; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(c + i), acc);
    if (i < nb) {
        const __mmask16 k = (__mmask16)((1u << (nb - i)) - 1);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, a + i), _mm512_maskz_loadu_ps(k, c + i), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

static inline __attribute__((always_inline)) void gemm_kind_bf16(const int kind, const uint16_t *x, int64_t M,
                                                                 int64_t K, const uint8_t *qs, const float *d,
                                                                 const float *m, int64_t N, const uint16_t *bias,
                                                                 uint16_t *y, int threads, const float *xsum) {
    const int64_t block_bytes = kind == KIND_Q8_0 ? 32 : 16;
    const int64_t row_bytes = K / 32 * block_bytes;
    const int64_t nb = K / 32;
    const __m512i table = _mm512_loadu_si512((const void *)NIBBLE_BF16);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *q = qs + n * row_bytes;
        const float *dn = d + n * nb;
        const float add = bias ? bf16f(bias[n]) : 0.0f;
        for (int64_t r0 = 0; r0 < M; r0 += 4) {
            float out[4];
            const int64_t rows = M - r0 < 4 ? M - r0 : 4;
            const uint16_t *xr = x + r0 * K;
            switch (rows) {
                case 1: dot_rows_bf16(kind, 1, xr, K, q, block_bytes, dn, table, out); break;
                case 2: dot_rows_bf16(kind, 2, xr, K, q, block_bytes, dn, table, out); break;
                case 3: dot_rows_bf16(kind, 3, xr, K, q, block_bytes, dn, table, out); break;
                default: dot_rows_bf16(kind, 4, xr, K, q, block_bytes, dn, table, out); break;
            }
            for (int64_t r = 0; r < rows; r++) {
                float mins = 0.0f;
                if (kind == KIND_Q4_1) mins = dot_blocks(m + n * nb, xsum + (r0 + r) * nb, nb);
                else if (kind == KIND_Q4_0) mins = -8.0f * dot_blocks(dn, xsum + (r0 + r) * nb, nb);
                y[(r0 + r) * N + n] = to_bf16(out[r] + mins + add);
            }
        }
    }
}

/* x, bias, y in bf16; otherwise as prelude_blocks_gemm. */
int prelude_blocks_gemm_bf16(int kind, const uint16_t *x, int64_t M, int64_t K, const uint8_t *qs, const float *d,
                             const float *m, int64_t N, const uint16_t *bias, uint16_t *y, int threads,
                             float *xsum) {
    if (K % 32 != 0 || threads < 1 || kind < KIND_Q4_0 || kind > KIND_Q8_0 || (kind == KIND_Q4_1 && !m) ||
        !xsum)
        return -1;
    const int64_t nb = K / 32;
    for (int64_t i = 0; i < M * nb; i++) {
        float s = 0.0f;
        for (int j = 0; j < 32; j++) s += bf16f(x[i * 32 + j]);
        xsum[i] = s;
    }
    switch (kind) {
        case KIND_Q4_0: gemm_kind_bf16(KIND_Q4_0, x, M, K, qs, d, 0, N, bias, y, threads, xsum); break;
        case KIND_Q4_1: gemm_kind_bf16(KIND_Q4_1, x, M, K, qs, d, m, N, bias, y, threads, xsum); break;
        default: gemm_kind_bf16(KIND_Q8_0, x, M, K, qs, d, 0, N, bias, y, threads, xsum); break;
    }
    return 0;
}
#else
int prelude_blocks_gemm_bf16_available(void) { return 0; }
#endif
