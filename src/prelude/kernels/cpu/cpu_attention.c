/* Paged attention on the CPU, reading K/V from the block pool in place (C + OpenMP), and the
 * KV write into the pool. Called through ctypes by model/attention/cpu_backend.py.
 *
 * One call serves a whole forward's rows: prefill rows (new tokens over a cached prefix:
 * chunked prefill with their own K/V already in the pool, or OneShot rows whose own K/V are
 * this forward's k/v tensors) and decode rows (one query over the pool), GQA, float32 or
 * bf16 tensors. The math is float32 inside, softmax online (running max and sum per query,
 * rescaled per key tile) in the log2 domain. The same semantics as the Triton kernels of
 * kernels/triton/attention.py, including the multi-item segment mask.
 *
 * Work items are (row, KV head, query tile); each one loads a key tile once for all the
 * query heads that share its KV head. Two inner forms:
 * - wide (>= WIDE_MIN query vectors in the tile: prefill): queries on the vector lanes.
 *   Q^T [D][M] is built once per item; per key tile, S^T [N][M] = K Q^T, softmax and
 *   acc^T [D][M] += V^T P^T are vertical vector ops (no horizontal sums), register-blocked
 *   4 keys (or 4 head dims) x up to 4 query vectors. A key tile skips the item's query
 *   vectors whose queries all come before its first key (a fresh 128-token prompt: a quarter
 *   to a third of its float32 tiles' work).
 * - narrow (decode, tiny chunks): head_dim on the lanes, one dot product per (query, key).
 * With AMX-BF16, bf16 items of either kind take the AMX form of the wide one (below).
 *
 * Built with -march=native (native_lib.py keys the cached library by this CPU's ISA flags);
 * GCC's vector extensions compile to whatever width the host has (AVX-512: 16 lanes, else 8).
 * Any head_dim works (no multiple of the vector width needed).
 */
#include "prelude_kernels.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#include "native_shared.h"

#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));
typedef float vfu __attribute__((vector_size(VW * 4), aligned(4)));

#define NK 16        /* keys per tile */
#define MAX_M 128    /* query vectors (query tokens x heads of a group) per wide item */
#define WIDE_MIN 12  /* fewer query vectors than this: the narrow form */
/* prelude_paged_attention's options */
#define OPT_AMX 1 /* bf16 items on AMX tiles where this CPU has them */
/* Every item in the wide form, decode rows and short prefill rows too (batch invariance:
 * the two forms sum in different orders, so a token would come out of either by how much of
 * its prompt the prefix cache held, or whether a block it reuses was written by a decode
 * step or by a prompt; how a row splits into items does not move bits). */
#define OPT_ALL_WIDE 2
/* The float32 wide form's query vectors (of VW lanes) per register block: 4 keys (or head
 * dims) x CB vectors of accumulators, CB query vectors and a broadcast must fit the vector
 * registers. AVX-512's 32 take 4 (and blocks of 6 below); AVX2's 16 take 3, where 4 spilled
 * (21 live, and 3 ran much faster; the sums are the same, in the same order) */
#if defined(__AVX512F__)
#define CB 4
#else
#define CB 3
#endif
#define PASTE_(a, b) a##_##b
#define PASTE(a, b) PASTE_(a, b) /* PASTE(qk_block, CB): qk_block_4 or qk_block_3 */
#define NKB 64       /* keys per tile of the bf16 forms (pairs of keys feed the bf16 dot product) */
#ifndef MAX_M_BF16
#define MAX_M_BF16 96 /* query vectors per wide item of the bf16 forms: 6 vectors, 2 blocks of 3 */
#endif
#define KT_MAX 64    /* the larger of NK and NKB */
#define LAZY_LOG2 8.0f /* how far (log2) a tile max may pass the reference max before a rescale */

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define HAVE_DPBF16 1
#else
#define HAVE_DPBF16 0
#endif
#if HAVE_DPBF16 && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512DQ__) /* DQ: vreduceps */
#define HAVE_AMX 1
#else
#define HAVE_AMX 0
#endif
#ifndef MAX_M_AMX
#define MAX_M_AMX 192 /* query vectors per wide item of the AMX form */
#endif

static inline vf vsplat(float x) { return (vf){0} + x; }
/* A broadcast of *p for the float32 QK/PV blocks. AVX2: one load-broadcast (vbroadcastss
 * from memory) in place of vsplat's add and register broadcast, faster on the AVX2 build's
 * judge and free-model shapes; AVX-512 gains nothing from it, and keeps vsplat. */
#if defined(__AVX512F__)
static inline vf vbcast(const float *p) { return vsplat(*p); }
#else
static inline vf vbcast(const float *p) { return (vf)_mm256_broadcast_ss(p); }
#endif
static inline vf vsel(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); }
/* One max instruction (the compare-and-select above compiles to a 3-op chain); b when
 * either is NaN, as the select would give. */
#if defined(__AVX512F__)
static inline vf vmax(vf a, vf b) { return (vf)_mm512_max_ps((__m512)a, (__m512)b); }
#else
static inline vf vmax(vf a, vf b) { return (vf)_mm256_max_ps((__m256)a, (__m256)b); }
#endif

/* 2^x for x <= 0 (and -inf -> 0): round to the nearest integer n, a degree-6 Taylor
 * polynomial for 2^f on |f| <= 0.5 (rel. error ~1e-7), then times 2^n (AVX-512: vscalefps,
 * else n added to the exponent bits). */
static inline vf exp2_poly(vf f) {
    vf p = vsplat(1.5403530393381606e-4f);
    p = p * f + 1.3333558146428443e-3f;
    p = p * f + 9.6181291076284772e-3f;
    p = p * f + 5.5504108664821580e-2f;
    p = p * f + 2.4022650695910071e-1f;
    p = p * f + 6.9314718055994531e-1f;
    return p * f + 1.0f;
}

/* The same to degree 4 (rel. error <= 4.2e-5 on |f| <= 0.5: a hundredth of bf16's rounding). */
static inline vf exp2_poly4(vf f) {
    vf p = vsplat(9.6181291076284772e-3f);
    p = p * f + 5.5504108664821580e-2f;
    p = p * f + 2.4022650695910071e-1f;
    p = p * f + 6.9314718055994531e-1f;
    return p * f + 1.0f;
}

#if defined(__AVX512F__)
/* 2^(n + f) = p(f) * 2^n; short: the degree-4 polynomial (exp2v_bf16). */
static inline vf exp2v_with(vf x, int short_poly) {
    const __m512 xm = (__m512)x;
    const __mmask16 keep = _mm512_cmp_ps_mask(xm, _mm512_set1_ps(-INFINITY), _CMP_GT_OQ);
    const __m512 xc = _mm512_max_ps(xm, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const vf f = (vf)_mm512_sub_ps(xc, n);
    const vf p = short_poly ? exp2_poly4(f) : exp2_poly(f);
    return (vf)_mm512_maskz_scalef_ps(keep, (__m512)p, n);
}
static inline vf exp2v(vf x) { return exp2v_with(x, 0); }
/* 2^x for the probabilities rounded to bf16 (8 significant bits). */
static inline vf exp2v_bf16(vf x) { return exp2v_with(x, 1); }
#else
static inline vf exp2v(vf x) {
    const vf lo = vsplat(-126.0f), magic = vsplat(12582912.0f); /* 1.5 * 2^23 */
    vi keep = x > vsplat(-INFINITY);
    vf xc = vmax(x, lo);
    vf big = xc + magic;
    vf n = big - magic;
    vf p = exp2_poly(xc - n);
    vi e = ((vi)big - (vi)magic) << 23;
    return (vf)(((vi)p + e) & keep);
}
#endif


static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* n values (float32 or bf16 at `src`) as float32, zero-padded to `padded`. */
static inline void load_row(const void *src, int bf16, int64_t n, int64_t padded, float *dst) {
    if (bf16) {
        const uint16_t *s = (const uint16_t *)src;
#pragma omp simd
        for (int64_t d = 0; d < n; d++) dst[d] = bf16_to_f32(s[d]);
    } else {
        memcpy(dst, src, (size_t)n * 4);
    }
    for (int64_t d = n; d < padded; d++) dst[d] = 0.0f;
}

typedef struct {
    /* tensors (element strides; the last dimension is contiguous) */
    const char *q, *k, *v, *kc, *vc;
    int64_t sqt, sqh, skt, skh, svt, svh, scb, scs, sch;
    char *out;
    int64_t sot, soh;
    const int64_t *segments; /* [T] or NULL */
    int64_t block_size, heads, kv_heads, group, d, dp; /* dp: d rounded up to 4 */
    float qscale;                                       /* softmax scale * log2(e) */
    int bf16;
    int64_t esize;
    int all_wide; /* OPT_ALL_WIDE: also one exponent for every tile (softmax_pairs_onepass) */
    int64_t window; /* > 0: a query at p sees keys above p - window only (a sliding layer); 0: all */
} Ctx;

typedef struct {
    int64_t q0;          /* flattened index of the row's first new token */
    int64_t q_len, ctx;  /* new tokens; tokens with K/V after this step */
    int64_t own;         /* 1: the new tokens' K/V are in the pool; 0: in k/v */
    const int64_t *table;
    int64_t kv_head, m0, mq; /* KV head; first query (within the row) and count */
} Item;

/* The first key any query of the item sees: with a window, the first query's window start.
 * The tile loops start there, so keys before it are never read: a sliding layer's block
 * table may hold released entries (negative) for blocks wholly before it. */
static inline int64_t kv_begin(const Ctx *c, const Item *it) {
    const int64_t first = it->ctx - it->q_len + it->m0 - c->window + 1;
    return c->window > 0 && first > 0 ? first : 0;
}

/* Whether some query of the item does not see key p0 for the window (its tile needs the mask). */
static inline int window_cuts(const Ctx *c, const Item *it, int64_t p0) {
    return c->window > 0 && p0 + c->window <= it->ctx - it->q_len + it->m0 + it->mq - 1;
}

typedef struct {
    float *qt, *s, *acc, *kf, *vf, *m, *l;
    int32_t *qpos, *qseg;
    uint32_t *qp, *pp, *vt; /* the bf16 forms' pair-packed Q, P and V (see below) */
    float *tmax;            /* the bf16 wide form: a full unmasked tile's max per query lane */
    uint16_t *kpad, *zero;  /* K rows padded to an even head_dim; a zero row */
    uint16_t *kb;           /* the AMX form: a key tile's K rows, zero-padded to a multiple of 32 */
    int64_t kseg[KT_MAX];
} Scratch;

/* Pointer to the K (or V) of sequence position p of an item's row, KV head h. */
/* Pointers to the K and V of sequence positions p0 .. p0+n-1 of an item's row, KV head
 * kv_head: the pool through the block table below cache_end, the forward's k/v after it.
 * One division per tile (the block and offset then advance by one). */
static inline void tile_ptrs(const Ctx *c, const Item *it, int64_t p0, int64_t n, int64_t cache_end,
                             const char **kp, const char **vp) {
    const int64_t prefix = it->ctx - it->q_len, head = it->kv_head * c->sch;
    int64_t blk = p0 / c->block_size, off = p0 % c->block_size;
    for (int64_t j = 0; j < n; j++) {
        const int64_t p = p0 + j;
        if (p < cache_end) {
            const int64_t at = (it->table[blk] * c->scb + off * c->scs + head) * c->esize;
            kp[j] = c->kc + at;
            vp[j] = c->vc + at;
        } else {
            const int64_t tok = it->q0 + (p - prefix);
            kp[j] = c->k + (tok * c->skt + it->kv_head * c->skh) * c->esize;
            vp[j] = c->v + (tok * c->svt + it->kv_head * c->svh) * c->esize;
        }
        if (++off == c->block_size) {
            off = 0;
            blk++;
        }
    }
}

static inline void load_tile(const Ctx *c, const Item *it, Scratch *s, int64_t p0, int64_t n, int64_t cache_end) {
    int64_t prefix = it->ctx - it->q_len;
    const char *kp[NK], *vp[NK];
    tile_ptrs(c, it, p0, n, cache_end, kp, vp);
    for (int64_t j = 0; j < NK; j++) {
        if (j < n) {
            int64_t p = p0 + j;
            load_row(kp[j], c->bf16, c->d, c->dp, s->kf + j * c->dp);
            load_row(vp[j], c->bf16, c->d, c->dp, s->vf + j * c->dp);
            s->kseg[j] = (c->segments && p >= prefix) ? c->segments[it->q0 + (p - prefix)] : 0;
        } else { /* rows past the tile's end: zeros, their scores are masked */
            memset(s->kf + j * c->dp, 0, (size_t)c->dp * 4);
            memset(s->vf + j * c->dp, 0, (size_t)c->dp * 4);
            s->kseg[j] = 0;
        }
    }
}

/* Lane i of an item is its query token m0 + i / g (of the row starting at q0) under head
 * kv_head * g + i % g: that lane's Q row and output row. */
static inline const char *lane_q(const Ctx *c, const Item *it, int64_t i) {
    return c->q + ((it->q0 + it->m0 + i / c->group) * c->sqt + (it->kv_head * c->group + i % c->group) * c->sqh) *
                      c->esize;
}

static inline char *lane_out(const Ctx *c, const Item *it, int64_t i) {
    return c->out + ((it->q0 + it->m0 + i / c->group) * c->sot + (it->kv_head * c->group + i % c->group) * c->soh) *
                        c->esize;
}

static inline void store_out(const Ctx *c, const Item *it, int64_t i, const float *src) {
    char *dst = lane_out(c, it, i);
    if (c->bf16) {
        uint16_t *o = (uint16_t *)dst;
        for (int64_t d = 0; d < c->d; d++) o[d] = f32_to_bf16(src[d]);
    } else {
        memcpy(dst, src, (size_t)c->d * 4);
    }
}

/* ---- wide form: query vectors on the lanes ------------------------------------------- */

/* S^T[j][cv] = sum_d kf[j][d] * qt[d][cv] for 4 keys and NC query vectors. */
#define QK_BLOCK(NC)                                                                              \
    static inline void qk_block_##NC(const float *kf, int64_t dp, int64_t d, const float *qt,   \
                                     int64_t mp, float *st) {                                     \
        vf a[4][NC];                                                                              \
        for (int jj = 0; jj < 4; jj++)                                                            \
            for (int cc = 0; cc < NC; cc++) a[jj][cc] = vsplat(0.0f);                             \
        for (int64_t x = 0; x < d; x++) {                                                         \
            vf qv[NC];                                                                            \
            for (int cc = 0; cc < NC; cc++) qv[cc] = *(const vf *)(qt + x * mp + cc * VW);        \
            for (int jj = 0; jj < 4; jj++) {                                                      \
                vf kb = vbcast(&kf[jj * dp + x]);                                                  \
                for (int cc = 0; cc < NC; cc++) a[jj][cc] += kb * qv[cc];                         \
            }                                                                                     \
        }                                                                                         \
        for (int jj = 0; jj < 4; jj++)                                                            \
            for (int cc = 0; cc < NC; cc++) *(vf *)(st + jj * mp + cc * VW) = a[jj][cc];          \
    }
QK_BLOCK(1)
QK_BLOCK(2)
QK_BLOCK(3)
QK_BLOCK(4)
#if defined(__AVX512F__)
QK_BLOCK(6) /* 24 accumulators: fits AVX-512's 32 registers (AVX2's 16 would spill) */
#endif

/* acc^T[x][cv] += sum_j vf[j][x] * P^T[j][cv] for 4 head dims and NC query vectors. */
#define PV_BLOCK(NC)                                                                              \
    static inline void pv_block_##NC(const float *vfm, int64_t dp, int64_t n, const float *pt,  \
                                     int64_t mp, float *acc) {                                    \
        vf a[4][NC];                                                                              \
        for (int xx = 0; xx < 4; xx++)                                                            \
            for (int cc = 0; cc < NC; cc++) a[xx][cc] = *(const vf *)(acc + xx * mp + cc * VW);   \
        for (int64_t j = 0; j < n; j++) {                                                         \
            vf pv[NC];                                                                            \
            for (int cc = 0; cc < NC; cc++) pv[cc] = *(const vf *)(pt + j * mp + cc * VW);        \
            for (int xx = 0; xx < 4; xx++) {                                                      \
                vf vb = vbcast(&vfm[j * dp + xx]);                                                 \
                for (int cc = 0; cc < NC; cc++) a[xx][cc] += vb * pv[cc];                         \
            }                                                                                     \
        }                                                                                         \
        for (int xx = 0; xx < 4; xx++)                                                            \
            for (int cc = 0; cc < NC; cc++) *(vf *)(acc + xx * mp + cc * VW) = a[xx][cc];         \
    }
PV_BLOCK(1)
PV_BLOCK(2)
PV_BLOCK(3)
PV_BLOCK(4)
#if defined(__AVX512F__)
PV_BLOCK(6)
#endif

/* ---- online softmax over one key tile, queries on the lanes ----------------------------
 * S^T [n][mp] holds the raw scores; `scale` (> 0) turns them into the log2 domain, so the
 * raw scores' max, scaled, is the scaled scores' max and each exponent is one FMA,
 * s * scale - m (exact for scale 1). Padding lanes (past the item's queries) see zero
 * scores and are never stored, so they need no mask. */

/* The visible part of score row j of query vector cv (-inf elsewhere); masked: apply the
 * causal and segment masks (a tile wholly before the item's first query with no segments
 * needs none). Writes the masked row back for the exponent pass. */
static inline vf masked_scores(const Ctx *c, Scratch *s, int64_t p0, int64_t j, int64_t cv, int64_t mp, int masked,
                               vi qpos, vi qseg) {
    vf sv = *(vf *)(s->s + j * mp + cv * VW);
    if (masked) {
        vi vis = qpos >= (int32_t)(p0 + j);
        if (c->window > 0) vis &= qpos < (int32_t)(p0 + j + c->window);
        if (c->segments) {
            int32_t ks = (int32_t)s->kseg[j];
            vis &= (ks == 0) ? (vi){0} - 1 : (qseg == ks);
        }
        sv = vsel(vis, sv, vsplat(-INFINITY));
        *(vf *)(s->s + j * mp + cv * VW) = sv;
    }
    return sv;
}

/* The tile's max score of each lane of query vector cv, scaled (two chains: the max's
 * latency; two named accumulators, not an array, so they stay in registers). */
static inline vf tile_max(const Ctx *c, Scratch *s, int64_t p0, int64_t n, int64_t cv, int64_t mp, int masked,
                          float scale) {
    const vi qpos = *(const vi *)(s->qpos + cv * VW), qseg = *(const vi *)(s->qseg + cv * VW);
    vf m0 = vsplat(-INFINITY), m1 = vsplat(-INFINITY);
    int64_t j = 0;
    for (; j + 2 <= n; j += 2) {
        m0 = vmax(m0, masked_scores(c, s, p0, j, cv, mp, masked, qpos, qseg));
        m1 = vmax(m1, masked_scores(c, s, p0, j + 1, cv, mp, masked, qpos, qseg));
    }
    if (j < n) m0 = vmax(m0, masked_scores(c, s, p0, j, cv, mp, masked, qpos, qseg));
    return vmax(m0, m1) * vsplat(scale);
}

/* Lazy rescaling: a lane's reference max m moves only when a tile's max passes it by more
 * than LAZY_LOG2 (so every p <= 2^LAZY_LOG2, far inside float32 and bf16 range); the first
 * visible tile sets it. With the exact running max the accumulator was rescaled on about
 * every other tile; once set, m rarely moves. Updates m; returns the exponents' offset
 * (m, 0 where no key was visible yet) and *alpha, the factor for l and the accumulator. */
static inline vf lazy_max(Scratch *s, int64_t cv, vf m_tile, vf *alpha, int *rescale) {
    const vf m_old = *(vf *)(s->m + cv * VW);
    const vi grow = m_tile > m_old + LAZY_LOG2;
    const vf m_new = vsel(grow, m_tile, m_old);
    const vf m_safe = vsel(m_new == vsplat(-INFINITY), vsplat(0.0f), m_new);
    *alpha = vsel(grow, exp2v(m_old - m_safe), vsplat(1.0f));
    *(vf *)(s->m + cv * VW) = m_new;
    /* lanes with no visible key before hold a zero accumulator: only moved lanes with an
     * earlier max need the rescale */
    const vi moved = grow & (m_old > vsplat(-INFINITY));
    int any = 0;
    for (int i = 0; i < VW; i++) any |= moved[i] != 0;
    *rescale = any;
    return m_safe;
}

static inline void finish_tile(Scratch *s, int64_t cv, int64_t mp, vf alpha, int rescale, vf sum, int64_t rows) {
    *(vf *)(s->l + cv * VW) = *(vf *)(s->l + cv * VW) * alpha + sum;
    if (rescale)
        for (int64_t x = 0; x < rows; x++) *(vf *)(s->acc + x * mp + cv * VW) *= alpha;
}

/* The float32 forms: S^T becomes P^T in place; l and the accumulator acc^T [rows][mp] follow. */
static inline void softmax_tile(const Ctx *c, Scratch *s, int64_t p0, int64_t n, int64_t cv0, int64_t nvec,
                                int64_t mp, int masked, float scale, int64_t rows) {
    const vf vscale = vsplat(scale);
    for (int64_t cv = cv0; cv < nvec; cv++) {
        vf alpha;
        int rescale;
        const vf m = lazy_max(s, cv, tile_max(c, s, p0, n, cv, mp, masked, scale), &alpha, &rescale);
        vf sums[2] = {vsplat(0.0f), vsplat(0.0f)};
        for (int64_t j = 0; j < n; j++) {
            vf p = exp2v(*(vf *)(s->s + j * mp + cv * VW) * vscale - m);
            *(vf *)(s->s + j * mp + cv * VW) = p;
            sums[j & 1] += p;
        }
        finish_tile(s, cv, mp, alpha, rescale, sums[0] + sums[1], rows);
    }
}

/* Causal skipping: query vectors before the first one returned see no key at or after p0
 * (their lanes' positions, ascending, all < p0), so a tile from p0 on leaves their m, l and
 * accumulators as they are and is not computed for them. `from`: the previous tile's
 * answer (p0 only grows). */
static inline int64_t first_seeing(const Scratch *s, int64_t from, int64_t nvec, int64_t nm, int64_t p0) {
    int64_t cv = from;
    while (cv < nvec) {
        const int64_t last = (cv + 1) * VW < nm ? (cv + 1) * VW - 1 : nm - 1; /* the vector's last real lane */
        if (s->qpos[last] >= p0) break;
        cv++;
    }
    return cv;
}

/* ---- in-register transposes of VW x VW blocks of 32-bit elements: r[k][j] becomes r[j][k] ---- */
#if defined(__AVX512F__) /* transpose16: native_shared.h */
static inline void transpose_vw(vf r[VW]) { transpose16((__m512i *)r); }
#else
static inline void transpose_vw(vf r[VW]) { /* 8 x 8: pairs, quads, then 128-bit halves */
    __m256 t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps((__m256)r[2 * i], (__m256)r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps((__m256)r[2 * i], (__m256)r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = (vf)_mm256_permute2f128_ps(u[i], u[4 + i], 0x20);
        r[4 + i] = (vf)_mm256_permute2f128_ps(u[i], u[4 + i], 0x31);
    }
}
#endif

/* The float32 wide form's Q^T, scaled: qt[x][i] = q(lane i)[x] * qscale for x < d, zero on
 * lanes past nm; VW lanes x VW dims a transpose (element by element, the strided stores and
 * the output's strided loads below were a fifth of a fresh prompt's attention, ~0.15 of the
 * default model's 512-token prefill). */
static inline void build_qt_f32(const Ctx *c, const Item *it, int64_t nm, int64_t mp, float *qt) {
    const int64_t d = c->d;
    const vf scale = vsplat(c->qscale);
    for (int64_t i0 = 0; i0 < mp; i0 += VW) {
        const float *rows[VW];
        for (int64_t k = 0; k < VW; k++) {
            const int64_t i = i0 + k;
            rows[k] = i < nm ? (const float *)lane_q(c, it, i) : NULL;
        }
        for (int64_t x0 = 0; x0 < d; x0 += VW) {
            const int64_t left = d - x0 < VW ? d - x0 : VW;
            vf r[VW];
            for (int k = 0; k < VW; k++) {
                if (!rows[k]) {
                    r[k] = vsplat(0.0f);
                } else if (left == VW) {
                    r[k] = *(const vfu *)(rows[k] + x0);
                } else {
                    float part[VW] __attribute__((aligned(64))) = {0};
                    memcpy(part, rows[k] + x0, (size_t)left * 4);
                    r[k] = *(const vf *)part;
                }
            }
            transpose_vw(r);
            for (int64_t k = 0; k < left; k++) *(vf *)(qt + (x0 + k) * mp + i0) = r[k] * scale;
        }
    }
}

/* The float32 wide form's outputs from acc^T [dp][mp] and l: each query lane's row acc / l
 * (0 where no key was visible), VW x VW a transpose. */
static inline void store_out_f32(const Ctx *c, const Item *it, const Scratch *s, int64_t nm, int64_t mp) {
    const int64_t d = c->d, dp = c->dp;
    for (int64_t i0 = 0; i0 < nm; i0 += VW) {
        float inv[VW];
        for (int64_t k = 0; k < VW; k++) inv[k] = s->l[i0 + k] == 0.0f ? 0.0f : 1.0f / s->l[i0 + k];
        for (int64_t x0 = 0; x0 < d; x0 += VW) {
            const int64_t left = d - x0 < VW ? d - x0 : VW;
            vf r[VW];
            for (int64_t k = 0; k < VW; k++)
                r[k] = x0 + k < dp ? *(const vf *)(s->acc + (x0 + k) * mp + i0) : vsplat(0.0f);
            transpose_vw(r);
            for (int64_t k = 0; k < VW && i0 + k < nm; k++) {
                const int64_t i = i0 + k;
                float *o = (float *)lane_out(c, it, i);
                const vf v = r[k] * inv[k];
                if (left == VW) *(vfu *)(o + x0) = v;
                else memcpy(o + x0, &v, (size_t)left * 4);
            }
        }
    }
}

static void wide_item(const Ctx *c, const Item *it, Scratch *s) {
    const int64_t g = c->group, nm = it->mq * g, nvec = (nm + VW - 1) / VW, mp = nvec * VW;
    const int64_t d = c->d, dp = c->dp, prefix = it->ctx - it->q_len;
    /* Q^T, scaled; lane i is query token m0 + i / g, head kv_head * g + i % g */
    float row[4096];
    if (!c->bf16) {
        build_qt_f32(c, it, nm, mp, s->qt);
    } else {
        memset(s->qt, 0, (size_t)(d * mp) * 4);
        for (int64_t i = 0; i < nm; i++) {
            load_row(lane_q(c, it, i), c->bf16, d, d, row);
            for (int64_t x = 0; x < d; x++) s->qt[x * mp + i] = row[x] * c->qscale;
        }
    }
    for (int64_t i = 0; i < mp; i++) {
        s->qpos[i] = i < nm ? (int32_t)(prefix + it->m0 + i / g) : -1; /* padding sees nothing */
        s->qseg[i] = (i < nm && c->segments) ? (int32_t)c->segments[it->q0 + it->m0 + i / g] : 0;
        s->m[i] = -INFINITY;
        s->l[i] = 0.0f;
    }
    memset(s->acc, 0, (size_t)(dp * mp) * 4);

    const int64_t kv_end = it->ctx < prefix + it->m0 + it->mq ? it->ctx : prefix + it->m0 + it->mq;
    const int64_t cache_end = it->own ? kv_end : (prefix < kv_end ? prefix : kv_end);
    const int64_t first_q = prefix + it->m0;
    int64_t cv0 = 0;
    for (int64_t p0 = kv_begin(c, it); p0 < kv_end; p0 += NK) {
        const int64_t n = kv_end - p0 < NK ? kv_end - p0 : NK;
        cv0 = first_seeing(s, cv0, nvec, nm, p0);
        load_tile(c, it, s, p0, n, cache_end);
        for (int64_t j = 0; j < NK; j += 4) {
            int64_t cv = cv0;
#if defined(__AVX512F__) /* 6 vectors a block: the float32 judge's items (96 lanes) faster than 4 + 2 */
            for (; cv + 6 <= nvec; cv += 6) qk_block_6(s->kf + j * dp, dp, d, s->qt + cv * VW, mp, s->s + j * mp + cv * VW);
#endif
            for (; cv + CB <= nvec; cv += CB)
                PASTE(qk_block, CB)(s->kf + j * dp, dp, d, s->qt + cv * VW, mp, s->s + j * mp + cv * VW);
            switch (nvec - cv) {
                case 3: qk_block_3(s->kf + j * dp, dp, d, s->qt + cv * VW, mp, s->s + j * mp + cv * VW); break;
                case 2: qk_block_2(s->kf + j * dp, dp, d, s->qt + cv * VW, mp, s->s + j * mp + cv * VW); break;
                case 1: qk_block_1(s->kf + j * dp, dp, d, s->qt + cv * VW, mp, s->s + j * mp + cv * VW); break;
            }
        }
        softmax_tile(c, s, p0, n, cv0, nvec, mp, p0 + n - 1 > first_q || c->segments || window_cuts(c, it, p0), 1.0f,
                     dp);
        for (int64_t x = 0; x < dp; x += 4) {
            int64_t cv = cv0;
#if defined(__AVX512F__)
            for (; cv + 6 <= nvec; cv += 6) pv_block_6(s->vf + x, dp, n, s->s + cv * VW, mp, s->acc + x * mp + cv * VW);
#endif
            for (; cv + CB <= nvec; cv += CB)
                PASTE(pv_block, CB)(s->vf + x, dp, n, s->s + cv * VW, mp, s->acc + x * mp + cv * VW);
            switch (nvec - cv) {
                case 3: pv_block_3(s->vf + x, dp, n, s->s + cv * VW, mp, s->acc + x * mp + cv * VW); break;
                case 2: pv_block_2(s->vf + x, dp, n, s->s + cv * VW, mp, s->acc + x * mp + cv * VW); break;
                case 1: pv_block_1(s->vf + x, dp, n, s->s + cv * VW, mp, s->acc + x * mp + cv * VW); break;
            }
        }
    }
    if (!c->bf16) {
        store_out_f32(c, it, s, nm, mp);
        return;
    }
    for (int64_t i = 0; i < nm; i++) {
        float inv = s->l[i] == 0.0f ? 0.0f : 1.0f / s->l[i];
        for (int64_t x = 0; x < d; x++) row[x] = s->acc[x * mp + i] * inv;
        store_out(c, it, i, row);
    }
}

/* ---- narrow form: head_dim on the lanes -------------------------------------------- */

static void narrow_item(const Ctx *c, const Item *it, Scratch *s) {
    const int64_t g = c->group, nm = it->mq * g, d = c->d, dp = c->dp, prefix = it->ctx - it->q_len;
    float *qs = s->qt, *acc = s->acc, *sc = s->s; /* [nm][dp], [nm][dp], [nm][NK] */
    for (int64_t i = 0; i < nm; i++) {
        load_row(lane_q(c, it, i), c->bf16, d, dp, qs + i * dp);
        for (int64_t x = 0; x < dp; x++) qs[i * dp + x] *= c->qscale;
        memset(acc + i * dp, 0, (size_t)dp * 4);
        s->m[i] = -INFINITY;
        s->l[i] = 0.0f;
        s->qpos[i] = (int32_t)(prefix + it->m0 + i / g);
        s->qseg[i] = c->segments ? (int32_t)c->segments[it->q0 + it->m0 + i / g] : 0;
    }
    const int64_t kv_end = it->ctx < prefix + it->m0 + it->mq ? it->ctx : prefix + it->m0 + it->mq;
    const int64_t cache_end = it->own ? kv_end : (prefix < kv_end ? prefix : kv_end);
    for (int64_t p0 = kv_begin(c, it); p0 < kv_end; p0 += NK) {
        const int64_t n = kv_end - p0 < NK ? kv_end - p0 : NK;
        load_tile(c, it, s, p0, n, cache_end);
        for (int64_t i = 0; i < nm; i++) {
            const float *qi = qs + i * dp;
            float *si = sc + i * NK;
            for (int64_t j = 0; j < n; j++) {
                const float *kj = s->kf + j * dp;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t x = 0; x < dp; x++) dot += qi[x] * kj[x];
                int visible = p0 + j <= s->qpos[i] && (c->window <= 0 || p0 + j + c->window > s->qpos[i]) &&
                              (s->kseg[j] == 0 || s->kseg[j] == s->qseg[i]);
                si[j] = visible ? dot : -INFINITY;
            }
            float mx = -INFINITY;
            for (int64_t j = 0; j < n; j++) mx = si[j] > mx ? si[j] : mx;
            float m_new = s->m[i] > mx ? s->m[i] : mx;
            float m_safe = m_new == -INFINITY ? 0.0f : m_new;
            float buf[NK] __attribute__((aligned(64)));
            for (int64_t j = 0; j < NK; j++) buf[j] = j < n ? si[j] - m_safe : -INFINITY;
            for (int64_t j = 0; j < NK; j += VW) *(vf *)(buf + j) = exp2v(*(vf *)(buf + j));
            float alpha = s->m[i] == -INFINITY ? 0.0f : exp2v(vsplat(s->m[i] - m_safe))[0];
            float sum = 0.0f;
            for (int64_t j = 0; j < n; j++) sum += buf[j];
            s->m[i] = m_new;
            s->l[i] = s->l[i] * alpha + sum;
            float *ai = acc + i * dp;
#pragma omp simd
            for (int64_t x = 0; x < dp; x++) ai[x] *= alpha;
            for (int64_t j = 0; j < n; j++) {
                const float pj = buf[j], *vj = s->vf + j * dp;
#pragma omp simd
                for (int64_t x = 0; x < dp; x++) ai[x] += pj * vj[x];
            }
        }
    }
    for (int64_t i = 0; i < nm; i++) {
        float inv = s->l[i] == 0.0f ? 0.0f : 1.0f / s->l[i];
        for (int64_t x = 0; x < d; x++) acc[i * dp + x] *= inv;
        store_out(c, it, i, acc + i * dp);
    }
}

#if HAVE_DPBF16
/* ---- bf16 forms (AVX512-BF16): the products on vdpbf16ps, bf16 pairs in, float32 sums ---
 *
 * vdpbf16ps adds a.lo * b.lo + a.hi * b.hi of each lane's 32-bit pair of bf16 to a float32
 * lane, so both operands are laid out in pairs along the summed dimension:
 * - Q·K^T sums over head_dim: a K row's adjacent (d, d+1) elements are already a pair, read
 *   in place from the pool (broadcast); Q^T is packed once per item as qp [d/2][mp] pairs.
 * - P·V sums over keys: P (float32 after the softmax) is rounded to bf16 into pairs of keys,
 *   pp [NKB/2][mp] (queries on the lanes), as flash-attention kernels do; V is interleaved
 *   per key pair, vt [NKB/2][dv] (head_dim on the lanes), once per tile.
 * Scores, the softmax and the accumulators stay float32. Q is not pre-scaled (it would
 * round twice): the scale multiplies the float32 scores. */

/* V rows 2jp and 2jp+1 of the tile (zero rows past n) interleaved: vt[jp*dv + x] holds
 * (V[2jp][x], V[2jp+1][x]); x past d is zero. dv: d rounded up to 32. */
static inline void pack_v_pairs(const uint16_t *const *vr, int64_t n, int64_t d, int64_t dv, uint32_t *vt) {
    const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                                            6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
    for (int64_t jp = 0; jp < (n + 1) / 2; jp++) {
        const uint16_t *r0 = vr[2 * jp], *r1 = vr[2 * jp + 1];
        for (int64_t x0 = 0; x0 < dv; x0 += 32) {
            const int64_t left = d - x0;
            const __mmask32 mask = left >= 32 ? 0xffffffffu : left <= 0 ? 0u : (__mmask32)((1u << left) - 1u);
            const __m512i a = _mm512_maskz_loadu_epi16(mask, r0 + x0), b = _mm512_maskz_loadu_epi16(mask, r1 + x0);
            _mm512_storeu_si512(vt + jp * dv + x0, _mm512_permutex2var_epi16(a, lo_idx, b));
            _mm512_storeu_si512(vt + jp * dv + x0 + 16, _mm512_permutex2var_epi16(a, hi_idx, b));
        }
    }
}

/* The tile's K and V row pointers (zero rows from n up to the next multiple of 16: the
 * wide form reads keys in blocks of 8 and V in pairs, the narrow form 16 keys), and the
 * keys' segment ids; with an odd head_dim the K rows are copied with a zero pad so that
 * every pair is in bounds. */
static inline void tile_rows_bf16(const Ctx *c, const Item *it, Scratch *s, int64_t p0, int64_t n, int64_t cache_end,
                                  const uint16_t **kr, const uint16_t **vr) {
    const int64_t prefix = it->ctx - it->q_len, dh = (c->d + 1) / 2;
    tile_ptrs(c, it, p0, n, cache_end, (const char **)kr, (const char **)vr);
    for (int64_t j = 0; j < (n + 15) / 16 * 16; j++) {
        if (j < n) {
            const int64_t p = p0 + j;
            s->kseg[j] = (c->segments && p >= prefix) ? c->segments[it->q0 + (p - prefix)] : 0;
            if (c->d & 1) {
                uint16_t *dst = s->kpad + j * 2 * dh;
                memcpy(dst, kr[j], (size_t)c->d * 2);
                dst[c->d] = 0;
                kr[j] = dst;
            }
        } else {
            kr[j] = vr[j] = s->zero;
            s->kseg[j] = 0;
        }
    }
}

static inline __m512 bcast_pair(const uint16_t *p) {
    uint32_t u;
    memcpy(&u, p, 4);
    return (__m512)_mm512_set1_epi32((int)u);
}

/* S^T[j][cv] = sum_t K[j] pair t . qp[t][cv] for KB keys and NC query vectors; with `mx`
 * (a full, unmasked tile), each query vector's max over the KB keys also goes into mx[cv]. */
#define QK_BF16(KB, NC)                                                                           \
    static inline void qk_bf16_##KB##_##NC(const uint16_t *const *kr, int64_t dh, const uint32_t *qp, \
                                           int64_t mp, float *st, float *mx) {                    \
        __m512 a[KB][NC];                                                                         \
        for (int jj = 0; jj < KB; jj++)                                                           \
            for (int cc = 0; cc < NC; cc++) a[jj][cc] = _mm512_setzero_ps();                      \
        for (int64_t t = 0; t < dh; t++) {                                                        \
            __m512bh qv[NC];                                                                      \
            for (int cc = 0; cc < NC; cc++)                                                       \
                qv[cc] = (__m512bh)_mm512_loadu_si512(qp + t * mp + cc * 16);                      \
            for (int jj = 0; jj < KB; jj++) {                                                     \
                __m512bh kb = (__m512bh)bcast_pair(kr[jj] + 2 * t);                               \
                for (int cc = 0; cc < NC; cc++) a[jj][cc] = _mm512_dpbf16_ps(a[jj][cc], kb, qv[cc]); \
            }                                                                                     \
        }                                                                                         \
        for (int jj = 0; jj < KB; jj++)                                                           \
            for (int cc = 0; cc < NC; cc++) _mm512_storeu_ps(st + jj * mp + cc * 16, a[jj][cc]);  \
        if (mx)                                                                                   \
            for (int cc = 0; cc < NC; cc++) {                                                     \
                __m512 m = _mm512_loadu_ps(mx + cc * 16);                                         \
                for (int jj = 0; jj < KB; jj++) m = _mm512_max_ps(m, a[jj][cc]);                  \
                _mm512_storeu_ps(mx + cc * 16, m);                                                \
            }                                                                                     \
    }
QK_BF16(8, 1)
QK_BF16(8, 2)
QK_BF16(8, 3)

/* acc^T[x][cv] += sum_jp vt[jp][x] . pp[jp][cv] for XB head dims and NC query vectors. */
#define PV_BF16(XB, NC)                                                                           \
    static inline void pv_bf16_##XB##_##NC(const uint32_t *vt, int64_t dv, int64_t np, const uint32_t *pp, \
                                           int64_t mp, float *acc) {                              \
        __m512 a[XB][NC];                                                                         \
        for (int xx = 0; xx < XB; xx++)                                                           \
            for (int cc = 0; cc < NC; cc++) a[xx][cc] = _mm512_loadu_ps(acc + xx * mp + cc * 16); \
        for (int64_t jp = 0; jp < np; jp++) {                                                     \
            __m512bh pv[NC];                                                                      \
            for (int cc = 0; cc < NC; cc++)                                                       \
                pv[cc] = (__m512bh)_mm512_loadu_si512(pp + jp * mp + cc * 16);                     \
            for (int xx = 0; xx < XB; xx++) {                                                     \
                __m512bh vb = (__m512bh)_mm512_set1_epi32((int)vt[jp * dv + xx]);                 \
                for (int cc = 0; cc < NC; cc++) a[xx][cc] = _mm512_dpbf16_ps(a[xx][cc], vb, pv[cc]); \
            }                                                                                     \
        }                                                                                         \
        for (int xx = 0; xx < XB; xx++)                                                           \
            for (int cc = 0; cc < NC; cc++) _mm512_storeu_ps(acc + xx * mp + cc * 16, a[xx][cc]); \
    }
PV_BF16(8, 1)
PV_BF16(8, 2)
PV_BF16(8, 3)
PV_BF16(4, 1)
PV_BF16(4, 2)
PV_BF16(4, 3)

/* Register blocks of 8 keys (or head dims) x 3 query vectors: 24 accumulators, each Q (or
 * P) vector loaded once per 8 broadcasts. */
static inline void qk_tile_bf16(const uint16_t *const *kr, int64_t n, int64_t dh, const uint32_t *qp, int64_t nvec,
                                int64_t mp, float *st, float *mx) {
    if (mx)
        for (int64_t i = 0; i < nvec * VW; i++) mx[i] = -INFINITY;
    for (int64_t j = 0; j < n; j += 8) { /* keys past n read zero rows; their scores are unused */
        int64_t cv = 0;
        for (; cv + 3 <= nvec; cv += 3)
            qk_bf16_8_3(kr + j, dh, qp + cv * VW, mp, st + j * mp + cv * VW, mx ? mx + cv * VW : NULL);
        if (nvec - cv == 2) qk_bf16_8_2(kr + j, dh, qp + cv * VW, mp, st + j * mp + cv * VW, mx ? mx + cv * VW : NULL);
        if (nvec - cv == 1) qk_bf16_8_1(kr + j, dh, qp + cv * VW, mp, st + j * mp + cv * VW, mx ? mx + cv * VW : NULL);
    }
}

static inline void pv_tile_bf16(const uint32_t *vt, int64_t dv, int64_t np, const uint32_t *pp, int64_t nvec,
                                int64_t mp, int64_t dp, float *acc) {
    int64_t x = 0;
    for (; x + 8 <= dp; x += 8) {
        int64_t cv = 0;
        for (; cv + 3 <= nvec; cv += 3) pv_bf16_8_3(vt + x, dv, np, pp + cv * VW, mp, acc + x * mp + cv * VW);
        if (nvec - cv == 2) pv_bf16_8_2(vt + x, dv, np, pp + cv * VW, mp, acc + x * mp + cv * VW);
        if (nvec - cv == 1) pv_bf16_8_1(vt + x, dv, np, pp + cv * VW, mp, acc + x * mp + cv * VW);
    }
    if (x < dp) { /* dp is a multiple of 4 */
        int64_t cv = 0;
        for (; cv + 3 <= nvec; cv += 3) pv_bf16_4_3(vt + x, dv, np, pp + cv * VW, mp, acc + x * mp + cv * VW);
        if (nvec - cv == 2) pv_bf16_4_2(vt + x, dv, np, pp + cv * VW, mp, acc + x * mp + cv * VW);
        if (nvec - cv == 1) pv_bf16_4_1(vt + x, dv, np, pp + cv * VW, mp, acc + x * mp + cv * VW);
    }
}

/* softmax_tile for the bf16 forms, fused with the rounding of P to bf16 key pairs: P is
 * never stored as float32; each pair of keys' probabilities goes straight into pp [NKB/2][mp]
 * (low half key 2jp, high half key 2jp+1, queries on the lanes). */
static inline void softmax_pairs_bf16(const Ctx *c, Scratch *s, int64_t p0, int64_t n, int64_t cv0, int64_t nvec,
                                      int64_t mp, int masked, float scale, int64_t rows, const float *mx) {
    const __m512i pair_idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                              6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const vf vscale = vsplat(scale);
    for (int64_t cv = cv0; cv < nvec; cv++) {
        vf alpha;
        int rescale;
        const vf m_tile = mx ? *(const vf *)(mx + cv * VW) * vsplat(scale) : tile_max(c, s, p0, n, cv, mp, masked, scale);
        const vf m = lazy_max(s, cv, m_tile, &alpha, &rescale);
        vf sum = vsplat(0.0f);
        for (int64_t jp = 0; jp < (n + 1) / 2; jp++) {
            const vf lo = exp2v_bf16(*(vf *)(s->s + 2 * jp * mp + cv * VW) * vscale - m);
            const vf hi = 2 * jp + 1 < n ? exp2v_bf16(*(vf *)(s->s + (2 * jp + 1) * mp + cv * VW) * vscale - m)
                                         : vsplat(0.0f);
            sum += lo + hi;
            const __m512i both = (__m512i)_mm512_cvtne2ps_pbh((__m512)hi, (__m512)lo);
            _mm512_storeu_si512(s->pp + jp * mp + cv * VW, _mm512_permutexvar_epi16(pair_idx, both));
        }
        finish_tile(s, cv, mp, alpha, rescale, sum, rows);
    }
}

#if defined(__AVX512DQ__) /* vreduceps */
/* 2^(y - 1/2) to bf16's precision for finite y (no -inf: the unmasked tiles' scores):
 * g = y - floor(y) in [0, 1) in one instruction (vreduceps), a degree-3 fit of 2^(g - 1/2)
 * (a fit of 2^f on |f| <= 1/2, shifted: rel. error 1.4e-4, a thirtieth of bf16's rounding),
 * times 2^floor(y) (vscalefps floors its exponent operand). Its caller subtracts max - 1/2,
 * not the max: one instruction a vector fewer than rounding to the nearest integer and
 * subtracting it (the judge's layer call a few percent faster). */
static inline vf exp2v_bf16_half(vf y) {
    const vf g = (vf)_mm512_reduce_ps((__m512)y, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    vf p = vsplat(0.05502926645151903f);
    p = p * g + 0.15971308224932576f;
    p = p * g + 0.4922680229083861f;
    p = p * g + 0.7070103983340809f;
    return (vf)_mm512_scalef_ps((__m512)p, (__m512)y);
}

/* softmax_pairs_bf16 with one pass over an unmasked tile: once every lane of a query vector
 * has a reference max, the exponents run against it while the tile's max is taken beside
 * them; only when that max passes the reference by more than LAZY_LOG2 (rare once set, see
 * lazy_max) is the vector redone the two-pass way. Masked tiles, a vector's first tile and
 * the batch-invariant mode take the two passes. Both bf16 forms take it (it gains a little on
 * the judge's shared-prefix layer call, `python -m benchmarks.attention --shared-prefix`). */
static inline void softmax_pairs_onepass(const Ctx *c, Scratch *s, int64_t p0, int64_t n, int64_t cv0,
                                         int64_t nvec, int64_t mp, int masked, float scale, int64_t rows) {
    const __m512i pair_idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                              6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const vf vscale = vsplat(scale);
    for (int64_t cv = cv0; cv < nvec; cv++) {
        const vf m = *(const vf *)(s->m + cv * VW);
        /* batch invariance: a lane's exponents would follow its vector's other lanes and how
         * much of its prompt was cached (which tiles are masked), so that mode takes the two
         * passes (one polynomial) everywhere */
        if (!masked && !c->all_wide &&
            _mm512_cmp_ps_mask((__m512)m, _mm512_set1_ps(-INFINITY), _CMP_GT_OQ) == 0xffff) {
            vf sum = vsplat(0.0f), top = vsplat(-INFINITY); /* top: the tile's max less m, plus 1/2 */
            const vf mh = m - 0.5f;
            for (int64_t jp = 0; jp < n / 2; jp++) {
                const vf lo = *(vf *)(s->s + 2 * jp * mp + cv * VW) * vscale - mh;
                const vf hi = *(vf *)(s->s + (2 * jp + 1) * mp + cv * VW) * vscale - mh;
                top = vmax(top, vmax(lo, hi));
                const vf plo = exp2v_bf16_half(lo), phi = exp2v_bf16_half(hi);
                sum += plo + phi;
                const __m512i both = (__m512i)_mm512_cvtne2ps_pbh((__m512)phi, (__m512)plo);
                _mm512_storeu_si512(s->pp + jp * mp + cv * VW, _mm512_permutexvar_epi16(pair_idx, both));
            }
            if (n & 1) { /* the last key alone: its pair's high half is 0 */
                const int64_t jp = n / 2;
                const vf lo = *(vf *)(s->s + 2 * jp * mp + cv * VW) * vscale - mh;
                top = vmax(top, lo);
                const vf plo = exp2v_bf16_half(lo);
                sum += plo;
                const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(_mm512_setzero_ps(), (__m512)plo);
                _mm512_storeu_si512(s->pp + jp * mp + cv * VW, _mm512_permutexvar_epi16(pair_idx, both));
            }
            if (_mm512_cmp_ps_mask((__m512)top, _mm512_set1_ps(LAZY_LOG2 + 0.5f), _CMP_GT_OQ) == 0) {
                *(vf *)(s->l + cv * VW) += sum;
                continue;
            }
        }
        softmax_pairs_bf16(c, s, p0, n, cv, cv + 1, mp, masked, scale, rows, NULL);
    }
}
#endif

/* Q^T in pairs for an even head_dim: qp[t][i] = pair t of query vector i (zero past nm),
 * 16 query vectors x 16 pairs a transpose (element by element, the pair stores were a third
 * of a 128-token prompt's attention: strided 4-byte stores). */
static inline void pack_q_pairs(const Ctx *c, const Item *it, int64_t nm, int64_t dh, int64_t mp, uint32_t *qp) {
    for (int64_t i0 = 0; i0 < mp; i0 += 16) {
        const uint32_t *rows[16];
        for (int64_t k = 0; k < 16; k++) {
            const int64_t i = i0 + k;
            rows[k] = i < nm ? (const uint32_t *)lane_q(c, it, i) : NULL;
        }
        int64_t t0 = 0;
        for (; t0 + 16 <= dh; t0 += 16) {
            __m512i r[16];
            for (int k = 0; k < 16; k++) r[k] = rows[k] ? _mm512_loadu_si512(rows[k] + t0) : _mm512_setzero_si512();
            transpose16(r);
            for (int k = 0; k < 16; k++) _mm512_storeu_si512(qp + (t0 + k) * mp + i0, r[k]);
        }
        for (; t0 < dh; t0++)
            for (int64_t k = 0; k < 16; k++) qp[t0 * mp + i0 + k] = rows[k] ? rows[k][t0] : 0u;
    }
}

/* The item's outputs from acc^T [dp][mp] and l: each query vector's row acc / l (0 where no
 * key was visible), rounded to bf16 (nearest even), 16 x 16 a transpose. */
static inline void store_out_bf16(const Ctx *c, const Item *it, const Scratch *s, int64_t nm, int64_t mp) {
    const int64_t d = c->d, dp = c->dp;
    for (int64_t i0 = 0; i0 < nm; i0 += 16) {
        const __m512 l = _mm512_loadu_ps(s->l + i0);
        const __m512 inv = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(l, _mm512_setzero_ps(), _CMP_NEQ_UQ),
                                               _mm512_set1_ps(1.0f), l);
        float invs[16];
        _mm512_storeu_ps(invs, inv);
        for (int64_t x0 = 0; x0 < d; x0 += 16) {
            __m512i r[16];
            for (int k = 0; k < 16; k++)
                r[k] = x0 + k < dp ? _mm512_loadu_si512(s->acc + (x0 + k) * mp + i0) : _mm512_setzero_si512();
            transpose16(r);
            const int64_t left = d - x0;
            const __mmask16 keep = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
            for (int64_t k = 0; k < 16 && i0 + k < nm; k++) {
                const int64_t i = i0 + k;
                uint16_t *o = (uint16_t *)lane_out(c, it, i);
                const __m256bh b = _mm512_cvtneps_pbh(_mm512_mul_ps((__m512)r[k], _mm512_set1_ps(invs[k])));
                _mm256_mask_storeu_epi16(o + x0, keep, (__m256i)b);
            }
        }
    }
}

/* A bf16 wide item's start: Q^T in pairs (lane i is query token m0 + i / g, head
 * kv_head * g + i % g), zero rows from the head_dim's pairs up to `pair_rows`; each lane's
 * position, segment and softmax state; `acc_rows` rows of acc^T zeroed. */
static inline void begin_wide_bf16(const Ctx *c, const Item *it, Scratch *s, int64_t nm, int64_t mp,
                                   int64_t pair_rows, int64_t acc_rows) {
    const int64_t g = c->group, d = c->d, dh = (d + 1) / 2, prefix = it->ctx - it->q_len;
    if (d & 1) {
        memset(s->qp, 0, (size_t)(dh * mp) * 4);
        for (int64_t i = 0; i < nm; i++) {
            const uint16_t *qr = (const uint16_t *)lane_q(c, it, i);
            for (int64_t t = 0; t < dh; t++)
                s->qp[t * mp + i] = qr[2 * t] | (2 * t + 1 < d ? (uint32_t)qr[2 * t + 1] << 16 : 0u);
        }
    } else { /* a row's pairs are its 32-bit words */
        pack_q_pairs(c, it, nm, dh, mp, s->qp);
    }
    memset(s->qp + dh * mp, 0, (size_t)((pair_rows - dh) * mp) * 4);
    for (int64_t i = 0; i < mp; i++) {
        s->qpos[i] = i < nm ? (int32_t)(prefix + it->m0 + i / g) : -1; /* padding sees nothing */
        s->qseg[i] = (i < nm && c->segments) ? (int32_t)c->segments[it->q0 + it->m0 + i / g] : 0;
        s->m[i] = -INFINITY;
        s->l[i] = 0.0f;
    }
    memset(s->acc, 0, (size_t)(acc_rows * mp) * 4);
}

static void wide_item_bf16(const Ctx *c, const Item *it, Scratch *s) {
    const int64_t g = c->group, nm = it->mq * g, nvec = (nm + VW - 1) / VW, mp = nvec * VW;
    const int64_t d = c->d, dp = c->dp, dh = (d + 1) / 2, dv = (d + 31) / 32 * 32, prefix = it->ctx - it->q_len;
    begin_wide_bf16(c, it, s, nm, mp, dh, dp);

    const int64_t kv_end = it->ctx < prefix + it->m0 + it->mq ? it->ctx : prefix + it->m0 + it->mq;
    const int64_t cache_end = it->own ? kv_end : (prefix < kv_end ? prefix : kv_end);
    const int64_t first_q = prefix + it->m0;
    const uint16_t *kr[NKB], *vr[NKB];
    int64_t cv0 = 0;
    for (int64_t p0 = kv_begin(c, it); p0 < kv_end; p0 += NKB) {
        const int64_t n = kv_end - p0 < NKB ? kv_end - p0 : NKB, np = (n + 1) / 2;
        cv0 = first_seeing(s, cv0, nvec, nm, p0); /* 0 on an unmasked tile */
        tile_rows_bf16(c, it, s, p0, n, cache_end, kr, vr);
        const int masked = p0 + n - 1 > first_q || c->segments != NULL || window_cuts(c, it, p0);
#if defined(__AVX512DQ__)
        qk_tile_bf16(kr, n, dh, s->qp + cv0 * VW, nvec - cv0, mp, s->s + cv0 * VW, NULL);
        softmax_pairs_onepass(c, s, p0, n, cv0, nvec, mp, masked, c->qscale, dp);
#else
        /* a full tile wholly before the item's first query: its max comes with the scores */
        float *mx = !masked && n == NKB ? s->tmax : NULL;
        qk_tile_bf16(kr, n, dh, s->qp + cv0 * VW, nvec - cv0, mp, s->s + cv0 * VW, mx ? mx + cv0 * VW : NULL);
        softmax_pairs_bf16(c, s, p0, n, cv0, nvec, mp, masked, c->qscale, dp, mx);
#endif
        pack_v_pairs(vr, n, d, dv, s->vt);
        pv_tile_bf16(s->vt, dv, np, s->pp + cv0 * VW, nvec - cv0, mp, dp, s->acc + cv0 * VW);
    }
    store_out_bf16(c, it, s, nm, mp);
}

#if HAVE_AMX
/* ---- the AMX form of the wide bf16 item (CPUs with AMX-BF16: recent Intel server CPUs) -----
 * The same tile loop, masks, softmax and layouts as wide_item_bf16; the two products run on
 * the tile unit, 16 x 16 float32 outputs from 16 x 32 bf16 by 32 x 16 bf16 per instruction:
 * - S^T [keys][queries] = K Q^T: A is 16 key rows (copied into kb, zero-padded to a multiple
 *   of 32 head dims), B the pair-packed Q^T that the dpbf16 form builds (qp [pairs][mp]);
 * - acc^T [dims][queries] += V^T P^T: A is V^T in pairs (vtt [dims][key pairs], built per key
 *   tile), B the pair-packed P^T that softmax_pairs_bf16 writes (pp [key pairs][mp]).
 * Every tile is 16 rows x 64 bytes. Tiles are per thread: each OpenMP thread loads the
 * configuration before its first item and releases it after its last. */
/* V^T in key pairs for keys 0 .. np16*2-1 of the tile (zero past n): vtt[x][jp] holds
 * (V[2jp][x], V[2jp+1][x]) for x < d16 (zero past d); rows of NKB/2 words. 16 pairs x 16
 * dims a transpose. */
static inline void pack_vt_pairs_amx(const uint16_t *const *vr, int64_t n, int64_t d, int64_t d16, int64_t np16,
                                     const uint16_t *zero, uint32_t *vtt) {
    const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                                            6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    for (int64_t jp0 = 0; jp0 < np16; jp0 += 16)
        for (int64_t x0 = 0; x0 < d16; x0 += 16) {
            const int64_t left = d - x0;
            const __mmask32 mask = left >= 16 ? 0xffffu : left <= 0 ? 0u : (__mmask32)((1u << left) - 1u);
            __m512i r[16];
            for (int k = 0; k < 16; k++) {
                const int64_t j = 2 * (jp0 + k);
                const uint16_t *r0 = j < n ? vr[j] : zero, *r1 = j + 1 < n ? vr[j + 1] : zero;
                const __m512i a = _mm512_maskz_loadu_epi16(mask, r0 + x0), b = _mm512_maskz_loadu_epi16(mask, r1 + x0);
                r[k] = _mm512_permutex2var_epi16(a, lo_idx, b);
            }
            transpose16(r);
            for (int k = 0; k < 16; k++) _mm512_storeu_si512(vtt + (x0 + k) * (NKB / 2) + jp0, r[k]);
        }
}

static void wide_item_amx(const Ctx *c, const Item *it, Scratch *s) {
    const int64_t g = c->group, nm = it->mq * g, nvec = (nm + VW - 1) / VW, mp = nvec * VW;
    const int64_t d = c->d, d32 = (d + 31) / 32 * 32, d16 = (d + 15) / 16 * 16;
    const int64_t ksteps = d32 / 32, prefix = it->ctx - it->q_len;
    begin_wide_bf16(c, it, s, nm, mp, d32 / 2, d16); /* Q^T pairs up to whole tiles of 32 head dims */

    const int64_t kv_end = it->ctx < prefix + it->m0 + it->mq ? it->ctx : prefix + it->m0 + it->mq;
    const int64_t cache_end = it->own ? kv_end : (prefix < kv_end ? prefix : kv_end);
    const int64_t first_q = prefix + it->m0;
    const uint16_t *kr[NKB], *vr[NKB];
    int64_t cv0 = 0;
    for (int64_t p0 = kv_begin(c, it); p0 < kv_end; p0 += NKB) {
        const int64_t n = kv_end - p0 < NKB ? kv_end - p0 : NKB, n16 = (n + 15) / 16 * 16;
        const int64_t np = (n + 1) / 2, np16 = (np + 15) / 16 * 16;
        cv0 = first_seeing(s, cv0, nvec, nm, p0);
        tile_rows_bf16(c, it, s, p0, n, cache_end, kr, vr);
        const int masked = p0 + n - 1 > first_q || c->segments != NULL || window_cuts(c, it, p0);
        for (int64_t j0 = 0; j0 < n16; j0 += 16) {
            /* the group's 16 K rows: read in place when they lie at one stride (one block of
             * the pool, or the forward's own rows) and fill whole tiles, else copied into kb
             * zero-padded to d32 (rows past n are the zero row) */
            const uint16_t *kg = s->kb + j0 * d32;
            int64_t kstride = d32 * 2;
            const int64_t pa = p0 + j0, pz = pa + 15;
            if (d % 32 == 0 && j0 + 16 <= n && pz < cache_end && pa / c->block_size == pz / c->block_size) {
                kg = kr[j0];
                kstride = c->scs * 2;
            } else if (d % 32 == 0 && j0 + 16 <= n && pa >= cache_end) {
                kg = kr[j0];
                kstride = c->skt * 2;
            } else {
                for (int64_t j = j0; j < j0 + 16; j++) {
                    uint16_t *dst = s->kb + j * d32;
                    memcpy(dst, kr[j], (size_t)d * 2);
                    for (int64_t x = d; x < d32; x++) dst[x] = 0;
                }
            }
            if (ksteps <= 2) { /* head_dim <= 64: the key group's two K tiles stay loaded */
                _tile_loadd(2, kg, kstride);
                if (ksteps == 2) _tile_loadd(3, kg + 32, kstride);
                for (int64_t cv = cv0; cv < nvec; cv++) {
                    _tile_zero(0);
                    _tile_loadd(4, s->qp + cv * VW, mp * 4);
                    _tile_dpbf16ps(0, 2, 4);
                    if (ksteps == 2) {
                        _tile_loadd(5, s->qp + 16 * mp + cv * VW, mp * 4);
                        _tile_dpbf16ps(0, 3, 5);
                    }
                    _tile_stored(0, s->s + j0 * mp + cv * VW, mp * 4);
                }
                continue;
            }
            for (int64_t cv = cv0; cv < nvec; cv++) {
                _tile_zero(0);
                for (int64_t ks = 0; ks < ksteps; ks++) {
                    _tile_loadd(2, kg + ks * 32, kstride);
                    _tile_loadd(4, s->qp + ks * 16 * mp + cv * VW, mp * 4);
                    _tile_dpbf16ps(0, 2, 4);
                }
                _tile_stored(0, s->s + j0 * mp + cv * VW, mp * 4);
            }
        }
        softmax_pairs_onepass(c, s, p0, n, cv0, nvec, mp, masked, c->qscale, d16);
        for (int64_t jp = np; jp < np16; jp++) memset(s->pp + jp * mp, 0, (size_t)mp * 4);
        pack_vt_pairs_amx(vr, n, d, d16, np16, s->zero, s->vt);
        /* per query vector its P tiles (the tile's 32 or 64 keys) stay loaded over the head dims */
        for (int64_t cv = cv0; cv < nvec; cv++) {
            _tile_loadd(4, s->pp + cv * VW, mp * 4);
            if (np16 > 16) _tile_loadd(5, s->pp + 16 * mp + cv * VW, mp * 4);
            for (int64_t x0 = 0; x0 < d16; x0 += 16) {
                _tile_loadd(0, s->acc + x0 * mp + cv * VW, mp * 4);
                _tile_loadd(2, s->vt + x0 * (NKB / 2), NKB / 2 * 4);
                _tile_dpbf16ps(0, 2, 4);
                if (np16 > 16) {
                    _tile_loadd(3, s->vt + x0 * (NKB / 2) + 16, NKB / 2 * 4);
                    _tile_dpbf16ps(0, 3, 5);
                }
                _tile_stored(0, s->acc + x0 * mp + cv * VW, mp * 4);
            }
        }
    }
    store_out_bf16(c, it, s, nm, mp);
}
#endif /* HAVE_AMX */

/* Sum of each of 16 vectors, as the 16 lanes of one (lane j: the sum of a[j]). */
static inline __m512 hsum16(__m512 *a) {
    __m512 b[8], e[4];
    for (int k = 0; k < 8; k++)
        b[k] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * k], a[2 * k + 1]), _mm512_unpackhi_ps(a[2 * k], a[2 * k + 1]));
    for (int k = 0; k < 4; k++) {
        const __m512d x = (__m512d)b[2 * k], y = (__m512d)b[2 * k + 1];
        e[k] = _mm512_add_ps((__m512)_mm512_unpacklo_pd(x, y), (__m512)_mm512_unpackhi_pd(x, y));
    }
    /* e[k]'s 128-bit lane L holds partial sums of keys 4k..4k+3; add the 4 lanes */
    const __m512 f0 = _mm512_add_ps(_mm512_shuffle_f32x4(e[0], e[1], 0x88), _mm512_shuffle_f32x4(e[0], e[1], 0xdd));
    const __m512 f1 = _mm512_add_ps(_mm512_shuffle_f32x4(e[2], e[3], 0x88), _mm512_shuffle_f32x4(e[2], e[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(f0, f1, 0x88), _mm512_shuffle_f32x4(f0, f1, 0xdd));
}

/* Decode and tiny chunks: keys on the lanes for the scores (per key a bf16 dot product over
 * head_dim, 16 keys' partial vectors summed by one transpose-add tree), head_dim on the lanes
 * for P·V (pairs of keys' P broadcast against interleaved V). */
static void narrow_item_bf16(const Ctx *c, const Item *it, Scratch *s) {
    const int64_t g = c->group, nm = it->mq * g, d = c->d, dv = (d + 31) / 32 * 32, prefix = it->ctx - it->q_len;
    uint16_t *qs = (uint16_t *)s->qp; /* [nm][dv] bf16, zero-padded */
    float *acc = s->acc;              /* [nm][dv] */
    for (int64_t i = 0; i < nm; i++) {
        memset(qs + i * dv, 0, (size_t)dv * 2);
        memcpy(qs + i * dv, lane_q(c, it, i), (size_t)d * 2);
        memset(acc + i * dv, 0, (size_t)dv * 4);
        s->m[i] = -INFINITY;
        s->l[i] = 0.0f;
        s->qpos[i] = (int32_t)(prefix + it->m0 + i / g);
        s->qseg[i] = c->segments ? (int32_t)c->segments[it->q0 + it->m0 + i / g] : 0;
    }
    const int64_t kv_end = it->ctx < prefix + it->m0 + it->mq ? it->ctx : prefix + it->m0 + it->mq;
    const int64_t cache_end = it->own ? kv_end : (prefix < kv_end ? prefix : kv_end);
    const __m512 vscale = _mm512_set1_ps(c->qscale);
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const uint16_t *kr[NKB], *vr[NKB];
    for (int64_t p0 = kv_begin(c, it); p0 < kv_end; p0 += NK) {
        const int64_t n = kv_end - p0 < NK ? kv_end - p0 : NK, np = (n + 1) / 2;
        tile_rows_bf16(c, it, s, p0, n, cache_end, kr, vr);
        pack_v_pairs(vr, n, d, dv, s->vt);
        int32_t ks[16] = {0};
        if (c->segments)
            for (int64_t j = 0; j < NK; j++) ks[j] = (int32_t)s->kseg[j];
        const __m512i kseg = _mm512_loadu_si512(ks);
        const __mmask16 seg0 = _mm512_cmpeq_epi32_mask(kseg, _mm512_setzero_si512());
        for (int64_t i = 0; i < nm; i++) {
            __m512 a[16];
            for (int j = 0; j < 16; j++) a[j] = _mm512_setzero_ps();
            for (int64_t x0 = 0; x0 < d; x0 += 32) {
                const int64_t left = d - x0;
                const __mmask32 mask = left >= 32 ? 0xffffffffu : (__mmask32)((1u << left) - 1u);
                const __m512bh qv = (__m512bh)_mm512_loadu_si512(qs + i * dv + x0);
                for (int j = 0; j < 16; j++)
                    a[j] = _mm512_dpbf16_ps(a[j], (__m512bh)_mm512_maskz_loadu_epi16(mask, kr[j] + x0), qv);
            }
            __m512 sv = _mm512_mul_ps(hsum16(a), vscale);
            /* visible: inside the tile, not after the query (causal), same segment or shared */
            __mmask16 vis = _mm512_cmple_epi32_mask(lane, _mm512_set1_epi32((int32_t)(s->qpos[i] - p0)));
            vis &= n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
            if (c->window > 0) /* inside the query's window: lane > qpos - p0 - window */
                vis &= _mm512_cmpgt_epi32_mask(lane, _mm512_set1_epi32((int32_t)(s->qpos[i] - p0 - c->window)));
            if (c->segments) vis &= seg0 | _mm512_cmpeq_epi32_mask(kseg, _mm512_set1_epi32(s->qseg[i]));
            sv = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), vis, sv);
            const float mx = _mm512_reduce_max_ps(sv);
            const float m_new = s->m[i] > mx ? s->m[i] : mx;
            const float m_safe = m_new == -INFINITY ? 0.0f : m_new;
            vf sd;
            memcpy(&sd, &sv, sizeof sd);
            sd = exp2v(sd - m_safe);
            __m512 p;
            memcpy(&p, &sd, sizeof p);
            const float alpha = s->m[i] == -INFINITY ? 0.0f : exp2v(vsplat(s->m[i] - m_safe))[0];
            s->m[i] = m_new;
            s->l[i] = s->l[i] * alpha + _mm512_reduce_add_ps(p);
            uint32_t pp[8];
            _mm256_storeu_si256((__m256i *)pp, (__m256i)_mm512_cvtneps_pbh(p)); /* (p[2k], p[2k+1]) pairs */
            float *ai = acc + i * dv;
            const __m512 va = _mm512_set1_ps(alpha);
            for (int64_t x = 0; x < dv; x += 16) {
                __m512 av = _mm512_loadu_ps(ai + x);
                if (alpha != 1.0f) av = _mm512_mul_ps(av, va);
                for (int64_t jp = 0; jp < np; jp++)
                    av = _mm512_dpbf16_ps(av, (__m512bh)_mm512_set1_epi32((int)pp[jp]),
                                          (__m512bh)_mm512_loadu_si512(s->vt + jp * dv + x));
                _mm512_storeu_ps(ai + x, av);
            }
        }
    }
    for (int64_t i = 0; i < nm; i++) {
        float inv = s->l[i] == 0.0f ? 0.0f : 1.0f / s->l[i];
        for (int64_t x = 0; x < d; x++) acc[i * dv + x] *= inv;
        store_out(c, it, i, acc + i * dv);
    }
}
#endif /* HAVE_DPBF16 */

static void *alloc(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

/* 1 where this build has the bf16 forms (AVX512-BF16), for the start-up log. */
int prelude_attention_bf16_forms(void) { return HAVE_DPBF16; }

/* 1 where the AMX form can run: this build has it and the kernel lets this process use the
 * tile registers (Linux asks each process to request them once; the answer is cached). */
int prelude_attention_amx_ready(void) {
#if HAVE_AMX
    return amx_permitted();
#else
    return 0;
#endif
}

/* Scatter new tokens' K/V ([T, kv_heads, d], element strides) into their pool slots
 * (block * block_size + offset; -1: not kept). esize: bytes per element. */
static void write_kv_rows(const void *k, int64_t skt, int64_t skh, const void *v, int64_t svt, int64_t svh, void *kc,
                          void *vc, int64_t scb, int64_t scs, int64_t sch, int64_t block_size, const int64_t *slots,
                          int64_t t, int64_t kv_heads, int64_t d, int64_t esize, int threads) {
    const size_t row = (size_t)(d * esize);
#pragma omp parallel for num_threads(threads) schedule(static) if (t * kv_heads * d >= 65536)
    for (int64_t i = 0; i < t; i++) {
        const int64_t slot = slots[i];
        if (slot < 0) continue;
        const int64_t base = (slot / block_size) * scb + (slot % block_size) * scs;
        for (int64_t h = 0; h < kv_heads; h++) {
            memcpy((char *)kc + (base + h * sch) * esize, (const char *)k + (i * skt + h * skh) * esize, row);
            memcpy((char *)vc + (base + h * sch) * esize, (const char *)v + (i * svt + h * svh) * esize, row);
        }
    }
}

int prelude_write_kv(const void *k, int64_t skt, int64_t skh, const void *v, int64_t svt, int64_t svh, void *kc,
                     void *vc, int64_t scb, int64_t scs, int64_t sch, int64_t block_size, const int64_t *slots,
                     int64_t t, int64_t kv_heads, int64_t d, int64_t esize, int threads) {
    if (block_size <= 0 || esize <= 0) return 1;
    write_kv_rows(k, skt, skh, v, svt, svh, kc, vc, scb, scs, sch, block_size, slots, t, kv_heads, d, esize, threads);
    return 0;
}

/* Attention of every row's new tokens; writes out[tok] ([T, heads, d]) for the query tokens
 * of the prefill rows (with pre_tail: the last pre_tail[r] of row r only) and decode rows.
 * Block tables are int64 [rows, stride], padded.
 * slots (or NULL): the forward's n_slots new tokens' pool slots, their K/V written first (one
 * call per layer: the per-call overhead counts at decode, ~30 calls a step).
 * window (> 0): a sliding layer's span, each query seeing its last `window` positions (itself
 * included); a table's entries for blocks wholly before a row's first window are never read.
 * Returns 0, or 1 on arguments it cannot serve (nothing written then), 2 on no memory. */
int prelude_paged_attention(
    const void *q, int64_t sqt, int64_t sqh, const void *k, int64_t skt, int64_t skh, const void *v, int64_t svt,
    int64_t svh, const void *kc, const void *vc, int64_t scb, int64_t scs, int64_t sch, int64_t block_size,
    int64_t n_pre, const int64_t *pre_start, const int64_t *pre_len, const int64_t *pre_ctx, const int64_t *pre_own,
    const int64_t *pre_tables, int64_t pre_tstride, const int64_t *pre_tail, int64_t n_dec, const int64_t *dec_index,
    const int64_t *dec_ctx, const int64_t *dec_tables, int64_t dec_tstride, const int64_t *segments,
    const int64_t *slots, int64_t n_slots, void *out, int64_t sot, int64_t soh, int64_t heads, int64_t kv_heads,
    int64_t d, float scale, int bf16, int threads, int options, int64_t window) {
    if (window < 0 || heads <= 0 || kv_heads <= 0 || heads % kv_heads || d <= 0 || d > 4096 || block_size <= 0 || !(scale > 0.0f))
        return 1;
    Ctx c = {(const char *)q, (const char *)k, (const char *)v, (const char *)kc, (const char *)vc,
             sqt, sqh, skt, skh, svt, svh, scb, scs, sch, (char *)out, sot, soh, segments,
             block_size, heads, kv_heads, heads / kv_heads, d, (d + 3) / 4 * 4,
             scale * 1.4426950408889634f, bf16, bf16 ? 2 : 4, (options & OPT_ALL_WIDE) != 0, window};
    /* amx: bf16 items take the AMX form where it can run (prefill, and decode rows: faster
     * over long contexts, even over short ones) */
    const int amx = options & OPT_AMX;
    const int use_amx = HAVE_AMX && bf16 && amx && prelude_attention_amx_ready();
    const int64_t g = c.group, max_m = use_amx ? MAX_M_AMX : HAVE_DPBF16 && bf16 ? MAX_M_BF16 : MAX_M;
    const int64_t tile = g >= max_m ? 1 : max_m / g; /* most query tokens per wide item */
    int64_t count = n_dec * kv_heads;
    /* pre_tail (NULL: all): per prefill row, how many of its last queries are attended;
     * the others' outputs are never read (the last layer of a forward whose heads read only
     * some positions), their rows of `out` are left unwritten. The KV write is for all. */
    for (int64_t r = 0; r < n_pre; r++) {
        if (pre_len[r] < 0 || pre_ctx[r] < pre_len[r]) return 1;
        if (pre_tail && (pre_tail[r] < 0 || pre_tail[r] > pre_len[r])) return 1;
        count += ((pre_tail ? pre_tail[r] : pre_len[r]) + tile - 1) / tile * kv_heads;
    }
    for (int64_t r = 0; r < n_dec; r++)
        if (dec_ctx[r] < 0) return 1;
    if (slots)
        write_kv_rows(k, skt, skh, v, svt, svh, (void *)kc, (void *)vc, scb, scs, sch, block_size, slots, n_slots,
                      kv_heads, d, bf16 ? 2 : 4, threads);
    if (count == 0) return 0;
    Item *items = malloc(sizeof(Item) * (size_t)count);
    if (!items) return 2;
    int64_t n = 0;
    /* a row's query tokens split evenly over its items (64 tokens: 2 x 32, not 42 + 22: fewer
     * padding lanes); longest rows' items first would balance better, rows come in batch order */
    for (int64_t r = 0; r < n_pre; r++) {
        const int64_t nq = pre_tail ? pre_tail[r] : pre_len[r], skip = pre_len[r] - nq;
        const int64_t parts = (nq + tile - 1) / tile;
        for (int64_t part = 0; part < parts; part++) {
            const int64_t m0 = skip + nq * part / parts, m1 = skip + nq * (part + 1) / parts;
            for (int64_t h = 0; h < kv_heads; h++)
                items[n++] = (Item){pre_start[r], pre_len[r], pre_ctx[r], pre_own[r] != 0,
                                    pre_tables + r * pre_tstride, h, m0, m1 - m0};
        }
    }
    for (int64_t r = 0; r < n_dec; r++)
        for (int64_t h = 0; h < kv_heads; h++)
            items[n++] = (Item){dec_index[r], 1, dec_ctx[r], 1, dec_tables + r * dec_tstride, h, 0, 1};
    count = n;
    const int64_t mp_max = ((tile * g > g ? tile * g : g) + VW - 1) / VW * VW;
    const int64_t dh = (c.d + 1) / 2, dv = (c.d + 31) / 32 * 32, d16 = (c.d + 15) / 16 * 16;
    const int use_bf16_forms = HAVE_DPBF16 && bf16;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (count > 1)
    {
        Scratch s;
        const int64_t span = c.dp > c.d ? c.dp : c.d;
        const int64_t acc_n = d16 * mp_max > WIDE_MIN * dv ? d16 * mp_max : WIDE_MIN * dv;
        s.qt = alloc((size_t)(span * mp_max) * 4);
        s.acc = alloc((size_t)acc_n * 4);
        s.s = alloc((size_t)(KT_MAX * mp_max) * 4);
        s.kf = alloc((size_t)(NK * c.dp) * 4);
        s.vf = alloc((size_t)(NK * c.dp) * 4);
        s.m = alloc((size_t)mp_max * 4);
        s.l = alloc((size_t)mp_max * 4);
        s.qpos = alloc((size_t)mp_max * 4);
        s.qseg = alloc((size_t)mp_max * 4);
        int ok = s.qt && s.acc && s.s && s.kf && s.vf && s.m && s.l && s.qpos && s.qseg;
        s.qp = s.pp = s.vt = NULL;
        s.tmax = NULL;
        s.kpad = s.zero = s.kb = NULL;
        if (use_bf16_forms) {
            /* Q^T pairs up to a multiple of 16 (the AMX form's tiles of 32 head dims) */
            const int64_t qp_n = dv / 2 * mp_max > WIDE_MIN * dv ? dv / 2 * mp_max : WIDE_MIN * dv;
            s.qp = alloc((size_t)qp_n * 4);
            s.pp = alloc((size_t)(NKB / 2 * mp_max) * 4);
            s.tmax = alloc((size_t)mp_max * 4);
            s.vt = alloc((size_t)(NKB / 2 * dv) * 4);
            s.kpad = alloc((size_t)(NKB * 2 * dh) * 2);
            s.zero = alloc((size_t)dv * 2);
            ok = ok && s.qp && s.pp && s.vt && s.kpad && s.zero && s.tmax;
            if (s.zero) memset(s.zero, 0, (size_t)dv * 2);
        }
        if (use_amx) {
            s.kb = alloc((size_t)(NKB * dv) * 2);
            ok = ok && s.kb;
#if HAVE_AMX
            amx_configure();
#endif
        }
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < count; i++) {
            if (!ok) continue;
            const int wide = items[i].mq * g >= WIDE_MIN || c.all_wide;
#if HAVE_AMX
            if (use_amx) { /* decode rows too: 3 of 16 lanes used, still ahead of the dot product */
                wide_item_amx(&c, &items[i], &s);
                continue;
            }
#endif
#if HAVE_DPBF16
            if (use_bf16_forms) {
                if (wide) wide_item_bf16(&c, &items[i], &s);
                else narrow_item_bf16(&c, &items[i], &s);
                continue;
            }
#endif
            if (wide) wide_item(&c, &items[i], &s);
            else narrow_item(&c, &items[i], &s);
        }
        free(s.qt); free(s.acc); free(s.s); free(s.kf); free(s.vf);
        free(s.m); free(s.l); free(s.qpos); free(s.qseg);
        free(s.qp); free(s.pp); free(s.vt); free(s.kpad); free(s.zero); free(s.tmax); free(s.kb);
#if HAVE_AMX
        if (use_amx) _tile_release();
#endif
    }
    free(items);
    return failed ? 2 : 0;
}

