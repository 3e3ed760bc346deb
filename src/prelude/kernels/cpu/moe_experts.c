/* A mixture of experts' chosen experts for a batch of rows, in one call: every expert that
 * some row chose runs its gated MLP (gate and up, SiLU(gate) * up, down) over the rows
 * that chose it, and each row's outputs are summed with the router's weights. The router
 * (its logits, softmax and top-k) stays with the caller (model/layers/moe.py).
 *
 * Weights come packed (prelude_moe_pack) so that a unit of work reads one contiguous
 * stretch: gate/up in groups of GU_BLOCKS intermediate blocks of 16 (each k step holds the
 * group's gate blocks, then its up blocks: SiLU(gate) * up is formed in registers, never
 * stored unrounded), down in groups of DN_BLOCKS output blocks of 16. bfloat16 weights
 * are packed in k pairs (one vdpbf16ps a block and pair), float32 weights one k a step.
 * Widths need not be multiples of anything: the packing pads outputs to whole blocks and
 * k to whole pairs with zeros (a padded intermediate is SiLU(0) * 0 = 0, so down's padded
 * k adds nothing).
 *
 * A call: the rows are sorted by the expert they chose (a counting sort, each expert's
 * rows in row order); the units (expert, gate/up group) are shared by the threads, then
 * (expert, down group), then the rows' sums. Only the chosen experts' packed weights are
 * read, once a call each: a decode step streams top_k experts a row and nothing else.
 * Within a unit a register tile is TILE_ROWS rows by up to 6 blocks of 16, every k in
 * order, so a row's sums do not depend on how many rows share the expert, the call or the
 * threads: the grouped call is batch-invariant as it is.
 *
 * Numerics follow transformers' Qwen3-MoE block step by step: gate, up and down rounded
 * to the dtype, SiLU of the rounded gate rounded, times up rounded; down's output times
 * the row's weight (rounded to the dtype), rounded; each row's expert outputs added in
 * ascending expert order into zeros, each sum rounded. In bfloat16 the rounding is to
 * nearest even, as torch's; the GEMM sums are float32 in k order and SiLU's exp is
 * native_shared.h's exp16 (~1 ulp), so the outputs are the eager ops' up to sum order.
 *
 * prelude_moe_experts_forms(): bit 0 float32 (AVX-512F), bit 1 bfloat16 (AVX512-BF16).
 * Returns 0, 1 on arguments it does not take, 2 when out of memory (nothing written).
 */
#include "prelude_kernels.h"
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_shared.h"

#if defined(__AVX512F__)
#define HAVE_F32 1
#include <immintrin.h>
#else
#define HAVE_F32 0
#endif
#if HAVE_F32 && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HAVE_BF16 1
#else
#define HAVE_BF16 0
#endif

#define GU_BLOCKS 3  /* intermediate blocks of 16 a gate/up unit: 6 weight blocks, 3 gate and 3 up */
#define DN_BLOCKS 6  /* output blocks of 16 a down unit */
#define TILE_ROWS 4  /* rows a register tile: 4 x 6 accumulators of the 32 registers */
#define TILE_OUT 96  /* floats a tile row holds: 6 blocks of 16 */
/* chosen experts a thread before a unit is a whole expert (prelude_moe_experts) */
#define WHOLE_EXPERTS_PER_THREAD 4
/* a call reading fewer weight bytes than this runs on the calling thread: waking the team
 * costs more */
#define PAR_MIN_BYTES (1 << 18)

int prelude_moe_experts_forms(void) { return HAVE_F32 | (HAVE_BF16 << 1); }

/* Elements of the packed gate/up and down of one expert (32-bit words in bf16: k pairs). */
static int64_t blocks_of(int64_t n) { return (n + 15) / 16; }
static int64_t k_steps(int bf, int64_t k) { return bf ? (k + 1) / 2 : k; }

int64_t prelude_moe_packed_gate_up(int bf, int64_t hidden, int64_t inter) {
    return blocks_of(inter) * 2 * 16 * k_steps(bf, hidden);
}

int64_t prelude_moe_packed_down(int bf, int64_t hidden, int64_t inter) {
    return blocks_of(hidden) * 16 * k_steps(bf, blocks_of(inter) * 16);
}

#if HAVE_F32
/* 16 weight rows from w (valid of them real, row stride ld elements, k wide) into dst, k
 * step by k step (a bf16 pair or a float32), `stride` 32-bit words apart: dst[p * stride +
 * j] is step p of row j, zero past the valid rows and past k. Whole 16-step spans of whole
 * blocks go 16 x 16 words through a transpose. */
static void pack_rows16(int bf, const void *w, int64_t ld, int64_t valid, int64_t k, int64_t steps, uint32_t *dst,
                        int64_t stride) {
    const int64_t per_step = bf ? 2 : 1;
    int64_t p0 = 0;
    if (valid == 16)
        for (; (p0 + 16) * per_step <= k; p0 += 16) {
            __m512i r[16];
            for (int j = 0; j < 16; j++)
                r[j] = _mm512_loadu_si512((const char *)w + (j * ld + p0 * per_step) * (bf ? 2 : 4));
            transpose16(r);
            for (int q = 0; q < 16; q++) _mm512_storeu_si512(dst + (p0 + q) * stride, r[q]);
        }
    for (int64_t p = p0; p < steps; p++)
        for (int64_t j = 0; j < 16; j++) {
            uint32_t word = 0;
            if (j < valid) {
                if (bf) {
                    const uint16_t *row = (const uint16_t *)w + j * ld;
                    const int64_t c = 2 * p;
                    word = (c < k ? row[c] : 0) | (uint32_t)(c + 1 < k ? row[c + 1] : 0) << 16;
                } else if (p < k) {
                    memcpy(&word, (const float *)w + j * ld + p, 4);
                }
            }
            dst[p * stride + j] = word;
        }
}
#endif

/* gate_up [E, 2I, H] (each expert's I gate rows, then its I up rows) and down [E, H, I],
 * both contiguous, into gu_p and dn_p (prelude_moe_packed_* elements an expert). */
int prelude_moe_pack(int bf, const void *gate_up, const void *down, int64_t experts, int64_t hidden, int64_t inter,
                     void *gu_p, void *dn_p, int threads) {
#if HAVE_F32
    if (experts <= 0 || hidden <= 0 || inter <= 0 || (bf && !HAVE_BF16)) return 1;
    const int64_t ib = blocks_of(inter), hb = blocks_of(hidden), i16 = ib * 16, es = bf ? 2 : 4;
    const int64_t kh = k_steps(bf, hidden), ki = k_steps(bf, i16);
    /* in 32-bit words: a bf16 element is half of one */
    const int64_t gu_e = prelude_moe_packed_gate_up(bf, hidden, inter), dn_e = prelude_moe_packed_down(bf, hidden, inter);
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
    for (int64_t e = 0; e < experts; e++)
        for (int64_t blk = 0; blk < ib; blk++) {
            const int64_t g = blk / GU_BLOCKS, s = blk % GU_BLOCKS;
            const int64_t nb = ib - g * GU_BLOCKS < GU_BLOCKS ? ib - g * GU_BLOCKS : GU_BLOCKS, ns = 2 * nb;
            uint32_t *base = (uint32_t *)gu_p + e * gu_e + g * GU_BLOCKS * 2 * 16 * kh;
            const int64_t valid = inter - blk * 16 < 16 ? inter - blk * 16 : 16;
            const char *gate = (const char *)gate_up + ((e * 2 * inter + blk * 16) * hidden) * es;
            const char *up = gate + inter * hidden * es;
            pack_rows16(bf, gate, hidden, valid, hidden, kh, base + s * 16, ns * 16);
            pack_rows16(bf, up, hidden, valid, hidden, kh, base + (nb + s) * 16, ns * 16);
        }
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
    for (int64_t e = 0; e < experts; e++)
        for (int64_t blk = 0; blk < hb; blk++) {
            const int64_t g = blk / DN_BLOCKS, s = blk % DN_BLOCKS;
            const int64_t nb = hb - g * DN_BLOCKS < DN_BLOCKS ? hb - g * DN_BLOCKS : DN_BLOCKS;
            uint32_t *base = (uint32_t *)dn_p + e * dn_e + g * DN_BLOCKS * 16 * ki;
            const int64_t valid = hidden - blk * 16 < 16 ? hidden - blk * 16 : 16;
            const char *rows = (const char *)down + ((e * hidden + blk * 16) * inter) * es;
            pack_rows16(bf, rows, inter, valid, inter, ki, base + s * 16, nb * 16);
        }
    return 0;
#else
    (void)bf; (void)gate_up; (void)down; (void)experts; (void)hidden; (void)inter; (void)gu_p; (void)dn_p;
    (void)threads;
    return 1;
#endif
}

#if HAVE_F32
/* A register tile: R rows (pointers xr) by NB blocks of 16 from w (k step stride NB * 16
 * elements), every k step in order, into c [R][TILE_OUT] float32. R and NB constants of
 * each copy, so the accumulators stay in registers. */
#define F32_TILE(R, NB)                                                                                   \
    static void f32_tile_##R##_##NB(const void *const *xr, const void *wv, int64_t ks, float *c) {        \
        const float *w = wv;                                                                              \
        __m512 acc[R][NB];                                                                                \
        for (int r = 0; r < R; r++)                                                                       \
            for (int b = 0; b < NB; b++) acc[r][b] = _mm512_setzero_ps();                                 \
        for (int64_t p = 0; p < ks; p++) {                                                                \
            __m512 wb[NB];                                                                                \
            for (int b = 0; b < NB; b++) wb[b] = _mm512_loadu_ps(w + (p * NB + b) * 16);                  \
            for (int r = 0; r < R; r++) {                                                                 \
                const __m512 xv = _mm512_set1_ps(((const float *)xr[r])[p]);                              \
                for (int b = 0; b < NB; b++) acc[r][b] = _mm512_fmadd_ps(xv, wb[b], acc[r][b]);           \
            }                                                                                             \
        }                                                                                                 \
        for (int r = 0; r < R; r++)                                                                       \
            for (int b = 0; b < NB; b++) _mm512_storeu_ps(c + r * TILE_OUT + 16 * b, acc[r][b]);          \
    }
#define F32_TILES(NB) F32_TILE(1, NB) F32_TILE(2, NB) F32_TILE(3, NB) F32_TILE(4, NB)
F32_TILES(1)
F32_TILES(2)
F32_TILES(3)
F32_TILES(4)
F32_TILES(5)
F32_TILES(6)
#endif

#if HAVE_BF16
/* The bf16 tile: each k pair of a row one 32-bit broadcast, one vdpbf16ps a block. */
#define BF_TILE(R, NB)                                                                                    \
    static void bf_tile_##R##_##NB(const void *const *xr, const void *wv, int64_t ks, float *c) {         \
        const uint32_t *w = wv;                                                                           \
        __m512 acc[R][NB];                                                                                \
        for (int r = 0; r < R; r++)                                                                       \
            for (int b = 0; b < NB; b++) acc[r][b] = _mm512_setzero_ps();                                 \
        for (int64_t p = 0; p < ks; p++) {                                                                \
            __m512bh wb[NB];                                                                              \
            for (int b = 0; b < NB; b++) wb[b] = (__m512bh)_mm512_loadu_si512(w + (p * NB + b) * 16);    \
            for (int r = 0; r < R; r++) {                                                                 \
                uint32_t pair;                                                                            \
                memcpy(&pair, (const uint16_t *)xr[r] + 2 * p, 4);                                        \
                const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair);                               \
                for (int b = 0; b < NB; b++) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xv, wb[b]);          \
            }                                                                                             \
        }                                                                                                 \
        for (int r = 0; r < R; r++)                                                                       \
            for (int b = 0; b < NB; b++) _mm512_storeu_ps(c + r * TILE_OUT + 16 * b, acc[r][b]);          \
    }
#define BF_TILES(NB) BF_TILE(1, NB) BF_TILE(2, NB) BF_TILE(3, NB) BF_TILE(4, NB)
BF_TILES(1)
BF_TILES(2)
BF_TILES(3)
BF_TILES(4)
BF_TILES(5)
BF_TILES(6)
#endif

typedef void (*tile_fn)(const void *const *, const void *, int64_t, float *);
#define TILE_ROW(P, NB) {P##_tile_1_##NB, P##_tile_2_##NB, P##_tile_3_##NB, P##_tile_4_##NB}
#if HAVE_F32
static const tile_fn F32_TILES_FNS[6][TILE_ROWS] = {TILE_ROW(f32, 1), TILE_ROW(f32, 2), TILE_ROW(f32, 3),
                                                    TILE_ROW(f32, 4), TILE_ROW(f32, 5), TILE_ROW(f32, 6)};
#endif
#if HAVE_BF16
static const tile_fn BF_TILES_FNS[6][TILE_ROWS] = {TILE_ROW(bf, 1), TILE_ROW(bf, 2), TILE_ROW(bf, 3),
                                                   TILE_ROW(bf, 4), TILE_ROW(bf, 5), TILE_ROW(bf, 6)};
#endif

#if HAVE_F32
static inline tile_fn tile_for(int bf, int64_t nb, int64_t rows) {
#if HAVE_BF16
    if (bf) return BF_TILES_FNS[nb - 1][rows - 1];
#endif
    return F32_TILES_FNS[nb - 1][rows - 1];
}

/* 16 values of the dtype as float32; stored back rounded to it (bf16: to nearest even). */
static inline __m512 load16(int bf, const void *p, int64_t i, __mmask16 keep) {
    if (!bf) return _mm512_maskz_loadu_ps(keep, (const float *)p + i);
    const __m256i raw = _mm256_maskz_loadu_epi16(keep, (const uint16_t *)p + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

static inline __m512 round16(int bf, __m512 v) {
#if HAVE_BF16
    if (bf) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
#endif
    (void)bf;
    return v;
}

static inline void store16(int bf, void *p, int64_t i, __m512 v, __mmask16 keep) {
#if HAVE_BF16
    if (bf) {
        _mm256_mask_storeu_epi16((uint16_t *)p + i, keep, (__m256i)_mm512_cvtneps_pbh(v));
        return;
    }
#endif
    _mm512_mask_storeu_ps((float *)p + i, keep, v);
}

static inline void *at(int bf, const void *p, int64_t i) { return (char *)p + i * (bf ? 2 : 4); }

/* One gate/up unit: the n rows of one expert (their indices in x: rows) through a group of
 * nb intermediate blocks from intermediate i0, SiLU(gate) * up into act's rows (I16 wide). */
static void gate_up_unit(int bf, const void *x, int64_t ldx, const int64_t *rows, int64_t n, const void *w,
                         int64_t nb, int64_t kh, void *act, int64_t i16, int64_t i0) {
    float c[TILE_ROWS * TILE_OUT] __attribute__((aligned(64)));
    for (int64_t m0 = 0; m0 < n; m0 += TILE_ROWS) {
        const int64_t r_n = n - m0 < TILE_ROWS ? n - m0 : TILE_ROWS;
        const void *xr[TILE_ROWS];
        for (int64_t r = 0; r < r_n; r++) xr[r] = at(bf, x, rows[m0 + r] * ldx);
        tile_for(bf, 2 * nb, r_n)(xr, w, kh, c);
        for (int64_t r = 0; r < r_n; r++)
            for (int64_t b = 0; b < nb; b++) {
                const __m512 g = round16(bf, _mm512_load_ps(c + r * TILE_OUT + 16 * b));
                const __m512 u = round16(bf, _mm512_load_ps(c + r * TILE_OUT + 16 * (nb + b)));
                const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
                const __m512 silu = round16(bf, _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
                store16(bf, act, (m0 + r) * i16 + i0 + 16 * b, _mm512_mul_ps(silu, u), 0xffff);
            }
    }
}

/* One down unit: the n rows of one expert's act through a group of nb output blocks from
 * output o0, times each row's weight (rw), into y's rows (hidden wide). */
static void down_unit(int bf, const void *act, int64_t i16, int64_t n, const void *w, int64_t nb, int64_t ki,
                      const float *rw, void *y, int64_t hidden, int64_t o0) {
    float c[TILE_ROWS * TILE_OUT] __attribute__((aligned(64)));
    for (int64_t m0 = 0; m0 < n; m0 += TILE_ROWS) {
        const int64_t r_n = n - m0 < TILE_ROWS ? n - m0 : TILE_ROWS;
        const void *xr[TILE_ROWS];
        for (int64_t r = 0; r < r_n; r++) xr[r] = at(bf, act, (m0 + r) * i16);
        tile_for(bf, nb, r_n)(xr, w, ki, c);
        for (int64_t r = 0; r < r_n; r++) {
            const __m512 wv = _mm512_set1_ps(rw[m0 + r]);
            for (int64_t b = 0; b < nb; b++) {
                const int64_t o = o0 + 16 * b, left = hidden - o;
                const __mmask16 keep = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
                const __m512 v = round16(bf, _mm512_load_ps(c + r * TILE_OUT + 16 * b));
                store16(bf, y, (m0 + r) * hidden + o, _mm512_mul_ps(v, wv), keep);
            }
        }
    }
}

static float round1(int bf, float v) {
    if (!bf) return v;
    uint32_t u;
    memcpy(&u, &v, 4);
    u = ((u + 0x7fffu + ((u >> 16) & 1u)) >> 16) << 16; /* to nearest even (weights are finite) */
    memcpy(&v, &u, 4);
    return v;
}

typedef struct {
    int64_t expert, group;
} Unit;

/* Unit (e, g) of gate/up: expert e's rows (its slots [start[e], start[e + 1])) through
 * intermediate group g. */
static void gate_up_group(int bf, const void *x, int64_t ldx, const int64_t *start, const int64_t *rows, int64_t e,
                          int64_t g, const void *gu_p, int64_t ib, int64_t kh, int64_t gu_e, void *act, int64_t i16) {
    const int64_t s0 = start[e], nb = ib - g * GU_BLOCKS < GU_BLOCKS ? ib - g * GU_BLOCKS : GU_BLOCKS;
    const void *w = (const uint32_t *)gu_p + e * gu_e + g * GU_BLOCKS * 2 * 16 * kh;
    gate_up_unit(bf, x, ldx, rows + s0, start[e + 1] - s0, w, nb, kh, at(bf, act, s0 * i16), i16, g * GU_BLOCKS * 16);
}

/* Unit (e, g) of down: expert e's rows of act through output group g, into y. */
static void down_group(int bf, const void *act, int64_t i16, const int64_t *start, int64_t e, int64_t g,
                       const void *dn_p, int64_t hb, int64_t ki, int64_t dn_e, const float *rw, void *y, int64_t hidden) {
    const int64_t s0 = start[e], nb = hb - g * DN_BLOCKS < DN_BLOCKS ? hb - g * DN_BLOCKS : DN_BLOCKS;
    const void *w = (const uint32_t *)dn_p + e * dn_e + g * DN_BLOCKS * 16 * ki;
    down_unit(bf, at(bf, act, s0 * i16), i16, start[e + 1] - s0, w, nb, ki, rw + s0, at(bf, y, s0 * hidden), hidden,
              g * DN_BLOCKS * 16);
}
#endif

/* out [T, H] (row stride ldo) = the experts' MLPs of x [T, H] (row stride ldx): row t
 * through experts[t, 0..k-1] (int64, each in [0, E)) with weights[t, ..] (float32, the
 * router's), summed in ascending expert order. gu_p and dn_p from prelude_moe_pack in the
 * same dtype (bf: 1 bfloat16, 0 float32) for E experts of intermediate width I. */
int prelude_moe_experts(int bf, const void *x, int64_t t_n, int64_t ldx, const int64_t *experts, const float *weights,
                        int64_t k, const void *gu_p, const void *dn_p, int64_t e_n, int64_t hidden, int64_t inter,
                        void *out, int64_t ldo, int threads) {
#if HAVE_F32
    if ((bf && !HAVE_BF16) || t_n < 0 || k <= 0 || e_n <= 0 || hidden <= 0 || inter <= 0 || ldx < hidden ||
        ldo < hidden)
        return 1;
    if (t_n == 0) return 0;
    const int64_t s_n = t_n * k;
    for (int64_t s = 0; s < s_n; s++)
        if (experts[s] < 0 || experts[s] >= e_n) return 1;
    const int64_t ib = blocks_of(inter), hb = blocks_of(hidden), i16 = ib * 16;
    const int64_t kh = k_steps(bf, hidden), ki = k_steps(bf, i16), es = bf ? 2 : 4;
    const int64_t gu_e = prelude_moe_packed_gate_up(bf, hidden, inter), dn_e = prelude_moe_packed_down(bf, hidden, inter);
    const int64_t gu_groups = (ib + GU_BLOCKS - 1) / GU_BLOCKS, dn_groups = (hb + DN_BLOCKS - 1) / DN_BLOCKS;

    int64_t *start = calloc((size_t)e_n + 1, sizeof(int64_t)), *rows = malloc((size_t)s_n * sizeof(int64_t));
    int64_t *slot_of = malloc((size_t)s_n * sizeof(int64_t));
    float *rw = malloc((size_t)s_n * sizeof(float));
    void *act = malloc((size_t)(s_n * i16 * es)), *y = malloc((size_t)(s_n * hidden * es));
    Unit *units = malloc((size_t)(e_n * (gu_groups + dn_groups)) * sizeof(Unit));
    /* bf16 rows of odd width read a pair past their end: copied, a zero after each */
    const int pad_x = bf && hidden % 2;
    uint16_t *xp = pad_x ? calloc((size_t)(t_n * (hidden + 1)), 2) : 0;
    int rc = 0;
    if (!start || !rows || !slot_of || !rw || !act || !y || !units || (pad_x && !xp)) {
        rc = 2;
        goto done;
    }
    if (pad_x) {
        for (int64_t t = 0; t < t_n; t++) memcpy(xp + t * (hidden + 1), (const uint16_t *)x + t * ldx, (size_t)hidden * 2);
        x = xp;
        ldx = hidden + 1;
    }
    /* counting sort: each expert's rows in row order, its slots [start[e], start[e + 1]) */
    for (int64_t s = 0; s < s_n; s++) start[experts[s] + 1]++;
    for (int64_t e = 0; e < e_n; e++) start[e + 1] += start[e];
    {
        int64_t *fill = malloc((size_t)e_n * sizeof(int64_t));
        if (!fill) {
            rc = 2;
            goto done;
        }
        memcpy(fill, start, (size_t)e_n * sizeof(int64_t));
        for (int64_t s = 0; s < s_n; s++) {
            const int64_t slot = fill[experts[s]]++;
            rows[slot] = s / k;
            rw[slot] = round1(bf, weights[s]);
            slot_of[s] = slot;
        }
        free(fill);
    }
    /* a row's slots ascending: its experts in ascending order, the order its sums run */
    for (int64_t t = 0; t < t_n; t++) {
        int64_t *v = slot_of + t * k;
        for (int64_t i = 1; i < k; i++)
            for (int64_t j = i; j > 0 && v[j - 1] > v[j]; j--) {
                const int64_t tmp = v[j];
                v[j] = v[j - 1];
                v[j - 1] = tmp;
            }
    }
    int64_t gu_n = 0, dn_n = 0, active = 0;
    for (int64_t e = 0; e < e_n; e++)
        if (start[e + 1] > start[e]) {
            active++;
            for (int64_t g = 0; g < gu_groups; g++) units[gu_n++] = (Unit){e, g};
        }
    Unit *dn_units = units + gu_n;
    for (int64_t e = 0; e < e_n; e++)
        if (start[e + 1] > start[e])
            for (int64_t g = 0; g < dn_groups; g++) dn_units[dn_n++] = (Unit){e, g};
    const int par = threads > 1 && active * (gu_e + dn_e) * 4 >= PAR_MIN_BYTES;
    /* With enough chosen experts a unit is a whole expert (gate/up, then down, on one
     * thread): one wait for the slowest thread a call instead of three. On a shared machine
     * a thread may be off its core for a time slice, and each wait can cost one. */
    const int whole_experts = active >= WHOLE_EXPERTS_PER_THREAD * threads;
#pragma omp parallel num_threads(threads) if (par)
    {
        /* dynamic: a unit's cost follows its expert's row count; which thread runs it does
         * not change a bit of it */
        if (whole_experts) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t a = 0; a < active; a++) {
                const int64_t e = units[a * gu_groups].expert;
                for (int64_t g = 0; g < gu_groups; g++)
                    gate_up_group(bf, x, ldx, start, rows, e, g, gu_p, ib, kh, gu_e, act, i16);
                for (int64_t g = 0; g < dn_groups; g++)
                    down_group(bf, act, i16, start, e, g, dn_p, hb, ki, dn_e, rw, y, hidden);
            }
        } else {
#pragma omp for schedule(dynamic, 1)
            for (int64_t u = 0; u < gu_n; u++)
                gate_up_group(bf, x, ldx, start, rows, units[u].expert, units[u].group, gu_p, ib, kh, gu_e, act, i16);
#pragma omp for schedule(dynamic, 1)
            for (int64_t u = 0; u < dn_n; u++)
                down_group(bf, act, i16, start, dn_units[u].expert, dn_units[u].group, dn_p, hb, ki, dn_e, rw, y, hidden);
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < t_n; t++) {
            const int64_t *v = slot_of + t * k;
            for (int64_t o = 0; o < hidden; o += 16) {
                const int64_t left = hidden - o;
                const __mmask16 keep = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
                __m512 sum = _mm512_setzero_ps();
                for (int64_t j = 0; j < k; j++)
                    sum = round16(bf, _mm512_add_ps(sum, load16(bf, y, v[j] * hidden + o, keep)));
                store16(bf, out, t * ldo + o, sum, keep);
            }
        }
    }
done:
    free(start);
    free(rows);
    free(slot_of);
    free(rw);
    free(act);
    free(y);
    free(units);
    free(xp);
    return rc;
#else
    (void)bf; (void)x; (void)t_n; (void)ldx; (void)experts; (void)weights; (void)k; (void)gu_p; (void)dn_p;
    (void)e_n; (void)hidden; (void)inter; (void)out; (void)ldo; (void)threads;
    return 1;
#endif
}
