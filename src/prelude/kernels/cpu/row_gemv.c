/* One float32 row through a wide float32 weight: y = W x (+ b), W [out, k] row-major.
 *
 * The call an LM head makes for one sampled row (c=1, or one decode row): a 49,152 x 128
 * head is 25 MB read once for 49,152 dot products of 128, bound by memory bandwidth.
 * This loop streams the weight faster than oneDNN's packed one-row kernel, from cache and
 * from memory (docs/benchmarks.md): x held in registers,
 * each weight row summed with two accumulators, the rows ahead prefetched non-temporally
 * (read once: no point keeping them in the caches the rest of the request runs from).
 * Sums run in a fixed order (k in 16-lane vectors, even and odd vectors apart, then the
 * lanes), whatever the thread count, so a row's answer does not depend on the split.
 *
 * AVX-512 only (prelude_row_gemv_available() says whether this build has it); k must be a
 * multiple of 16. Returns 0, or 1 on arguments it does not take (nothing written).
 */
#include "prelude_kernels.h"
#include <stdint.h>
#include <stddef.h>

#include "native_shared.h"

#if defined(__AVX512F__)
#include <immintrin.h>

#define AHEAD 24 /* weight rows prefetched ahead of the four being summed */

static inline float row_dot(const float *x, const float *w, int64_t k) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= k; i += 32) {
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(w + i), a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(w + i + 16), a1);
    }
    if (i < k) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(w + i), a0);
    return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

static inline __attribute__((always_inline)) void rows_fixed(const float *x, const float *w, int64_t o0, int64_t o1,
                                                             int64_t out, const float *bias, float *y, int nv) {
    /* x held in registers (nv 16-lane vectors, a compile-time count where inlined): the
     * weight is the only stream. Same sum order as row_dot. */
    const int64_t k = 16 * (int64_t)nv;
    const size_t block_bytes = 4 * (size_t)k * sizeof(float);
    __m512 xv[16];
    for (int i = 0; i < nv; i++) xv[i] = _mm512_loadu_ps(x + 16 * i);
    for (int64_t o = o0; o < o1; o += 4) {
        if (o + AHEAD + 4 <= out) { /* read once: fetched past the caches the request runs from */
            const char *p = (const char *)(w + (o + AHEAD) * k);
            for (size_t off = 0; off < block_bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_NTA);
        }
        for (int r = 0; r < 4 && o + r < o1; r++) {
            const float *wr = w + (o + r) * k;
            __m512 a0 = _mm512_mul_ps(xv[0], _mm512_loadu_ps(wr));
            __m512 a1 = nv > 1 ? _mm512_mul_ps(xv[1], _mm512_loadu_ps(wr + 16)) : _mm512_setzero_ps();
            for (int i = 2; i + 1 < nv; i += 2) {
                a0 = _mm512_fmadd_ps(xv[i], _mm512_loadu_ps(wr + 16 * i), a0);
                a1 = _mm512_fmadd_ps(xv[i + 1], _mm512_loadu_ps(wr + 16 * i + 16), a1);
            }
            if (nv > 2 && nv % 2) a0 = _mm512_fmadd_ps(xv[nv - 1], _mm512_loadu_ps(wr + 16 * (nv - 1)), a0);
            const float v = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
            y[o + r] = bias ? v + bias[o + r] : v;
        }
    }
}

static void rows_span(const float *x, const float *w, int64_t o0, int64_t o1, int64_t out, int64_t k,
                      const float *bias, float *y) {
    switch (k) { /* x in registers: the widths Projection sends one row of (row_gemv.py) */
    case 64: rows_fixed(x, w, o0, o1, out, bias, y, 4); return;
    case 128: rows_fixed(x, w, o0, o1, out, bias, y, 8); return;
    case 256: rows_fixed(x, w, o0, o1, out, bias, y, 16); return;
    default: break;
    }
    for (int64_t o = o0; o < o1; o += 4) {
        if (o + AHEAD + 4 <= out) {
            const char *p = (const char *)(w + (o + AHEAD) * k);
            for (size_t off = 0; off < 4 * (size_t)k * sizeof(float); off += 64) _mm_prefetch(p + off, _MM_HINT_NTA);
        }
        const int64_t end = o + 4 < o1 ? o + 4 : o1;
        for (int64_t r = o; r < end; r++) {
            const float v = row_dot(x, w + r * k, k);
            y[r] = bias ? v + bias[r] : v;
        }
    }
}

/* A few rows (2..16) through the same weight in a blocked copy: wb [ceil(out/16)][k][16]
 * (16 outputs a vector, zero past out). Per k, one 64-byte weight vector and each row's
 * x[k] broadcast: R fused multiply-adds a vector, so 16 rows read the weight once at
 * memory speed, where one row per pass would read it 16 times. Each output sums k in
 * order. */
#define BLOCK_AHEAD 4 /* blocks prefetched ahead */

static inline __attribute__((always_inline)) void blocks_rows(const float *x, const float *wb, int64_t b0, int64_t b1,
                                                              int64_t nb, int64_t out, int64_t k, const float *bias,
                                                              float *y, int rows) {
    for (int64_t b = b0; b < b1; b++) {
        const float *blk = wb + b * k * 16;
        const char *ahead = b + BLOCK_AHEAD < nb ? (const char *)(wb + (b + BLOCK_AHEAD) * k * 16) : NULL;
        __m512 acc[16];
        for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t i = 0; i < k; i++) {
            if (ahead) _mm_prefetch(ahead + 64 * i, _MM_HINT_NTA);
            const __m512 wv = _mm512_loadu_ps(blk + 16 * i);
            for (int r = 0; r < rows; r++) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * k + i]), wv, acc[r]);
        }
        const int64_t o = 16 * b, n = out - o < 16 ? out - o : 16;
        const __mmask16 m = (__mmask16)((1u << n) - 1u);
        const __m512 bv = bias ? _mm512_maskz_loadu_ps(m, bias + o) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) _mm512_mask_storeu_ps(y + r * out + o, m, _mm512_add_ps(acc[r], bv));
    }
}

static void blocks_span(const float *x, int64_t rows, const float *wb, int64_t b0, int64_t b1, int64_t nb,
                        int64_t out, int64_t k, const float *bias, float *y) {
    switch (rows) { /* a compile-time row count: the accumulators stay in registers */
#define ROWS_CASE(n) case n: blocks_rows(x, wb, b0, b1, nb, out, k, bias, y, n); return;
    ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7) ROWS_CASE(8) ROWS_CASE(9)
    ROWS_CASE(10) ROWS_CASE(11) ROWS_CASE(12) ROWS_CASE(13) ROWS_CASE(14) ROWS_CASE(15)
#undef ROWS_CASE
    default: blocks_rows(x, wb, b0, b1, nb, out, k, bias, y, 16); return;
    }
}
#endif

int prelude_row_gemv_available(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

int prelude_row_gemv_f32(const float *x, const float *w, int64_t out, int64_t k, const float *bias, float *y,
                         int threads) {
#if defined(__AVX512F__)
    if (out <= 0 || k <= 0 || k % 16) return 1;
    if (threads <= 1 || out < 4096) {
        rows_span(x, w, 0, out, out, k, bias, y);
        return 0;
    }
    /* Split in 4-row-aligned spans, one per thread: each span's rows sum as above. */
#pragma omp parallel num_threads(threads)
    {
        int64_t b0, b1;
        this_threads_share((out + 3) / 4, &b0, &b1);
        const int64_t o0 = 4 * b0, o1 = 4 * b1 < out ? 4 * b1 : out;
        if (o0 < o1) rows_span(x, w, o0, o1, out, k, bias, y);
    }
    return 0;
#else
    (void)x; (void)w; (void)out; (void)k; (void)bias; (void)y; (void)threads;
    return 1;
#endif
}

/* y [rows, out] = x [rows, k] W^T (+ b) for 2 <= rows <= 16, W in the blocked copy
 * RowGemv.block (row_gemv.py) makes. Returns 0, or 1 on arguments it does not take. */
int prelude_rows_gemm_blocked_f32(const float *x, int64_t rows, const float *wb, int64_t out, int64_t k,
                                  const float *bias, float *y, int threads) {
#if defined(__AVX512F__)
    if (rows < 2 || rows > 16 || out <= 0 || k <= 0) return 1;
    const int64_t nb = (out + 15) / 16;
    if (threads <= 1 || nb < 256) {
        blocks_span(x, rows, wb, 0, nb, nb, out, k, bias, y);
        return 0;
    }
#pragma omp parallel num_threads(threads)
    {
        int64_t b0, b1;
        this_threads_share(nb, &b0, &b1);
        if (b0 < b1) blocks_span(x, rows, wb, b0, b1, nb, out, k, bias, y);
    }
    return 0;
#else
    (void)x; (void)rows; (void)wb; (void)out; (void)k; (void)bias; (void)y; (void)threads;
    return 1;
#endif
}
