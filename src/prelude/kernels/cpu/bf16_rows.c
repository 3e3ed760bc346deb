/* A few bfloat16 rows through a plain bfloat16 weight: y = x W^T (+ b), W [out, k]
 * row-major as loaded, x [rows, k], y [rows, out] bfloat16 (the sums in float32, rounded
 * once, to nearest even).
 *
 * Decode's projections: 1-32 rows against weights of a few MB at most, read from memory
 * once a step. oneDNN's packed kernels stream them well but pay a fixed cost per call
 * before any work (a 64 x 64 weight takes as long as a 576 x 576 one), and a small model's
 * step makes about a hundred calls. Here a call is the weight's bytes, read 16 output rows
 * at a time.
 *
 * The tile form (AMX-BF16): A is 16 weight rows x 32 k straight from W (its row stride),
 * B a group of 16 rows of x packed in k pairs (x^T, zero columns past the rows), C 16
 * outputs x 16 rows; up to four groups (C0-C3) share each A tile, so a block's weight rows
 * come from memory once per call (more groups pass over them again from cache). The next
 * block's rows are prefetched meanwhile: 16 row streams are more than the hardware
 * prefetcher follows.
 * The vector form (AVX512-BF16): the block's span stays in L1 while every row of x is
 * summed against it (vdpbf16ps: 32 products a vector) and a row's 16 sums leave as one
 * vector. It sums the outputs past the tile form's last whole block; for whole weights
 * the vector unit's bf16 rate on the AMX CPUs it was tried on did not beat oneDNN's call.
 *
 * A row's sums run in one order whatever the thread count (threads split the outputs) and
 * whatever other rows share the call.
 * AVX512-BF16 only (prelude_bf16_rows_available() says whether this build has it; the
 * tile form needs AMX-BF16 in the build, the kernel's permission, and k a multiple of 32).
 * Returns 0, or 1 on arguments it does not take (nothing written).
 */
#include "prelude_kernels.h"
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_shared.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

#define BLOCK 16 /* outputs a vector of sums */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX 1
#else
#define HAVE_AMX 0
#endif

/* The 16 lanes of each of v[0..15] summed: lane j of the result is the sum of v[j]
 * (pairwise: each level halves the vectors, and the last leaves the lanes in order). */
static inline __m512 sums_of_16(__m512 v[BLOCK]) {
    __m512 a[8], b[4], c[2];
    for (int j = 0; j < 8; j++) {
        /* lanes of v[2j] and v[2j+1] interleaved by 128-bit quarters, then added */
        const __m512 lo = _mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]);
        const __m512 hi = _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]);
        a[j] = _mm512_add_ps(lo, hi); /* per 128-bit quarter: [v2j a, v2j+1 a, v2j b, v2j+1 b] partials */
    }
    for (int j = 0; j < 4; j++) {
        const __m512 lo = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a[2 * j]), _mm512_castps_pd(a[2 * j + 1])));
        const __m512 hi = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a[2 * j]), _mm512_castps_pd(a[2 * j + 1])));
        b[j] = _mm512_add_ps(lo, hi); /* per quarter: v4j, v4j+1, v4j+2, v4j+3, each one quarter's sum */
    }
    for (int j = 0; j < 2; j++) {
        /* quarters 0,2 of one with 0,2 of the other, and 1,3 with 1,3 */
        const __m512 lo = _mm512_shuffle_f32x4(b[2 * j], b[2 * j + 1], 0x88);
        const __m512 hi = _mm512_shuffle_f32x4(b[2 * j], b[2 * j + 1], 0xDD);
        c[j] = _mm512_add_ps(lo, hi);
    }
    const __m512 lo = _mm512_shuffle_f32x4(c[0], c[1], 0x88);
    const __m512 hi = _mm512_shuffle_f32x4(c[0], c[1], 0xDD);
    return _mm512_add_ps(lo, hi);
}

/* Outputs [o0, o0 + n) (n <= 16) of every row. Inlined with n = 16 for full blocks, so
 * the accumulators stay in registers. */
static inline __attribute__((always_inline)) void block_rows(const uint16_t *x, int64_t rows, int64_t stride_x, const uint16_t *w, int64_t o0,
                              int64_t n, int64_t k, const uint16_t *bias, uint16_t *y, int64_t stride_y) {
    const int64_t full = k / 32 * 32;
    const __mmask32 tail = (__mmask32)((1ull << (k - full)) - 1);
    const __mmask16 keep = (__mmask16)((1u << n) - 1);
    const __m512 bv = bias == 0 ? _mm512_setzero_ps()
                                : _mm512_castsi512_ps(_mm512_slli_epi32(
                                      _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, bias + o0)), 16));
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * stride_x;
        __m512 acc[BLOCK];
        for (int j = 0; j < BLOCK; j++) acc[j] = _mm512_setzero_ps();
        for (int64_t c = 0; c < full; c += 32) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(xr + c);
            /* one pointer walking down the block's rows: 16 row pointers would not fit the
             * general registers beside the loop's own */
            const uint16_t *wj = w + o0 * k + c;
            for (int j = 0; j < BLOCK; j++, wj += k)
                if (j < n) acc[j] = _mm512_dpbf16_ps(acc[j], xv, (__m512bh)_mm512_loadu_si512(wj));
        }
        if (full < k) {
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tail, xr + full);
            for (int j = 0; j < BLOCK; j++)
                if (j < n)
                    acc[j] = _mm512_dpbf16_ps(acc[j], xv, (__m512bh)_mm512_maskz_loadu_epi16(tail, w + (o0 + j) * k + full));
        }
        const __m512 s = _mm512_add_ps(sums_of_16(acc), bv);
        _mm256_mask_storeu_epi16(y + r * stride_y + o0, keep, (__m256i)_mm512_cvtneps_pbh(s));
    }
}

static void blocks_span(const uint16_t *x, int64_t rows, int64_t stride_x, const uint16_t *w, int64_t b0, int64_t b1,
                        int64_t out, int64_t k, const uint16_t *bias, uint16_t *y) {
    for (int64_t blk = b0; blk < b1; blk++) {
        const int64_t o0 = blk * BLOCK, n = out - o0 < BLOCK ? out - o0 : BLOCK;
        if (n == BLOCK) block_rows(x, rows, stride_x, w, o0, BLOCK, k, bias, y, out);
        else block_rows(x, rows, stride_x, w, o0, n, k, bias, y, out);
    }
}

#if HAVE_AMX
/* Tiles: 0-3 C (16 outputs x 16 rows, float32: a group of 16 rows each), 4-5 A (16 weight
 * rows x 32 k), 6-7 B (16 k pairs x 16 rows). Every tile 16 rows x 64 bytes. */
/* c [16 outputs][16 rows] float32 (+ bias, per output) -> y's rows 0..rows-1 at outputs
 * o0..o0+15: a transpose, then a row's 16 outputs in one store. */
static inline void store_block(const float *c, int64_t rows, int64_t o0, __m512 bv, uint16_t *y, int64_t stride_y) {
    __m512i r[16];
    for (int j = 0; j < 16; j++) r[j] = _mm512_load_si512(c + 16 * j);
    transpose16(r);
    for (int64_t n = 0; n < rows; n++) {
        const __m512 v = _mm512_add_ps(_mm512_castsi512_ps(r[n]), bv);
        _mm256_storeu_si256((__m256i *)(y + n * stride_y + o0), (__m256i)_mm512_cvtneps_pbh(v));
    }
}

/* The next block's 16 weight rows, one or two 64-byte lines of each, fetched while this
 * block is summed: 16 row streams are more than the prefetcher follows on its own. */
static inline void fetch_next(const uint16_t *next, int64_t k, int64_t ch, int lines) {
    if (next == 0) return;
    for (int r = 0; r < BLOCK; r++)
        for (int l = 0; l < lines; l++) _mm_prefetch((const char *)(next + r * k + (ch + l) * 32), _MM_HINT_T0);
}

/* One output block from o0 for one group of up to 16 rows (xp: the group's B tiles), into
 * C0 chunk after chunk as amx_block_groups sums each of its groups (so a row's answer does
 * not depend on how many rows came with it); A 4 and 5, B 6 and 7 in turn, so a load never
 * waits for the product reading the tile before it. */
static void amx_block_one(const uint16_t *w, int64_t k, int64_t o0, const uint16_t *next, const uint32_t *xp,
                          int64_t rows, __m512 bv, uint16_t *y, int64_t stride_y, float *c) {
    const size_t stride = (size_t)k * 2;
    const uint16_t *w0 = w + o0 * k;
    const int64_t chunks = k / 32;
    _tile_zero(0);
    int64_t ch = 0;
    for (; ch + 2 <= chunks; ch += 2) {
        fetch_next(next, k, ch, 2);
        _tile_loadd(6, xp + ch * 256, 64);
        _tile_loadd(4, w0 + ch * 32, stride);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, xp + (ch + 1) * 256, 64);
        _tile_loadd(5, w0 + (ch + 1) * 32, stride);
        _tile_dpbf16ps(0, 5, 7);
    }
    if (ch < chunks) {
        fetch_next(next, k, ch, 1);
        _tile_loadd(6, xp + ch * 256, 64);
        _tile_loadd(4, w0 + ch * 32, stride);
        _tile_dpbf16ps(0, 4, 6);
    }
    _tile_stored(0, c, 64);
    store_block(c, rows, o0, bv, y, stride_y);
}

/* One chunk's A tile `at` against the B tiles of groups 0..ng-1 (B 6 and 7 in turn) into
 * C0..C3. Tile numbers are immediates, hence the macro. */
#define GROUPS_CHUNK(at, ch)                                                                   \
    do {                                                                                       \
        _tile_loadd(at, w0 + (ch) * 32, stride);                                               \
        _tile_loadd(6, xp + (ch) * 256, 64);                                                   \
        _tile_dpbf16ps(0, at, 6);                                                              \
        _tile_loadd(7, xp + gstride + (ch) * 256, 64);                                         \
        _tile_dpbf16ps(1, at, 7);                                                              \
        if (ng > 2) {                                                                          \
            _tile_loadd(6, xp + 2 * gstride + (ch) * 256, 64);                                 \
            _tile_dpbf16ps(2, at, 6);                                                          \
        }                                                                                      \
        if (ng > 3) {                                                                          \
            _tile_loadd(7, xp + 3 * gstride + (ch) * 256, 64);                                 \
            _tile_dpbf16ps(3, at, 7);                                                          \
        }                                                                                      \
    } while (0)

/* One output block from o0 for 2..4 groups of rows (rows: all of them, from the first
 * group's; xp: the first group's B tiles, gstride apart), each group in its own C tile. */
static void amx_block_groups(const uint16_t *w, int64_t k, int64_t o0, const uint16_t *next, const uint32_t *xp,
                             int64_t gstride, int ng, int64_t rows, __m512 bv, uint16_t *y, int64_t stride_y,
                             float *c) {
    const size_t stride = (size_t)k * 2;
    const uint16_t *w0 = w + o0 * k;
    const int64_t chunks = k / 32;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    int64_t ch = 0;
    for (; ch + 2 <= chunks; ch += 2) {
        fetch_next(next, k, ch, 2);
        GROUPS_CHUNK(4, ch);
        GROUPS_CHUNK(5, ch + 1);
    }
    if (ch < chunks) {
        fetch_next(next, k, ch, 1);
        GROUPS_CHUNK(4, ch);
    }
    _tile_stored(0, c, 64);
    _tile_stored(1, c + 256, 64);
    if (ng > 2) _tile_stored(2, c + 512, 64);
    if (ng > 3) _tile_stored(3, c + 768, 64);
    for (int g = 0; g < ng; g++) {
        const int64_t left = rows - 16 * g;
        store_block(c + 256 * g, left < 16 ? left : 16, o0, bv, y + 16 * g * stride_y, stride_y);
    }
}

/* Whole output blocks [b0, b1): every group of 16 rows of each block while its weight rows
 * are in cache (they are read from memory once), four groups to a pass over them. */
static void amx_span(const uint16_t *w, int64_t k, int64_t out, int64_t b0, int64_t b1, const uint32_t *xp,
                     int64_t rows, const uint16_t *bias, uint16_t *y, int64_t stride_y) {
    if (b0 >= b1) return;
    float c[4 * 256] __attribute__((aligned(64)));
    const int64_t groups = (rows + 15) / 16, gstride = k / 2 * 16;
    amx_configure();
    for (int64_t b = b0; b < b1; b++) {
        const int64_t o0 = b * BLOCK;
        const uint16_t *next = b + 1 < b1 ? w + (o0 + BLOCK) * k : 0;
        const __m512 bv = bias_block(bias, o0);
        for (int64_t g = 0; g < groups; g += 4) {
            const int ng = groups - g < 4 ? (int)(groups - g) : 4;
            const int64_t left = rows - 16 * g;
            if (ng == 1)
                amx_block_one(w, k, o0, next, xp + g * gstride, left, bv, y + 16 * g * stride_y, stride_y, c);
            else
                amx_block_groups(w, k, o0, g == 0 ? next : 0, xp + g * gstride, gstride, ng, left, bv,
                                 y + 16 * g * stride_y, stride_y, c);
        }
    }
    _tile_release();
}

/* x's rows as B tiles, 16 rows a group: xp[g][kp][n] = (x[16g+n][2kp], x[16g+n][2kp+1]), 0
 * for rows past the last. 16 pairs of 16 rows a transpose. */
static uint32_t *pack_x(const uint16_t *x, int64_t rows, int64_t stride_x, int64_t k) {
    const int64_t groups = (rows + 15) / 16, kp_n = k / 2;
    uint32_t *xp = aligned_alloc(64, (size_t)(groups * kp_n) * 64);
    if (xp == 0) return 0;
    for (int64_t g = 0; g < groups; g++)
        for (int64_t kp0 = 0; kp0 < kp_n; kp0 += 16) {
            __m512i r[16];
            for (int n = 0; n < 16; n++) {
                const int64_t row = 16 * g + n;
                r[n] = row < rows ? _mm512_loadu_si512(x + row * stride_x + 2 * kp0) : _mm512_setzero_si512();
            }
            transpose16(r);
            for (int j = 0; j < 16; j++) _mm512_store_si512(xp + (g * kp_n + kp0 + j) * 16, r[j]);
        }
    return xp;
}
#endif
#endif

/* 1 where the tile form can run: this build has it and the kernel lets this process use the
 * tile registers (asked once; the answer is cached). */
int prelude_bf16_rows_amx_ready(void) {
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && HAVE_AMX
    return amx_permitted();
#else
    return 0;
#endif
}

int prelude_bf16_rows_available(void) {
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
    return 1;
#else
    return 0;
#endif
}

/* Work below this many weight elements runs on the calling thread: waking the team costs
 * more than half of such a call. */
#define PAR_MIN_WEIGHT 65536

/* y [rows, out] = x [rows, k] (row stride stride_x) W^T (+ bias [out]), all bfloat16;
 * 1 <= rows <= 256. use_amx: take the tile form where it can run. */
int prelude_bf16_rows(const uint16_t *x, int64_t rows, int64_t stride_x, const uint16_t *w, int64_t out, int64_t k,
                      const uint16_t *bias, uint16_t *y, int threads, int use_amx) {
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
    if (rows < 1 || rows > 256 || out <= 0 || k <= 0 || stride_x < k) return 1;
#if HAVE_AMX
    if (use_amx && k % 32 == 0 && prelude_bf16_rows_amx_ready()) {
        uint32_t *xp = pack_x(x, rows, stride_x, k);
        if (xp == 0) return 1;
        const int64_t whole = out / BLOCK; /* the tile form's blocks; the rest on the vector unit */
        const int par = threads > 1 && out * k >= PAR_MIN_WEIGHT && whole >= 2;
#pragma omp parallel num_threads(threads) if (par)
        {
            int64_t b0, b1;
            this_threads_share(whole, &b0, &b1);
            amx_span(w, k, out, b0, b1, xp, rows, bias, y, out);
        }
        free(xp);
        if (whole * BLOCK < out) blocks_span(x, rows, stride_x, w, whole, whole + 1, out, k, bias, y);
        return 0;
    }
#endif
    const int64_t nb = (out + BLOCK - 1) / BLOCK;
    if (threads <= 1 || out * k < PAR_MIN_WEIGHT || nb < 2) {
        blocks_span(x, rows, stride_x, w, 0, nb, out, k, bias, y);
        return 0;
    }
#pragma omp parallel num_threads(threads)
    {
        int64_t b0, b1;
        this_threads_share(nb, &b0, &b1);
        if (b0 < b1) blocks_span(x, rows, stride_x, w, b0, b1, out, k, bias, y);
    }
    return 0;
#else
    (void)x; (void)rows; (void)stride_x; (void)w; (void)out; (void)k; (void)bias; (void)y; (void)threads;
    (void)use_amx;
    return 1;
#endif
}
