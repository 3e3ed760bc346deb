/* Paged attention on the CPU, reading K/V from the block pool in place (C + OpenMP), and the
 * KV write into the pool. Called through ctypes by model/attention/cpu_backend.py.
 *
 * One call serves a whole forward's rows: prefill rows (new tokens over a cached prefix:
 * chunked prefill with their own K/V already in the pool, or OneShot rows whose own K/V are
 * this forward's k/v tensors) and decode rows (one query over the pool), GQA, float32 or
 * bf16 tensors. The math is float32 inside, softmax online (running max and sum per query,
 * rescaled per key tile) in the log2 domain. The same semantics as the Triton kernels of
 * triton_kernels.py, including the multi-item segment mask.
 *
 * Work items are (row, KV head, query tile); each one loads a key tile once for all the
 * query heads that share its KV head. Two inner forms:
 * - wide (>= WIDE_MIN query vectors in the tile: prefill): queries on the vector lanes.
 *   Q^T [D][M] is built once per item; per key tile, S^T [N][M] = K Q^T, softmax and
 *   acc^T [D][M] += V^T P^T are vertical vector ops (no horizontal sums), register-blocked
 *   4 keys (or 4 head dims) x up to 4 query vectors.
 * - narrow (decode, tiny chunks): head_dim on the lanes, one dot product per (query, key).
 *
 * Built with -march=native (native_lib.py keys the cached library by this CPU's ISA flags);
 * GCC's vector extensions compile to whatever width the host has (AVX-512: 16 lanes, else 8).
 * Any head_dim works (no multiple of the vector width needed).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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
#define CB 4         /* query vectors (of VW lanes) per register block */

static inline vf vsplat(float x) { return (vf){0} + x; }
static inline vf vsel(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); }
static inline vf vmax(vf a, vf b) { return vsel(a > b, a, b); }

/* 2^x for x <= 0 (and -inf -> 0): round to the nearest integer n, a degree-6 Taylor
 * polynomial for 2^f on |f| <= 0.5 (rel. error ~1e-7), then n added to the exponent. */
static inline vf exp2v(vf x) {
    const vf lo = vsplat(-126.0f), magic = vsplat(12582912.0f); /* 1.5 * 2^23 */
    vi keep = x > vsplat(-INFINITY);
    vf xc = vmax(x, lo);
    vf big = xc + magic;
    vf n = big - magic;
    vf f = xc - n;
    vf p = vsplat(1.5403530393381606e-4f);
    p = p * f + 1.3333558146428443e-3f;
    p = p * f + 9.6181291076284772e-3f;
    p = p * f + 5.5504108664821580e-2f;
    p = p * f + 2.4022650695910071e-1f;
    p = p * f + 6.9314718055994531e-1f;
    p = p * f + 1.0f;
    vi e = ((vi)big - (vi)magic) << 23;
    return (vf)(((vi)p + e) & keep);
}

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
} Ctx;

typedef struct {
    int64_t q0;          /* flattened index of the row's first new token */
    int64_t q_len, ctx;  /* new tokens; tokens with K/V after this step */
    int64_t own;         /* 1: the new tokens' K/V are in the pool; 0: in k/v */
    const int64_t *table;
    int64_t kv_head, m0, mq; /* KV head; first query (within the row) and count */
} Item;

typedef struct {
    float *qt, *s, *acc, *kf, *vf, *m, *l;
    int32_t *qpos, *qseg;
    int64_t kseg[NK];
} Scratch;

/* Pointer to the K (or V) of sequence position p of an item's row, KV head h. */
static inline const char *kv_ptr(const Ctx *c, const Item *it, int64_t p, int64_t cache_end, int value) {
    int64_t prefix = it->ctx - it->q_len;
    if (p < cache_end) {
        int64_t block = it->table[p / c->block_size], off = p % c->block_size;
        const char *base = value ? c->vc : c->kc;
        return base + (block * c->scb + off * c->scs + it->kv_head * c->sch) * c->esize;
    }
    int64_t tok = it->q0 + (p - prefix);
    return value ? c->v + (tok * c->svt + it->kv_head * c->svh) * c->esize
                 : c->k + (tok * c->skt + it->kv_head * c->skh) * c->esize;
}

static inline void load_tile(const Ctx *c, const Item *it, Scratch *s, int64_t p0, int64_t n, int64_t cache_end) {
    int64_t prefix = it->ctx - it->q_len;
    for (int64_t j = 0; j < NK; j++) {
        if (j < n) {
            int64_t p = p0 + j;
            load_row(kv_ptr(c, it, p, cache_end, 0), c->bf16, c->d, c->dp, s->kf + j * c->dp);
            load_row(kv_ptr(c, it, p, cache_end, 1), c->bf16, c->d, c->dp, s->vf + j * c->dp);
            s->kseg[j] = (c->segments && p >= prefix) ? c->segments[it->q0 + (p - prefix)] : 0;
        } else { /* rows past the tile's end: zeros, their scores are masked */
            memset(s->kf + j * c->dp, 0, (size_t)c->dp * 4);
            memset(s->vf + j * c->dp, 0, (size_t)c->dp * 4);
            s->kseg[j] = 0;
        }
    }
}

static inline void store_out(const Ctx *c, int64_t tok, int64_t head, const float *src) {
    char *dst = c->out + (tok * c->sot + head * c->soh) * c->esize;
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
                vf kb = vsplat(kf[jj * dp + x]);                                                  \
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
                vf vb = vsplat(vfm[j * dp + xx]);                                                 \
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

static void wide_item(const Ctx *c, const Item *it, Scratch *s) {
    const int64_t g = c->group, nm = it->mq * g, nvec = (nm + VW - 1) / VW, mp = nvec * VW;
    const int64_t d = c->d, dp = c->dp, prefix = it->ctx - it->q_len;
    /* Q^T, scaled; lane i is query token m0 + i / g, head kv_head * g + i % g */
    memset(s->qt, 0, (size_t)(d * mp) * 4);
    float row[4096];
    for (int64_t i = 0; i < nm; i++) {
        int64_t tok = it->q0 + it->m0 + i / g, head = it->kv_head * g + i % g;
        load_row(c->q + (tok * c->sqt + head * c->sqh) * c->esize, c->bf16, d, d, row);
        for (int64_t x = 0; x < d; x++) s->qt[x * mp + i] = row[x] * c->qscale;
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
    for (int64_t p0 = 0; p0 < kv_end; p0 += NK) {
        const int64_t n = kv_end - p0 < NK ? kv_end - p0 : NK;
        load_tile(c, it, s, p0, n, cache_end);
        for (int64_t j = 0; j < NK; j += 4) {
            int64_t cv = 0;
            for (; cv + 4 <= nvec; cv += 4) qk_block_4(s->kf + j * dp, dp, d, s->qt + cv * VW, mp, s->s + j * mp + cv * VW);
            switch (nvec - cv) {
                case 3: qk_block_3(s->kf + j * dp, dp, d, s->qt + cv * VW, mp, s->s + j * mp + cv * VW); break;
                case 2: qk_block_2(s->kf + j * dp, dp, d, s->qt + cv * VW, mp, s->s + j * mp + cv * VW); break;
                case 1: qk_block_1(s->kf + j * dp, dp, d, s->qt + cv * VW, mp, s->s + j * mp + cv * VW); break;
            }
        }
        /* mask: causal (key position <= query position), segments, padding lanes */
        const int masked = p0 + n - 1 > first_q || c->segments || it->mq * g != mp;
        for (int64_t cv = 0; cv < nvec; cv++) {
            vi qpos = *(const vi *)(s->qpos + cv * VW);
            vi qseg = *(const vi *)(s->qseg + cv * VW);
            vf mx = vsplat(-INFINITY);
            for (int64_t j = 0; j < n; j++) {
                vf sv = *(vf *)(s->s + j * mp + cv * VW);
                if (masked) {
                    vi vis = qpos >= (int32_t)(p0 + j);
                    if (c->segments) {
                        int32_t ks = (int32_t)s->kseg[j];
                        vis &= (ks == 0) ? (vi){0} - 1 : (qseg == ks);
                    }
                    sv = vsel(vis, sv, vsplat(-INFINITY));
                    *(vf *)(s->s + j * mp + cv * VW) = sv;
                }
                mx = vmax(mx, sv);
            }
            vf m_old = *(vf *)(s->m + cv * VW);
            vf m_new = vmax(m_old, mx);
            vf m_safe = vsel(m_new == vsplat(-INFINITY), vsplat(0.0f), m_new);
            vf alpha = exp2v(m_old - m_safe);
            vf sum = vsplat(0.0f);
            for (int64_t j = 0; j < n; j++) {
                vf p = exp2v(*(vf *)(s->s + j * mp + cv * VW) - m_safe);
                *(vf *)(s->s + j * mp + cv * VW) = p;
                sum += p;
            }
            *(vf *)(s->m + cv * VW) = m_new;
            *(vf *)(s->l + cv * VW) = *(vf *)(s->l + cv * VW) * alpha + sum;
            for (int64_t x = 0; x < dp; x++) *(vf *)(s->acc + x * mp + cv * VW) *= alpha;
        }
        for (int64_t x = 0; x < dp; x += 4) {
            int64_t cv = 0;
            for (; cv + 4 <= nvec; cv += 4) pv_block_4(s->vf + x, dp, n, s->s + cv * VW, mp, s->acc + x * mp + cv * VW);
            switch (nvec - cv) {
                case 3: pv_block_3(s->vf + x, dp, n, s->s + cv * VW, mp, s->acc + x * mp + cv * VW); break;
                case 2: pv_block_2(s->vf + x, dp, n, s->s + cv * VW, mp, s->acc + x * mp + cv * VW); break;
                case 1: pv_block_1(s->vf + x, dp, n, s->s + cv * VW, mp, s->acc + x * mp + cv * VW); break;
            }
        }
    }
    for (int64_t i = 0; i < nm; i++) {
        float inv = s->l[i] == 0.0f ? 0.0f : 1.0f / s->l[i];
        for (int64_t x = 0; x < d; x++) row[x] = s->acc[x * mp + i] * inv;
        store_out(c, it->q0 + it->m0 + i / g, it->kv_head * g + i % g, row);
    }
}

/* ---- narrow form: head_dim on the lanes -------------------------------------------- */

static void narrow_item(const Ctx *c, const Item *it, Scratch *s) {
    const int64_t g = c->group, nm = it->mq * g, d = c->d, dp = c->dp, prefix = it->ctx - it->q_len;
    float *qs = s->qt, *acc = s->acc, *sc = s->s; /* [nm][dp], [nm][dp], [nm][NK] */
    for (int64_t i = 0; i < nm; i++) {
        int64_t tok = it->q0 + it->m0 + i / g, head = it->kv_head * g + i % g;
        load_row(c->q + (tok * c->sqt + head * c->sqh) * c->esize, c->bf16, d, dp, qs + i * dp);
        for (int64_t x = 0; x < dp; x++) qs[i * dp + x] *= c->qscale;
        memset(acc + i * dp, 0, (size_t)dp * 4);
        s->m[i] = -INFINITY;
        s->l[i] = 0.0f;
        s->qpos[i] = (int32_t)(prefix + it->m0 + i / g);
        s->qseg[i] = c->segments ? (int32_t)c->segments[tok] : 0;
    }
    const int64_t kv_end = it->ctx < prefix + it->m0 + it->mq ? it->ctx : prefix + it->m0 + it->mq;
    const int64_t cache_end = it->own ? kv_end : (prefix < kv_end ? prefix : kv_end);
    for (int64_t p0 = 0; p0 < kv_end; p0 += NK) {
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
                int visible = p0 + j <= s->qpos[i] &&
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
        store_out(c, it->q0 + it->m0 + i / g, it->kv_head * g + i % g, acc + i * dp);
    }
}

static void *alloc(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

/* Attention of every row's new tokens; writes out[tok] ([T, heads, d]) for the query tokens
 * of the prefill rows and decode rows. Block tables are int64 [rows, stride], padded.
 * Returns 0, or 1 on arguments it cannot serve (nothing written then), 2 on no memory. */
int prelude_paged_attention(
    const void *q, int64_t sqt, int64_t sqh, const void *k, int64_t skt, int64_t skh, const void *v, int64_t svt,
    int64_t svh, const void *kc, const void *vc, int64_t scb, int64_t scs, int64_t sch, int64_t block_size,
    int64_t n_pre, const int64_t *pre_start, const int64_t *pre_len, const int64_t *pre_ctx, const int64_t *pre_own,
    const int64_t *pre_tables, int64_t pre_tstride, int64_t n_dec, const int64_t *dec_index, const int64_t *dec_ctx,
    const int64_t *dec_tables, int64_t dec_tstride, const int64_t *segments, void *out, int64_t sot, int64_t soh,
    int64_t heads, int64_t kv_heads, int64_t d, float scale, int bf16, int threads) {
    if (heads <= 0 || kv_heads <= 0 || heads % kv_heads || d <= 0 || d > 4096 || block_size <= 0) return 1;
    Ctx c = {(const char *)q, (const char *)k, (const char *)v, (const char *)kc, (const char *)vc,
             sqt, sqh, skt, skh, svt, svh, scb, scs, sch, (char *)out, sot, soh, segments,
             block_size, heads, kv_heads, heads / kv_heads, d, (d + 3) / 4 * 4,
             scale * 1.4426950408889634f, bf16, bf16 ? 2 : 4};
    const int64_t g = c.group;
    const int64_t tile = g >= MAX_M ? 1 : MAX_M / g; /* query tokens per wide item */
    int64_t count = n_dec * kv_heads;
    for (int64_t r = 0; r < n_pre; r++) {
        if (pre_len[r] < 0 || pre_ctx[r] < pre_len[r]) return 1;
        count += (pre_len[r] + tile - 1) / tile * kv_heads;
    }
    for (int64_t r = 0; r < n_dec; r++)
        if (dec_ctx[r] < 0) return 1;
    if (count == 0) return 0;
    Item *items = malloc(sizeof(Item) * (size_t)count);
    if (!items) return 2;
    int64_t n = 0;
    /* longest rows' items first would balance better; rows arrive in batch order */
    for (int64_t r = 0; r < n_pre; r++)
        for (int64_t m0 = 0; m0 < pre_len[r]; m0 += tile)
            for (int64_t h = 0; h < kv_heads; h++)
                items[n++] = (Item){pre_start[r], pre_len[r], pre_ctx[r], pre_own[r] != 0, pre_tables + r * pre_tstride,
                                    h, m0, pre_len[r] - m0 < tile ? pre_len[r] - m0 : tile};
    for (int64_t r = 0; r < n_dec; r++)
        for (int64_t h = 0; h < kv_heads; h++)
            items[n++] = (Item){dec_index[r], 1, dec_ctx[r], 1, dec_tables + r * dec_tstride, h, 0, 1};
    const int64_t mp_max = ((tile * g > g ? tile * g : g) + VW - 1) / VW * VW;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (count > 1)
    {
        Scratch s;
        const int64_t span = c.dp > c.d ? c.dp : c.d;
        s.qt = alloc((size_t)(span * mp_max) * 4);
        s.acc = alloc((size_t)(c.dp * mp_max) * 4);
        s.s = alloc((size_t)(NK * mp_max) * 4);
        s.kf = alloc((size_t)(NK * c.dp) * 4);
        s.vf = alloc((size_t)(NK * c.dp) * 4);
        s.m = alloc((size_t)mp_max * 4);
        s.l = alloc((size_t)mp_max * 4);
        s.qpos = alloc((size_t)mp_max * 4);
        s.qseg = alloc((size_t)mp_max * 4);
        int ok = s.qt && s.acc && s.s && s.kf && s.vf && s.m && s.l && s.qpos && s.qseg;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < count; i++) {
            if (!ok) continue;
            if (items[i].mq * g >= WIDE_MIN) wide_item(&c, &items[i], &s);
            else narrow_item(&c, &items[i], &s);
        }
        free(s.qt); free(s.acc); free(s.s); free(s.kf); free(s.vf);
        free(s.m); free(s.l); free(s.qpos); free(s.qseg);
    }
    free(items);
    return failed ? 2 : 0;
}

/* Scatter new tokens' K/V ([T, kv_heads, d], element strides) into their pool slots
 * (block * block_size + offset; -1: not kept). esize: bytes per element. */
int prelude_write_kv(const void *k, int64_t skt, int64_t skh, const void *v, int64_t svt, int64_t svh, void *kc,
                     void *vc, int64_t scb, int64_t scs, int64_t sch, int64_t block_size, const int64_t *slots,
                     int64_t t, int64_t kv_heads, int64_t d, int64_t esize, int threads) {
    if (block_size <= 0 || esize <= 0) return 1;
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
    return 0;
}
