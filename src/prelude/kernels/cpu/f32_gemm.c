/* Many float32 rows through a packed float32 weight with AVX2 and FMA: y = x W^T (+ b),
 * x [m, k] (row stride ldx), y [m, n] (row stride ldy); W comes packed
 * (prelude_f32_gemm_pack) 8 outputs a block: wp[block][k][8], so a k step of a block is one
 * 32-byte vector.
 *
 * For CPUs without AVX-512 (an AVX2-only CPU's dtype is float32): there oneDNN's float32
 * kernels leave part of the FMA peak unused on a small model's projections. A register
 * block here is F32_ROWS rows of x (each k step one broadcast from the row) by F32_BLOCKS
 * blocks of 8 outputs: 12 accumulators, 3
 * weight vectors and a broadcast fill AVX2's 16 registers; each (rows, blocks) pair is a
 * kernel copy of its own, so the counts are constants and nothing spills. Each group of
 * blocks prefetches the next group's weight into L2 over its row blocks. Threads split the
 * groups of outputs, so a row's sums run in one order (k in order) whatever the thread
 * count and the call's other rows.
 *
 * prelude_f32_gemm_ready() is 1 where the build has AVX2 and FMA. Returns 0, or 1 on
 * arguments it does not take (nothing written).
 */
#include "prelude_kernels.h"
#include <stdint.h>
#include "native_shared.h"
#if defined(__AVX2__) && defined(__FMA__)
#define HAVE_F32 1
#include <immintrin.h>
#else
#define HAVE_F32 0
#endif
#define F32_ROWS 4   /* rows a register block */
#define F32_BLOCKS 3 /* blocks of 8 outputs a register block (a group) */
/* m * n * k below this runs on the calling thread */
#define F32_PAR_MIN_WORK (1 << 16)
/* row blocks a call needs before a group prefetches the next one's weight (fewer rows
 * stream the weight at memory speed anyway) */
#define F32_PREFETCH_MIN_BLOCKS 8

int prelude_f32_gemm_ready(void) { return HAVE_F32; }

#if HAVE_F32
/* ROWS rows of x by NB blocks of 8 outputs from wp (block stride k * 8 floats), every k in
 * order, into y at outputs n0.. (+ bias after the sums). Twelve named accumulators, the
 * unused ones dead code for the constant ROWS and NB: as an array [ROWS][NB], GCC stored
 * each accumulator to the stack on every k step. */
#define F32_FMA(r, b) if ((r) < rows_n && (b) < blocks_n) a##r##b = _mm256_fmadd_ps(x##r, w##b, a##r##b)
#define F32_ROW(r)                                                                                        \
    if ((r) < rows_n) {                                                                                   \
        const __m256 x##r = _mm256_broadcast_ss(x + (r) * ldx + p);                                       \
        F32_FMA(r, 0); F32_FMA(r, 1); F32_FMA(r, 2);                                                      \
    }
#define F32_OUT(r, b)                                                                                     \
    if ((r) < rows_n && (b) < blocks_n)                                                                   \
        _mm256_storeu_ps(y + (r) * ldy + n0 + 8 * (b),                                                    \
                         bias ? _mm256_add_ps(a##r##b, _mm256_loadu_ps(bias + n0 + 8 * (b))) : a##r##b)
#define F32_KERNEL(ROWS, NB)                                                                              \
    static void f32_rows_##ROWS##_##NB(const float *x, int64_t ldx, const float *wp, int64_t k,          \
                                       const float *bias, float *y, int64_t ldy, int64_t n0) {          \
        enum { rows_n = ROWS, blocks_n = NB }; /* the helper macros' constants */                         \
        __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a10 = a00, a11 = a00, a12 = a00;          \
        __m256 a20 = a00, a21 = a00, a22 = a00, a30 = a00, a31 = a00, a32 = a00;                          \
        for (int64_t p = 0; p < k; p++) {                                                                 \
            const __m256 w0 = _mm256_load_ps(wp + p * 8);                                                 \
            const __m256 w1 = NB > 1 ? _mm256_load_ps(wp + (k + p) * 8) : a00;                            \
            const __m256 w2 = NB > 2 ? _mm256_load_ps(wp + (2 * k + p) * 8) : a00;                        \
            F32_ROW(0) F32_ROW(1) F32_ROW(2) F32_ROW(3)                                                   \
        }                                                                                                 \
        F32_OUT(0, 0); F32_OUT(0, 1); F32_OUT(0, 2); F32_OUT(1, 0); F32_OUT(1, 1); F32_OUT(1, 2);         \
        F32_OUT(2, 0); F32_OUT(2, 1); F32_OUT(2, 2); F32_OUT(3, 0); F32_OUT(3, 1); F32_OUT(3, 2);         \
    }
#define F32_KERNELS(NB) F32_KERNEL(1, NB) F32_KERNEL(2, NB) F32_KERNEL(3, NB) F32_KERNEL(4, NB)
F32_KERNELS(1)
F32_KERNELS(2)
F32_KERNELS(3)
typedef void (*f32_rows_fn)(const float *, int64_t, const float *, int64_t, const float *, float *, int64_t, int64_t);
/* [blocks - 1][rows - 1] */
static const f32_rows_fn F32_ROWS_FNS[F32_BLOCKS][F32_ROWS] = {
    {f32_rows_1_1, f32_rows_2_1, f32_rows_3_1, f32_rows_4_1},
    {f32_rows_1_2, f32_rows_2_2, f32_rows_3_2, f32_rows_4_2},
    {f32_rows_1_3, f32_rows_2_3, f32_rows_3_3, f32_rows_4_3},
};

/* The calling thread's groups [g0, g1) of F32_BLOCKS blocks, every row. */
static void f32_groups(const float *x, int64_t m, int64_t ldx, const float *wp, int64_t n, int64_t k,
                       const float *bias, float *y, int64_t ldy, int64_t g0, int64_t g1) {
    const int64_t blocks = n / 8, row_blocks = (m + F32_ROWS - 1) / F32_ROWS, block_lines = k / 2;
    for (int64_t g = g0; g < g1; g++) {
        const int64_t b0 = g * F32_BLOCKS, nb = blocks - b0 < F32_BLOCKS ? blocks - b0 : F32_BLOCKS;
        const float *wg = wp + b0 * k * 8;
        const int64_t left = blocks - b0 - nb;
        const int64_t next_nb =
            g + 1 < g1 && row_blocks >= F32_PREFETCH_MIN_BLOCKS ? (left < F32_BLOCKS ? left : F32_BLOCKS) : 0;
        const char *pf = (const char *)(wg + nb * k * 8), *pf_end = pf + next_nb * k * 32;
        const int64_t pf_lines = (next_nb * block_lines + row_blocks - 1) / row_blocks;
        for (int64_t m0 = 0; m0 < m; m0 += F32_ROWS) {
            for (int64_t l = 0; l < pf_lines && pf < pf_end; l++, pf += 64) _mm_prefetch(pf, _MM_HINT_T1);
            F32_ROWS_FNS[nb - 1][(m - m0 < F32_ROWS ? m - m0 : F32_ROWS) - 1](x + m0 * ldx, ldx, wg, k, bias,
                                                                            y + m0 * ldy, ldy, 8 * b0);
        }
    }
}
#endif

/* w [n, k] float32 row-major -> wp [n/8][k][8]: wp[(b * k + p) * 8 + j] = w[8b + j][p]. n a
 * multiple of 8. */
int prelude_f32_gemm_pack(const float *w, int64_t n, int64_t k, float *wp, int threads) {
#if HAVE_F32
    if (n <= 0 || k <= 0 || n % 8 != 0) return 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < n / 8; b++)
        for (int64_t p = 0; p < k; p++)
            for (int64_t j = 0; j < 8; j++) wp[(b * k + p) * 8 + j] = w[(8 * b + j) * k + p];
    return 0;
#else
    (void)w; (void)n; (void)k; (void)wp; (void)threads;
    return 1;
#endif
}

/* y [m, n] (row stride ldy) = x [m, k] (row stride ldx) W^T (+ bias [n]), all float32,
 * W packed by prelude_f32_gemm_pack (32-byte aligned). */
int prelude_f32_gemm(const float *x, int64_t m, int64_t ldx, const float *wp, int64_t n, int64_t k, const float *bias,
                     float *y, int64_t ldy, int threads) {
#if HAVE_F32
    if (m <= 0 || n <= 0 || k <= 0 || n % 8 != 0 || ldx < k || ldy < n || ((uintptr_t)wp & 31) != 0) return 1;
    const int64_t groups = (n / 8 + F32_BLOCKS - 1) / F32_BLOCKS;
    const int par = threads > 1 && groups >= 2 && m * n * k >= F32_PAR_MIN_WORK;
#pragma omp parallel num_threads(threads) if (par)
    {
        int64_t g0, g1;
        this_threads_share(groups, &g0, &g1);
        if (g0 < g1) f32_groups(x, m, ldx, wp, n, k, bias, y, ldy, g0, g1);
    }
    return 0;
#else
    (void)x; (void)m; (void)ldx; (void)wp; (void)n; (void)k; (void)bias; (void)y; (void)ldy; (void)threads;
    return 1;
#endif
}
