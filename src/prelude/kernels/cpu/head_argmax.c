/* The greedy token of a few rows through a wide float32 LM head, without their float32
 * logits: a bfloat16 pass bounds every logit, and only the tokens that can still be the
 * best are computed in float32, summed exactly as row_gemv.c's blocked kernel sums them
 * (k in order, one fused multiply-add each, then + 0; one row as its one-row kernel does),
 * so the token is the one the float32 logits' argmax gives, ties to the lowest id.
 *
 * The bound: a bfloat16 rounding is off by at most 2^-9 of its value, so a product of two
 * by at most ~2^-8 of |x_i w_ji|; the bfloat16 sum's and the float32 sum's roundings add
 * ~3k 2^-24 of sum |x_i w_ji|. With sum |x_i w_ji| <= |x| |w_j| (Cauchy-Schwarz):
 *   |approx_j - logit_j| <= B_j = (2^-7 + 2^-10) |x| |w_j| + 2^-100   (k <= 1024)
 * Token j can be the argmax only if approx_j + B_j >= max_i (approx_i - B_i).
 * The pass keeps, per row, only the tokens whose approx_j + B_j reaches the running max
 * of approx - B on their lane so far (never above the final one, so no token that can win
 * is dropped): a handful a lane, where writing and reading back every approximate logit
 * (rows x out floats, 3 MiB for 16 rows of a 49,152-token head) was a third of its bytes.
 * AVX512_BF16's dot product (16 lanes x 2 products an instruction) is twice the float32
 * FMA's multiply-adds, and the bfloat16 copy half the bytes. */
#include "prelude_kernels.h"
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#endif

int prelude_head_argmax_available(void) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define MAX_ROWS 16
#define BOUND_SCALE (0.0078125f + 0.0009765625f) /* 2^-7 + 2^-10 */
#define BOUND_FLOOR 7.8886091e-31f               /* 2^-100 */

/* Where a span's candidates go: per row r, up to 16 x its blocks (upper bound, id) pairs at
 * upper[r * stride + at] and id[r * stride + at], `count[r]` of them so far. */
typedef struct {
    float *upper;
    int32_t *id;
    int64_t stride, at;
    int64_t count[MAX_ROWS];
} Candidates;

/* Pass 1 over blocks [b0, b1) of `blocks` adjacent 16-token blocks at a time (rows 1..MAX_ROWS
 * at compile time): per row the lanes' max of approx - bound over the tokens below `limit`,
 * and the tokens whose approx + bound reaches it (`cand`, in ascending ids). Few rows of a
 * narrow head take two blocks a pass (approx_rows). The candidates are compressed in
 * registers and stored whole (16 lanes, past the count, which the next store overwrites;
 * within the span's part of the row, which holds 16 a block): a compressing store to memory
 * is microcoded on some AMD cores. */
static inline __attribute__((always_inline)) void approx_blocks(const uint32_t *xb, const uint16_t *wb,
                                                                const float *wnorm, const float *scale, int64_t b0,
                                                                int64_t b1, int64_t half_k, int64_t limit,
                                                                Candidates *cand, __m512 *low, int rows, int blocks) {
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int64_t b = b0; b < b1; b += blocks) {
        __m512 acc[2][MAX_ROWS];
        for (int t = 0; t < blocks; t++)
            for (int r = 0; r < rows; r++) acc[t][r] = _mm512_setzero_ps();
        const uint16_t *blk = wb + b * half_k * 32;
        for (int64_t p = 0; p < half_k; p++) {
            __m512bh wv[2];
            for (int t = 0; t < blocks; t++)
                wv[t] = (__m512bh)_mm512_loadu_si512((const void *)(blk + t * half_k * 32 + 32 * p));
            for (int r = 0; r < rows; r++) {
                const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xb[r * half_k + p]);
                for (int t = 0; t < blocks; t++) acc[t][r] = _mm512_dpbf16_ps(acc[t][r], xv, wv[t]);
            }
        }
        for (int t = 0; t < blocks; t++) {
            const int64_t o = 16 * (b + t);
            const __mmask16 valid = o + 16 <= limit ? (__mmask16)0xFFFF
                                  : o >= limit ? (__mmask16)0 : (__mmask16)((1u << (limit - o)) - 1u);
            const __m512 wn = _mm512_loadu_ps(wnorm + o);
            for (int r = 0; r < rows; r++) {
                const __m512 bound = _mm512_fmadd_ps(_mm512_set1_ps(scale[r]), wn, _mm512_set1_ps(BOUND_FLOOR));
                low[r] = _mm512_mask_max_ps(low[r], valid, low[r], _mm512_sub_ps(acc[t][r], bound));
                const __m512 upper = _mm512_add_ps(acc[t][r], bound);
                const __mmask16 keep = _mm512_mask_cmp_ps_mask(valid, upper, low[r], _CMP_GE_OQ);
                if (keep) {
                    const int64_t at = r * cand->stride + cand->at + cand->count[r];
                    _mm512_storeu_ps(cand->upper + at, _mm512_maskz_compress_ps(keep, upper));
                    const __m512i ids = _mm512_add_epi32(lanes, _mm512_set1_epi32((int)o));
                    _mm512_storeu_si512((void *)(cand->id + at), _mm512_maskz_compress_epi32(keep, ids));
                    cand->count[r] += __builtin_popcount(keep);
                }
            }
        }
    }
}

static inline __attribute__((always_inline)) void approx_rows(const uint32_t *xb, const uint16_t *wb,
                                                              const float *wnorm, const float *scale, int64_t b0,
                                                              int64_t b1, int64_t half_k, int64_t limit,
                                                              Candidates *cand, __m512 *low, int rows) {
    for (int r = 0; r < rows; r++) {
        low[r] = _mm512_set1_ps(-INFINITY);
        cand->count[r] = 0;
    }
    /* Two blocks a pass paid only over narrow heads: one 16-token block's bfloat16 weights are
     * half_k x 64 bytes, and from 128 inputs (4 KiB) on the paired form ran slower than one
     * block a pass at every row count; at k = 64 it stays ahead. */
    const int64_t paired = rows <= 8 && half_k <= 32 ? b0 + ((b1 - b0) & ~(int64_t)1) : b0;
    if (paired > b0) approx_blocks(xb, wb, wnorm, scale, b0, paired, half_k, limit, cand, low, rows, 2);
    approx_blocks(xb, wb, wnorm, scale, paired, b1, half_k, limit, cand, low, rows, 1);
}

/* Pass 1 over blocks [b0, b1): each row's lanes' max of approx - bound, and its candidates. */
static void approx_span(int rows, const uint32_t *xb, const uint16_t *wb, const float *wnorm, const float *scale,
                        int64_t b0, int64_t b1, int64_t half_k, int64_t limit, Candidates *cand, __m512 *low) {
    switch (rows) { /* a compile-time row count: the accumulators stay in registers */
#define ROWS_CASE(n) case n: approx_rows(xb, wb, wnorm, scale, b0, b1, half_k, limit, cand, low, n); return;
    ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7) ROWS_CASE(8)
    ROWS_CASE(9) ROWS_CASE(10) ROWS_CASE(11) ROWS_CASE(12) ROWS_CASE(13) ROWS_CASE(14) ROWS_CASE(15)
#undef ROWS_CASE
    default: approx_rows(xb, wb, wnorm, scale, b0, b1, half_k, limit, cand, low, 16); return;
    }
}

/* Pass 1 over all nb blocks, one contiguous span a thread (every span starts on an even
 * block, so the paired form pairs the blocks one span would): a token's approx is its own
 * sums and the lows' max does not depend on the order, so neither do the ids. A thread
 * takes at least SPAN_MIN_BLOCKS: below that the hand-off costs more than it saves. Span t's
 * candidates start at its first token's place of each row (spans[t].at), so the spans'
 * lists, in span order, are each row's candidates in ascending ids. Returns the span count. */
#define SPAN_MIN_BLOCKS 256
#define MAX_THREADS 64
static int64_t approx_all(int rows, const uint32_t *xb, const uint16_t *wb, const float *wnorm, const float *scale,
                          int64_t nb, int64_t half_k, int64_t limit, float *upper, int32_t *id, Candidates *spans,
                          __m512 *low, int threads) {
    int64_t nt = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    if (nt > nb / SPAN_MIN_BLOCKS) nt = nb / SPAN_MIN_BLOCKS > 1 ? nb / SPAN_MIN_BLOCKS : 1;
    if (nt == 1) {
        spans[0] = (Candidates){upper, id, nb * 16, 0, {0}};
        approx_span(rows, xb, wb, wnorm, scale, 0, nb, half_k, limit, &spans[0], low);
        return 1;
    }
    __m512 lows[MAX_THREADS][MAX_ROWS];
#pragma omp parallel for num_threads((int)nt) schedule(static)
    for (int64_t t = 0; t < nt; t++) {
        const int64_t b0 = (nb * t / nt) & ~(int64_t)1, b1 = t + 1 == nt ? nb : (nb * (t + 1) / nt) & ~(int64_t)1;
        spans[t] = (Candidates){upper, id, nb * 16, b0 * 16, {0}};
        approx_span(rows, xb, wb, wnorm, scale, b0, b1, half_k, limit, &spans[t], lows[t]);
    }
    for (int r = 0; r < rows; r++) {
        low[r] = lows[0][r];
        for (int64_t t = 1; t < nt; t++) low[r] = _mm512_max_ps(low[r], lows[t][r]);
    }
    return nt;
}

/* Token j's float32 logit as row_gemv.c's blocked kernel (2-16 rows) computes it. */
static float exact_logit(const float *x, const float *wj, int64_t k) {
    float acc = 0.0f;
    for (int64_t i = 0; i < k; i++) acc = fmaf(x[i], wj[i], acc);
    return acc + 0.0f;
}

/* ... and as its one-row kernel (rows_fixed, k = 16 nv) does: even and odd 16-lane vectors
 * in two sums, the first of each a product, then the lanes. */
static float one_row_logit(const float *x, const float *wj, int64_t nv) {
    __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(x), _mm512_loadu_ps(wj));
    __m512 a1 = nv > 1 ? _mm512_mul_ps(_mm512_loadu_ps(x + 16), _mm512_loadu_ps(wj + 16)) : _mm512_setzero_ps();
    for (int64_t i = 2; i + 1 < nv; i += 2) {
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + 16 * i), _mm512_loadu_ps(wj + 16 * i), a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + 16 * i + 16), _mm512_loadu_ps(wj + 16 * i + 16), a1);
    }
    if (nv > 2 && nv % 2) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + 16 * (nv - 1)), _mm512_loadu_ps(wj + 16 * (nv - 1)), a0);
    return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}
#endif

/* ids [rows] = argmax over j < limit of x [rows, k] . w [out, k]^T, for 1 <= rows <= 16
 * (one row: its logits summed as row_gemv.c's one-row kernel sums them, k <= 256).
 * wb: the bfloat16 copy, [ceil(out/16)][k/2][16][2] (token 16b + l's weights 2p, 2p+1 at
 * [b][p][l]), zero past out; wnorm [ceil(out/16)*16]: |w_j| rounded up (0 past out);
 * scratch: 2 * rows * ceil(out/16)*16 floats (the candidates' upper bounds, then their ids;
 * a few of them written per call); threads: the bfloat16 pass's (approx_all;
 * the few exact logits after it stay on one). Returns 0, 1 on arguments it does not take, 2
 * when an input or a logit is not finite (the caller computes the logits). */
int prelude_head_argmax_f32(const float *x, int64_t rows, const uint16_t *wb, const float *w, const float *wnorm,
                            int64_t out, int64_t k, int64_t limit, float *scratch, int64_t *ids, int threads) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    if (rows < 1 || rows > MAX_ROWS || out <= 0 || k <= 0 || k % 32 || k > 1024 || limit <= 0 || limit > out
        || (rows == 1 && k > 256))
        return 1;
    const int64_t nb = (out + 15) / 16, half_k = k / 2, width = nb * 16;
    float *upper = scratch;
    int32_t *cand_id = (int32_t *)(scratch + rows * width);
    uint32_t xb[MAX_ROWS * 512];
    float scale[MAX_ROWS];
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * k;
        double sq = 0.0;
        for (int64_t i = 0; i < k; i++) {
            if (!isfinite(xr[i])) return 2;
            sq += (double)xr[i] * (double)xr[i];
        }
        const double norm = sqrt(sq);
        if (!(norm < 1e30)) return 2;
        scale[r] = (float)(norm * (double)BOUND_SCALE * (1.0 + 0x1p-20));
        for (int64_t i = 0; i < k; i += 32) { /* round to nearest even, as the weights were */
            const __m512bh pairs = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(xr + i + 16), _mm512_loadu_ps(xr + i));
            _mm512_storeu_si512((void *)(xb + r * half_k + i / 2), (__m512i)pairs);
        }
    }
    __m512 low[MAX_ROWS];
    Candidates spans[MAX_THREADS];
    const int64_t nt = approx_all((int)rows, xb, wb, wnorm, scale, nb, half_k, limit, upper, cand_id, spans, low,
                                  threads);
    for (int64_t r = 0; r < rows; r++) {
        const float floor_r = _mm512_reduce_max_ps(low[r]);
        const float *xr = x + r * k;
        int64_t best = -1;
        float best_logit = 0.0f;
        for (int64_t t = 0; t < nt; t++) { /* ascending ids: a tie keeps the lower one, as argmax does */
            const int64_t at = r * width + spans[t].at;
            for (int64_t c = 0; c < spans[t].count[r]; c++) {
                if (!(upper[at + c] >= floor_r)) continue;
                const int64_t j = cand_id[at + c];
                const float v = rows == 1 ? one_row_logit(xr, w + j * k, k / 16) : exact_logit(xr, w + j * k, k);
                if (!isfinite(v)) return 2;
                if (best < 0 || v > best_logit) {
                    best = j;
                    best_logit = v;
                }
            }
        }
        if (best < 0) return 2; /* only where a bound was not finite */
        ids[r] = best;
    }
    return 0;
#else
    (void)x; (void)rows; (void)wb; (void)w; (void)wnorm; (void)out; (void)k; (void)limit; (void)scratch; (void)ids; (void)threads;
    return 1;
#endif
}
