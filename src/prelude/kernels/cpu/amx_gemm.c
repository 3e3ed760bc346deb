/* Many bfloat16 rows through a bfloat16 weight on the AMX tile unit: y = x W^T (+ b),
 * x [m, k] (row stride ldx), y [m, n] (row stride ldy), the sums in float32, rounded once
 * to nearest even; W comes packed (prelude_amx_gemm_pack) in k pairs, 16 outputs a block:
 * wp[block][k/2][16] 32-bit words (two bf16 each), so a B tile (16 k pairs x 16 outputs)
 * is 1 KB in a row.
 *
 * Short prompts' projections (model/layers/linear.py sends calls of 33..128 rows here):
 * weights of a few MB at most, streamed from memory once a call, on which oneDNN's packed
 * kernels reach a fraction of the tile unit's rate from L1. Here A is 16 rows of x
 * straight from x (its row stride), B the packed weight, and a 32 x 32 block of y sits in
 * four C tiles (2 A x 2 B: every tile loaded feeds two products). The k loop runs in slabs of KC_CHUNKS x 32 so one slab
 * of a 32-output pair's weight (18 KB) and of a 32-row block of x fit L1 together while
 * the slab passes over ROW_CHUNK rows; the four C tiles wait in a per-thread buffer
 * between slabs (float32 stores and loads: exact). The next pair's weight is prefetched
 * into L2 meanwhile, spread over the pair's passes: without it the same loop lost to
 * oneDNN over weights streamed from memory.
 * Threads split the outputs (pairs of blocks), so a row's sums run in one order whatever
 * the thread count and whatever other rows share the call: k in 32-wide chunks, in order.
 * Rows past the last whole 32 go through a zero-padded copy.
 *
 * Without AMX, on a CPU with AVX512-BF16 (recent AMD CPUs), the same packed weight feeds the
 * dot-product form: vdpbf16ps on 16 outputs a vector, DP_ROWS rows of x (each k pair one
 * 32-bit broadcast from x's row) by DP_BLOCKS blocks of 16 outputs, 24 float32 accumulators
 * over every k pair in order, rounded once (4 x 6 the best of 8 x 3, 6 x 4, 5 x 5, 3 x 8,
 * 14 x 2). On a small model's projections (weights from memory, as in a forward) it takes
 * less time than oneDNN's packed kernels from 128 to 1,024 rows; the block count is a
 * constant of each kernel copy, which gains over a run-time count (docs/benchmarks.md).
 *
 * prelude_amx_gemm_ready() says whether a form can run here: 2 the tile form (the build has
 * AMX and the kernel lets this process use the tile registers), 1 the dot-product form, 0
 * none. Returns 0, or 1 on arguments it does not take (nothing written).
 */
#include "prelude_kernels.h"
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_shared.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HAVE_DPBF16 1
#include <immintrin.h>
#else
#define HAVE_DPBF16 0
#endif
#if HAVE_DPBF16 && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX 1
#else
#define HAVE_AMX 0
#endif

#define KC_CHUNKS 9   /* k chunks of 32 a slab: 288 k, 18 KB of a block pair's weight */
#define ROW_CHUNK 128 /* rows a slab passes over before the next pair (x's share stays in L2) */
#define PAR_MIN_WORK (1 << 22) /* m * n * k below this runs on the calling thread */
#define DP_ROWS 4   /* the dot-product form's rows a register block */
#define DP_BLOCKS 6 /* and its blocks of 16 outputs (24 accumulators of 32 registers) */
/* m * n * k below this runs the dot-product form on the calling thread: decode-sized calls
 * stream their weight from memory, and two threads read it faster than one (a bound of
 * PAR_MIN_WORK left few-row calls on one thread, slower) */
#define DP_PAR_MIN_WORK (1 << 16)
/* row blocks a call needs before each group prefetches the next one's weight: fewer rows
 * stream the weight at memory speed anyway, and the prefetches only add to it */
#define DP_PREFETCH_MIN_BLOCKS 8

int prelude_amx_gemm_ready(void) {
#if HAVE_AMX
    if (amx_permitted()) return 2;
#endif
    return HAVE_DPBF16;
}

#if HAVE_AMX
/* y's rows [0, rows) at outputs n0..n0+15 from c [16 rows][16 outputs] float32, + bias. */
static inline void store_rows(const float *c, int rows, int64_t n0, const uint16_t *bias, uint16_t *y, int64_t ldy) {
    const __m512 bv = bias_block(bias, n0);
    for (int r = 0; r < rows; r++) {
        const __m512 v = _mm512_add_ps(_mm512_load_ps(c + r * 16), bv);
        _mm256_storeu_si256((__m256i *)(y + r * ldy + n0), (__m256i)_mm512_cvtneps_pbh(v));
    }
}

/* One slab [c0, c1) of k chunks for the 32 x 32 block at x rows xa (row stride lda bytes)
 * and the packed pair b0 / b1, into C0-C3 (C0: rows 0-15 x outputs 0-15, C1: rows 0-15 x
 * 16-31, C2 / C3: rows 16-31). A 4 and 5, B 6 and 7. */
static inline void slab(const uint16_t *xa, int64_t lda, const uint32_t *b0, const uint32_t *b1, int64_t c0,
                        int64_t c1, const char **pf, const char *pf_end, int64_t pf_lines) {
    const uint16_t *xb = xa + 16 * (lda / 2);
    for (int64_t ch = c0; ch < c1; ch++) {
        for (int64_t l = 0; l < pf_lines && *pf < pf_end; l++, *pf += 64) _mm_prefetch(*pf, _MM_HINT_T1);
        _tile_loadd(4, xa + ch * 32, lda);
        _tile_loadd(6, b0 + ch * 256, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, b1 + ch * 256, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, xb + ch * 32, lda);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
}

/* The calling thread's pairs [p0, p1) for every row: ROW_CHUNK rows at a time, each pair's
 * slabs over the chunk's 32-row blocks. `tail`: rows past the last whole 32, zero-padded to
 * 32 (row stride k), or 0. */
static void pairs_span(const uint16_t *x, int64_t m, int64_t ldx, const uint32_t *wp, int64_t k,
                       const uint16_t *bias, uint16_t *y, int64_t ldy, int64_t p0, int64_t p1, const uint16_t *tail) {
    float cbuf[ROW_CHUNK / 32][1024] __attribute__((aligned(64)));
    const int64_t chunks = k / 32, kp_n = k / 2, blocks = (m + 31) / 32;
    amx_configure();
    for (int64_t mb0 = 0; mb0 < blocks; mb0 += ROW_CHUNK / 32) {
        const int64_t mb1 = mb0 + ROW_CHUNK / 32 < blocks ? mb0 + ROW_CHUNK / 32 : blocks;
        /* the next pair's weight (the pairs lie in a row) fetched while this one is summed: its
         * lines spread evenly over this pair's chunk passes */
        const int64_t pair_lines = kp_n * 2, passes = (mb1 - mb0) * chunks;
        const int64_t pf_lines = (pair_lines + passes - 1) / passes;
        for (int64_t p = p0; p < p1; p++) {
            const uint32_t *b0 = wp + 2 * p * kp_n * 16, *b1 = b0 + kp_n * 16;
            const char *pf = (const char *)(b1 + kp_n * 16);
            const char *pf_end = p + 1 < p1 ? pf + pair_lines * 64 : pf;
            for (int64_t c0 = 0; c0 < chunks; c0 += KC_CHUNKS) {
                const int64_t c1 = c0 + KC_CHUNKS < chunks ? c0 + KC_CHUNKS : chunks;
                for (int64_t mb = mb0; mb < mb1; mb++) {
                    const int64_t m0 = mb * 32;
                    const int whole = m0 + 32 <= m;
                    const uint16_t *xa = whole ? x + m0 * ldx : tail;
                    float *c = cbuf[mb - mb0];
                    if (c0 == 0) {
                        _tile_zero(0);
                        _tile_zero(1);
                        _tile_zero(2);
                        _tile_zero(3);
                    } else {
                        _tile_loadd(0, c, 64);
                        _tile_loadd(1, c + 256, 64);
                        _tile_loadd(2, c + 512, 64);
                        _tile_loadd(3, c + 768, 64);
                    }
                    slab(xa, (whole ? ldx : k) * 2, b0, b1, c0, c1, &pf, pf_end, pf_lines);
                    _tile_stored(0, c, 64);
                    _tile_stored(1, c + 256, 64);
                    _tile_stored(2, c + 512, 64);
                    _tile_stored(3, c + 768, 64);
                    if (c1 < chunks) continue;
                    const int rows = whole ? 32 : (int)(m - m0);
                    const int r0 = rows < 16 ? rows : 16, r1 = rows - r0;
                    uint16_t *yb = y + m0 * ldy;
                    store_rows(c, r0, 32 * p, bias, yb, ldy);
                    store_rows(c + 256, r0, 32 * p + 16, bias, yb, ldy);
                    if (r1 > 0) {
                        store_rows(c + 512, r1, 32 * p, bias, yb + 16 * ldy, ldy);
                        store_rows(c + 768, r1, 32 * p + 16, bias, yb + 16 * ldy, ldy);
                    }
                }
            }
        }
    }
    _tile_release();
}
#endif

#if HAVE_DPBF16
/* ROWS rows of x from x (row stride ldx) by NB blocks of 16 outputs from wp (block stride
 * kp * 16 words), every k pair in order, into y at outputs n0.. (+ bias). NB is a constant
 * of each copy: with the count known at run time the compiler kept a branch per block and
 * k pair and spilled accumulators to the stack in the inner loop. */
#define DP_KERNEL(ROWS, NB)                                                                               \
    static void dp_rows_##ROWS##_##NB(const uint16_t *x, int64_t ldx, const uint32_t *wp, int64_t kp,      \
                                      const uint16_t *bias, uint16_t *y, int64_t ldy, int64_t n0) {      \
        __m512 acc[ROWS][NB];                                                                             \
        for (int r = 0; r < ROWS; r++)                                                                    \
            for (int b = 0; b < NB; b++) acc[r][b] = _mm512_setzero_ps();                                 \
        for (int64_t p = 0; p < kp; p++) {                                                                \
            __m512bh w[NB];                                                                               \
            for (int b = 0; b < NB; b++) w[b] = (__m512bh)_mm512_load_si512(wp + (b * kp + p) * 16);      \
            for (int r = 0; r < ROWS; r++) {                                                              \
                uint32_t pair;                                                                            \
                memcpy(&pair, x + r * ldx + 2 * p, 4);                                                    \
                const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair);                               \
                for (int b = 0; b < NB; b++) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xv, w[b]);           \
            }                                                                                             \
        }                                                                                                 \
        for (int b = 0; b < NB; b++) {                                                                    \
            const __m512 bv = bias_block(bias, n0 + 16 * b);                                              \
            for (int r = 0; r < ROWS; r++)                                                                \
                _mm256_storeu_si256((__m256i *)(y + r * ldy + n0 + 16 * b),                               \
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r][b], bv)));           \
        }                                                                                                 \
    }
#define DP_KERNELS(NB) DP_KERNEL(1, NB) DP_KERNEL(2, NB) DP_KERNEL(3, NB) DP_KERNEL(4, NB)
DP_KERNELS(2)
DP_KERNELS(4)
DP_KERNELS(6)
typedef void (*dp_rows_fn)(const uint16_t *, int64_t, const uint32_t *, int64_t, const uint16_t *, uint16_t *, int64_t,
                           int64_t);
/* [blocks / 2 - 1][rows - 1]: a group holds 2, 4 or 6 blocks (n is a multiple of 32) */
static const dp_rows_fn DP_ROWS_FNS[DP_BLOCKS / 2][DP_ROWS] = {
    {dp_rows_1_2, dp_rows_2_2, dp_rows_3_2, dp_rows_4_2},
    {dp_rows_1_4, dp_rows_2_4, dp_rows_3_4, dp_rows_4_4},
    {dp_rows_1_6, dp_rows_2_6, dp_rows_3_6, dp_rows_4_6},
};

/* The calling thread's groups [g0, g1) of DP_BLOCKS blocks, every row. */
static void dp_groups(const uint16_t *x, int64_t m, int64_t ldx, const uint32_t *wp, int64_t n, int64_t k,
                      const uint16_t *bias, uint16_t *y, int64_t ldy, int64_t g0, int64_t g1) {
    const int64_t kp = k / 2, blocks = n / 16, row_blocks = (m + DP_ROWS - 1) / DP_ROWS;
    for (int64_t g = g0; g < g1; g++) {
        const int64_t b0 = g * DP_BLOCKS, nb = blocks - b0 < DP_BLOCKS ? blocks - b0 : DP_BLOCKS;
        const uint32_t *wg = wp + b0 * kp * 16;
        /* the next group's weight (it follows this one's: a block is kp lines) fetched into L2
         * while this one is summed, its lines spread over this group's row blocks: without it
         * each group's first row block waited on memory (short prefills gain a few percent) */
        const int64_t left = blocks - b0 - nb;
        const int64_t next_nb =
            g + 1 < g1 && row_blocks >= DP_PREFETCH_MIN_BLOCKS ? (left < DP_BLOCKS ? left : DP_BLOCKS) : 0;
        const char *pf = (const char *)(wg + nb * kp * 16), *pf_end = pf + next_nb * kp * 64;
        const int64_t pf_lines = (next_nb * kp + row_blocks - 1) / row_blocks;
        for (int64_t m0 = 0; m0 < m; m0 += DP_ROWS) {
            const uint16_t *xr = x + m0 * ldx;
            uint16_t *yr = y + m0 * ldy;
            for (int64_t l = 0; l < pf_lines && pf < pf_end; l++, pf += 64) _mm_prefetch(pf, _MM_HINT_T1);
            DP_ROWS_FNS[nb / 2 - 1][(m - m0 < DP_ROWS ? m - m0 : DP_ROWS) - 1](xr, ldx, wg, kp, bias, yr, ldy, 16 * b0);
        }
    }
}
#endif

/* w [n, k] bfloat16 row-major -> wp [n/16][k/2][16] 32-bit words: word (b, p, j) holds
 * w[16b + j][2p] and w[16b + j][2p + 1]. n a multiple of 32, k of 32. */
int prelude_amx_gemm_pack(const uint16_t *w, int64_t n, int64_t k, uint32_t *wp, int threads) {
#if HAVE_DPBF16
    if (n <= 0 || k <= 0 || n % 32 != 0 || k % 32 != 0) return 1;
    const int64_t kp_n = k / 2, blocks = n / 16;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t p0 = 0; p0 < kp_n; p0 += 16) {
            __m512i r[16];
            for (int j = 0; j < 16; j++) r[j] = _mm512_loadu_si512(w + (16 * b + j) * k + 2 * p0);
            transpose16(r);
            for (int q = 0; q < 16; q++) _mm512_store_si512(wp + (b * kp_n + p0 + q) * 16, r[q]);
        }
    return 0;
#else
    (void)w; (void)n; (void)k; (void)wp; (void)threads;
    return 1;
#endif
}

#if HAVE_AMX
/* prelude_amx_gemm on the tile unit (arguments checked): threads split the pairs of blocks. */
static int tiles_call(const uint16_t *x, int64_t m, int64_t ldx, const uint32_t *wp, int64_t n, int64_t k,
                      const uint16_t *bias, uint16_t *y, int64_t ldy, int threads) {
    const int64_t whole = m / 32 * 32;
    uint16_t *tail = 0;
    if (whole < m) {
        tail = aligned_alloc(64, (size_t)(32 * k) * 2);
        if (tail == 0) return 1;
        memset(tail, 0, (size_t)(32 * k) * 2);
        for (int64_t r = whole; r < m; r++) memcpy(tail + (r - whole) * k, x + r * ldx, (size_t)k * 2);
    }
    const int64_t pairs = n / 32;
    const int par = threads > 1 && pairs >= 2 && m * n * k >= PAR_MIN_WORK;
#pragma omp parallel num_threads(threads) if (par)
    {
        int64_t p0, p1;
        this_threads_share(pairs, &p0, &p1);
        if (p0 < p1) pairs_span(x, m, ldx, wp, k, bias, y, ldy, p0, p1, tail);
    }
    free(tail);
    return 0;
}
#endif

/* y [m, n] (row stride ldy) = x [m, k] (row stride ldx) W^T (+ bias [n]), all bfloat16,
 * W packed by prelude_amx_gemm_pack (64-byte aligned). */
int prelude_amx_gemm(const uint16_t *x, int64_t m, int64_t ldx, const uint32_t *wp, int64_t n, int64_t k,
                     const uint16_t *bias, uint16_t *y, int64_t ldy, int threads) {
#if HAVE_DPBF16
    if (m <= 0 || n <= 0 || k <= 0 || n % 32 != 0 || k % 32 != 0 || ldx < k || ldy < n || ((uintptr_t)wp & 63) != 0)
        return 1;
#if HAVE_AMX
    if (amx_permitted()) return tiles_call(x, m, ldx, wp, n, k, bias, y, ldy, threads);
#endif
    /* threads split the groups of outputs: a row's sums never depend on the split */
    const int64_t groups = (n / 16 + DP_BLOCKS - 1) / DP_BLOCKS;
    const int par = threads > 1 && groups >= 2 && m * n * k >= DP_PAR_MIN_WORK;
#pragma omp parallel num_threads(threads) if (par)
    {
        int64_t g0, g1;
        this_threads_share(groups, &g0, &g1);
        if (g0 < g1) dp_groups(x, m, ldx, wp, n, k, bias, y, ldy, g0, g1);
    }
    return 0;
#else
    (void)x; (void)m; (void)ldx; (void)wp; (void)n; (void)k; (void)bias; (void)y; (void)ldy; (void)threads;
    return 1;
#endif
}
