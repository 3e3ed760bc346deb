/* A few bfloat16 rows through a plain bfloat16 weight: y = x W^T (+ b), W [out, k]
 * row-major as loaded, x [rows, k], y [rows, out] bfloat16 (the sums in float32, rounded
 * once, to nearest even).
 *
 * Decode's projections: 1-8 rows against weights of 0.2-4 MB, read from memory once a
 * step. oneDNN's packed kernels stream them well but cost ~30-40 us a call before any
 * work on a KVM Xeon (a 64 x 64 weight took as long as a 576 x 576 one): 120 calls a
 * step of SmolLM2-135M. Here a call is the weight's bytes: W is read 16 output rows at a
 * time (one contiguous span, which the hardware prefetcher follows), the span stays in
 * L1 while every row of x is summed against it (vdpbf16ps: 32 products a vector), and the
 * 16 sums of a row leave as one vector.
 *
 * On a CPU with AMX-BF16 the whole 16-output blocks run on the tile unit instead, where the
 * vector unit's bf16 dot products cap a row at a few GB/s of weight (a KVM Xeon, model
 * 207: ~0.7 vdpbf16ps a ns a core, so 4 rows through a 3072 x 576 weight took as long as
 * oneDNN's call): A is 16 weight rows x 32 k straight from W (its row stride), B the rows
 * of x packed in k pairs (x^T, zero columns past the rows), C 16 outputs x 16 rows; four
 * output blocks share each B tile. The weight is read once whatever the row count.
 *
 * The sums of a row do not depend on the thread count (threads split the outputs).
 * AVX512-BF16 only (prelude_bf16_rows_available() says whether this build has it; the
 * tile form needs AMX-BF16 in the build, the kernel's permission, and k a multiple of 32).
 * Returns 0, or 1 on arguments it does not take (nothing written).
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

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

/* The calling OpenMP thread's contiguous share [*u0, *u1) of `units`. */
static void this_threads_share(int64_t units, int64_t *u0, int64_t *u1) {
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

static void blocks_span(const uint16_t *x, int64_t rows, int64_t stride_x, const uint16_t *w, int64_t b0, int64_t b1,
                        int64_t out, int64_t k, const uint16_t *bias, uint16_t *y) {
    for (int64_t blk = b0; blk < b1; blk++) {
        const int64_t o0 = blk * BLOCK, n = out - o0 < BLOCK ? out - o0 : BLOCK;
        if (n == BLOCK) block_rows(x, rows, stride_x, w, o0, BLOCK, k, bias, y, out);
        else block_rows(x, rows, stride_x, w, o0, n, k, bias, y, out);
    }
}

#if HAVE_AMX
/* Tiles: 0-1 C (16 outputs x 16 rows, float32), 4 and 7 B (16 k pairs x 16 rows), 5-6 A
 * (16 weight rows x 32 k). Every tile 16 rows x 64 bytes. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

static void amx_configure(void) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
}

/* c [16 outputs][16 rows] float32 (+ bias) -> y's rows 0..rows-1 at outputs o0..o0+15. */
static inline void store_block(const float *c, int64_t rows, int64_t o0, __m512 bv, uint16_t *y, int64_t stride_y) {
    const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                              _mm512_set1_epi32(BLOCK));
    for (int64_t r = 0; r < rows; r++) {
        const __m512 s = _mm512_add_ps(_mm512_i32gather_ps(column, c + r, 4), bv);
        _mm256_storeu_si256((__m256i *)(y + r * stride_y + o0), (__m256i)_mm512_cvtneps_pbh(s));
    }
}

static inline __m512 bias_block(const uint16_t *bias, int64_t o0) {
    if (bias == 0) return _mm512_setzero_ps();
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(bias + o0))), 16));
}

/* One output block from o0, its 32-k chunks alternating between two accumulators (C0, C1;
 * A 5 and 6, B 4 and 7: a load never waits for the product reading the tile before it),
 * the next block's rows fetched a chunk at a time meanwhile: a block is 16 rows of W, 16
 * streams, too many for the prefetcher to follow on its own. */
static void amx_block(const uint16_t *w, int64_t k, int64_t o0, int64_t out, const uint32_t *xp, int64_t rows,
                      const uint16_t *bias, uint16_t *y, int64_t stride_y, float *c) {
    const size_t stride = (size_t)k * 2;
    const uint16_t *w0 = w + o0 * k, *next = o0 + 2 * BLOCK <= out ? w0 + BLOCK * k : 0;
    const int64_t chunks = k / 32;
    _tile_zero(0);
    _tile_zero(1);
    int64_t ch = 0;
    for (; ch + 2 <= chunks; ch += 2) {
        if (next)
            for (int r = 0; r < BLOCK; r++) {
                _mm_prefetch((const char *)(next + r * k + ch * 32), _MM_HINT_T0);
                _mm_prefetch((const char *)(next + r * k + ch * 32 + 32), _MM_HINT_T0);
            }
        _tile_loadd(4, xp + ch * 256, 64);
        _tile_loadd(5, w0 + ch * 32, stride);
        _tile_dpbf16ps(0, 5, 4);
        _tile_loadd(7, xp + (ch + 1) * 256, 64);
        _tile_loadd(6, w0 + (ch + 1) * 32, stride);
        _tile_dpbf16ps(1, 6, 7);
    }
    if (ch < chunks) {
        if (next)
            for (int r = 0; r < BLOCK; r++) _mm_prefetch((const char *)(next + r * k + ch * 32), _MM_HINT_T0);
        _tile_loadd(4, xp + ch * 256, 64);
        _tile_loadd(5, w0 + ch * 32, stride);
        _tile_dpbf16ps(0, 5, 4);
    }
    _tile_stored(0, c, 64);
    _tile_stored(1, c + 256, 64);
    for (int i = 0; i < 256; i += 16)
        _mm512_store_ps(c + i, _mm512_add_ps(_mm512_load_ps(c + i), _mm512_load_ps(c + 256 + i)));
    store_block(c, rows, o0, bias_block(bias, o0), y, stride_y);
}

/* Whole output blocks [b0, b1). */
static void amx_span(const uint16_t *w, int64_t k, int64_t out, int64_t b0, int64_t b1, const uint32_t *xp,
                     int64_t rows, const uint16_t *bias, uint16_t *y, int64_t stride_y) {
    if (b0 >= b1) return;
    float c[2 * 256] __attribute__((aligned(64)));
    amx_configure();
    for (int64_t b = b0; b < b1; b++) amx_block(w, k, b * BLOCK, out, xp, rows, bias, y, stride_y, c);
    _tile_release();
}

/* x's rows as B tiles: xp[kp][n] = (x[n][2kp], x[n][2kp+1]) for n < rows, 0 for n up to 16. */
static uint32_t *pack_x(const uint16_t *x, int64_t rows, int64_t stride_x, int64_t k) {
    uint32_t *xp = aligned_alloc(64, (size_t)k / 2 * 64);
    if (xp == 0) return 0;
    memset(xp, 0, (size_t)k / 2 * 64);
    for (int64_t r = 0; r < rows; r++) {
        const uint32_t *pairs = (const uint32_t *)(x + r * stride_x);
        for (int64_t kp = 0; kp < k / 2; kp++) xp[kp * 16 + r] = pairs[kp];
    }
    return xp;
}
#endif
#endif

/* 1 where the tile form can run: this build has it and the kernel lets this process use the
 * tile registers (asked once; the answer is cached). */
int prelude_bf16_rows_amx_ready(void) {
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && HAVE_AMX
    static int ready = -1;
    if (ready < 0) ready = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return ready;
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
 * 1 <= rows <= 64. use_amx: take the tile form where it can run (up to 16 rows). */
int prelude_bf16_rows(const uint16_t *x, int64_t rows, int64_t stride_x, const uint16_t *w, int64_t out, int64_t k,
                      const uint16_t *bias, uint16_t *y, int threads, int use_amx) {
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
    if (rows < 1 || rows > 64 || out <= 0 || k <= 0 || stride_x < k) return 1;
#if HAVE_AMX
    if (use_amx && rows <= 16 && k % 32 == 0 && (stride_x % 2) == 0 && prelude_bf16_rows_amx_ready()) {
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
