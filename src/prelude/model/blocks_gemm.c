/* y[M, N] = x[M, K] . W[N, K]^T (+ bias) with W kept in GGUF's 32-weight blocks
 * (Q4_0, Q4_1, Q8_0), for the few-row calls of decode (AVX2 + FMA, OpenMP over N).
 *
 * Decode on a CPU reads every weight once per step: float32 weights make it memory-bound
 * (SmolLM2-135M: 540 MB per step). The blocks are 5-8x smaller. A block's contribution is
 * d * (x . q) + m * sum(x) (gguf's dequantization, d * q + m, distributed), so the
 * result equals x . W^T over the float32 weights the prefill GEMMs use up to float32
 * rounding of the sums (the order differs, as it does between any two GEMM libraries).
 *
 * Layout (see ggml_blocks.py): qs [N, K/2] (4-bit: in each 16-byte block, byte j holds
 * element j in its low nibble and element j + 16 in its high nibble) or [N, K] (int8);
 * d, m [N, K/32] float32 (m only for Q4_1). Built with -mavx2 -mfma -ffp-contract=off.
 */
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
