/* Gated DeltaNet's per-sequence work on the CPU (AVX2 + FMA, OpenMP), called through
 * ctypes by delta_rule.py: the gated delta rule over any number of rows in one call
 * (prompt rows of any length and one-token decode rows alike), the causal depthwise
 * conv + SiLU in front of it, and the gated RMSNorm after it.
 *
 * Rows. Both kernels take the step's rows as int64 [n, 4] (start, length, dst, src): the
 * row's tokens [start, start + length) of the flattened batch continue the state `src`
 * and leave theirs in `dst`. A state is named by its place: p >= 0 is slot p of the pool,
 * p <= -2 entry (-2 - p) of the step's scratch, and src -1 is a zero state. src == dst
 * continues a state in place (a decode row, a prompt chunk); a packed item names its
 * shared part's place as src and a scratch place of its own as dst. Rows run in the
 * order given, so a row may start from a place an earlier row wrote.
 *
 * Taps, int64 [m, 2] (token, place) sorted by token: after that token the row's state is
 * copied into that place too (the state at a position inside a prompt, e.g. for a prefix
 * checkpoint), without stopping the row. A later row may start from a tapped place.
 * A row of length 0 copies src into dst (a checkpoint of a state as it is).
 *
 * The delta rule, per value head h with state S [dk, dv] float32:
 *     S = exp(g_t) S;  S = S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t
 * over L2-normed q/k (q scaled by `scale`): the recurrent form, token by token. Each of
 * S's columns evolves on its own (a column's update reads that column only), so a work
 * unit is one head's block of VB columns, kept in a local buffer (L1) over all rows and
 * tokens; the units run in parallel. Per token a unit makes two passes over its block
 * (S^T k, then the update with S^T q), about 4 vector operations per element: fewer
 * operations than the chunked (WY) form's matrix products, and no solve.
 * The norms are folded into scalars (k_n = k / |k|: S^T k_n = (S^T k) / |k|).
 * Decays below exp(-60) are exactly 0 (subnormal floats would slow the arithmetic ~100x;
 * their terms are far below float32's rounding).
 *
 * bf16 inputs are widened exactly; outputs are rounded to nearest even, as torch rounds.
 */
#include "prelude_kernels.h"
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "native_shared.h"

#define VB 32          /* state columns per work unit: four 8-float registers */
#define NV (VB / 8)
#define MAX_DK 256     /* a unit's block [dk, VB] lives on the thread's stack */
#define CB 64          /* conv channels per work unit */
#define MAX_KW 8       /* conv taps */
#define LOG_ZERO (-60.0f)
#define INLINE static inline __attribute__((always_inline))

/* --- float32 <-> bfloat16 ---------------------------------------------------------- */

INLINE float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even, as torch's float -> bfloat16 conversion (NaN stays NaN). */
INLINE uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

INLINE float load1(const void *p, int64_t i, int bf) {
    return bf ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

INLINE void store1(void *p, int64_t i, float x, int bf) {
    if (bf) ((uint16_t *)p)[i] = f32_to_bf16(x);
    else ((float *)p)[i] = x;
}

INLINE __m256 load8(const void *p, int64_t i, int bf) {
    if (!bf) return _mm256_loadu_ps((const float *)p + i);
    const __m128i raw = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

/* 8 floats rounded to bf16 (nearest even), as floats: what a bf16 store then load gives. */
INLINE __m256 round8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))),
                                       _mm256_set1_epi32((int)0xffff0000u));
    const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    const __m256i quiet = _mm256_and_si256(_mm256_or_si256(u, _mm256_set1_epi32(0x00400000)),
                                           _mm256_set1_epi32((int)0xffff0000u));
    return _mm256_castsi256_ps(_mm256_blendv_epi8(r, quiet, _mm256_castps_si256(nan)));
}

/* Store 8 floats (already bf16-rounded when bf: the upper halves are taken). */
INLINE void store8(void *p, int64_t i, __m256 v, int bf) {
    if (!bf) {
        _mm256_storeu_ps((float *)p + i, v);
        return;
    }
    const __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(v), 16);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
    _mm_storeu_si128((__m128i *)((uint16_t *)p + i), packed);
}

/* exp8: native_shared.h */

/* Whether `place` names a state of the pool or the scratch (-1, a zero state, only where `zero`). */
INLINE int valid_place(int64_t place, int64_t n_pool, int64_t n_scratch, int zero) {
    return place >= 0 ? place < n_pool : place == -1 ? zero : -2 - place < n_scratch;
}

/* Whether the rows and taps stay within the tokens and the states (taps sorted by token). */
static int valid_rows(const int64_t *rows, int64_t n_rows, int64_t tokens, const int64_t *taps, int64_t n_taps,
                      int64_t n_pool, int64_t n_scratch) {
    for (int64_t r = 0; r < n_rows; r++) {
        const int64_t *row = rows + 4 * r;
        if (row[0] < 0 || row[1] < 0 || row[1] > tokens - row[0] || !valid_place(row[2], n_pool, n_scratch, 0) ||
            !valid_place(row[3], n_pool, n_scratch, 1))
            return 0;
    }
    for (int64_t i = 0; i < n_taps; i++)
        if (taps[2 * i] < 0 || taps[2 * i] >= tokens || (i && taps[2 * i] < taps[2 * i - 2]) ||
            !valid_place(taps[2 * i + 1], n_pool, n_scratch, 0))
            return 0;
    return 1;
}

/* --- the gated delta rule ------------------------------------------------------------ */

/* The first tap at or after token t (taps sorted by token). */
static int64_t first_tap(const int64_t *taps, int64_t n_taps, int64_t t) {
    int64_t lo = 0, hi = n_taps;
    while (lo < hi) {
        const int64_t mid = (lo + hi) / 2;
        if (taps[2 * mid] < t) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

INLINE float *state_at(float *pool, float *scratch, int64_t place, int64_t size) {
    return place >= 0 ? pool + place * size : scratch + (-2 - place) * size;
}

/* The unit's columns [j0, j0 + nj) of a state [dk, dv] into / out of the block [dk, VB]. */
static void block_in(float *blk, const float *state, int64_t dk, int64_t dv, int64_t j0, int64_t nj) {
    for (int64_t i = 0; i < dk; i++) {
        memcpy(blk + i * VB, state + i * dv + j0, nj * sizeof(float));
        memset(blk + i * VB + nj, 0, (VB - nj) * sizeof(float));
    }
}

static void block_out(const float *blk, float *state, int64_t dk, int64_t dv, int64_t j0, int64_t nj) {
    for (int64_t i = 0; i < dk; i++) memcpy(state + i * dv + j0, blk + i * VB, nj * sizeof(float));
}

/* One token of one unit: blk advances, o (VB floats) gets S^T q / |q| * scale. */
INLINE void delta_token(float *restrict blk, const float *restrict qf, const float *restrict kf, int64_t dk,
                        const float *restrict vb, float a, float b, float rq, float rk, float *restrict o) {
    __m256 acc[2][NV];
    for (int r = 0; r < NV; r++) acc[0][r] = acc[1][r] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 1 < dk; i += 2) {  /* S^T k, two rows at a time for independent chains */
        const __m256 k0 = _mm256_set1_ps(kf[i]), k1 = _mm256_set1_ps(kf[i + 1]);
        for (int r = 0; r < NV; r++) {
            acc[0][r] = _mm256_fmadd_ps(k0, _mm256_load_ps(blk + i * VB + 8 * r), acc[0][r]);
            acc[1][r] = _mm256_fmadd_ps(k1, _mm256_load_ps(blk + (i + 1) * VB + 8 * r), acc[1][r]);
        }
    }
    if (i < dk) {
        const __m256 k0 = _mm256_set1_ps(kf[i]);
        for (int r = 0; r < NV; r++) acc[0][r] = _mm256_fmadd_ps(k0, _mm256_load_ps(blk + i * VB + 8 * r), acc[0][r]);
    }
    /* delta = b (v - a S^T k_n); the update adds k_n delta^T = k (delta / |k|) */
    __m256 kd[NV];
    const __m256 ark = _mm256_set1_ps(a * rk), bv = _mm256_set1_ps(b * rk);
    for (int r = 0; r < NV; r++) {
        const __m256 sk = _mm256_add_ps(acc[0][r], acc[1][r]);
        kd[r] = _mm256_mul_ps(bv, _mm256_fnmadd_ps(ark, sk, _mm256_load_ps(vb + 8 * r)));
        acc[0][r] = acc[1][r] = _mm256_setzero_ps();
    }
    const __m256 av = _mm256_set1_ps(a);
    for (i = 0; i + 1 < dk; i += 2) {
        const __m256 k0 = _mm256_set1_ps(kf[i]), k1 = _mm256_set1_ps(kf[i + 1]);
        const __m256 q0 = _mm256_set1_ps(qf[i]), q1 = _mm256_set1_ps(qf[i + 1]);
        for (int r = 0; r < NV; r++) {
            float *p0 = blk + i * VB + 8 * r, *p1 = p0 + VB;
            const __m256 s0 = _mm256_fmadd_ps(k0, kd[r], _mm256_mul_ps(av, _mm256_load_ps(p0)));
            const __m256 s1 = _mm256_fmadd_ps(k1, kd[r], _mm256_mul_ps(av, _mm256_load_ps(p1)));
            _mm256_store_ps(p0, s0);
            _mm256_store_ps(p1, s1);
            acc[0][r] = _mm256_fmadd_ps(q0, s0, acc[0][r]);
            acc[1][r] = _mm256_fmadd_ps(q1, s1, acc[1][r]);
        }
    }
    if (i < dk) {
        const __m256 k0 = _mm256_set1_ps(kf[i]), q0 = _mm256_set1_ps(qf[i]);
        for (int r = 0; r < NV; r++) {
            float *p0 = blk + i * VB + 8 * r;
            const __m256 s0 = _mm256_fmadd_ps(k0, kd[r], _mm256_mul_ps(av, _mm256_load_ps(p0)));
            _mm256_store_ps(p0, s0);
            acc[0][r] = _mm256_fmadd_ps(q0, s0, acc[0][r]);
        }
    }
    const __m256 rqv = _mm256_set1_ps(rq);
    for (int r = 0; r < NV; r++) _mm256_storeu_ps(o + 8 * r, _mm256_mul_ps(rqv, _mm256_add_ps(acc[0][r], acc[1][r])));
}

/* x[0, n) widened to float32 into xf; 1 / sqrt(sum x^2 + eps), as transformers' l2norm (eps 1e-6). */
INLINE float widen_inv_norm(const void *x, int64_t at, int64_t n, int bf, float *restrict xf) {
    int64_t i = 0;
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 v = load8(x, at + i, bf);
        _mm256_storeu_ps(xf + i, v);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float lanes[8], s = 0.0f;
    _mm256_storeu_ps(lanes, acc);
    for (int j = 0; j < 8; j++) s += lanes[j];
    for (; i < n; i++) {
        xf[i] = load1(x, at + i, bf);
        s += xf[i] * xf[i];
    }
    return 1.0f / sqrtf(s + 1e-6f);
}

int prelude_gated_delta_rule(const void *q, int64_t sq, const void *k, int64_t sk, const void *v, int64_t sv,
                             const float *g, const float *beta, int64_t tokens, int64_t hk, int64_t hv, int64_t dk,
                             int64_t dv, float scale, const int64_t *rows, int64_t n_rows, float *pool,
                             int64_t n_pool, float *scratch, int64_t n_scratch, const int64_t *taps, int64_t n_taps, void *out, int bf, int threads) {
    if (dk < 1 || dk > MAX_DK || dv < 1 || hk < 1 || hv % hk || !valid_rows(rows, n_rows, tokens, taps, n_taps, n_pool, n_scratch))
        return 1;
    const int64_t nvb = (dv + VB - 1) / VB, units = hv * nvb, size = hv * dk * dv, group = hv / hk;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t u = 0; u < units; u++) {
        const int64_t h = u / nvb, kh = h / group, j0 = (u % nvb) * VB, nj = dv - j0 < VB ? dv - j0 : VB;
        float blk[MAX_DK * VB] __attribute__((aligned(32)));
        float qf[MAX_DK], kf[MAX_DK], vb[VB] __attribute__((aligned(32))), o[VB];
        const unsigned csr = _mm_getcsr();
        _mm_setcsr(csr | 0x8040);  /* flush subnormals to zero (FTZ, DAZ): see the header */
        memset(vb, 0, sizeof vb);
        for (int64_t r = 0; r < n_rows; r++) {
            const int64_t start = rows[4 * r], len = rows[4 * r + 1], dst = rows[4 * r + 2], src = rows[4 * r + 3];
            int64_t tap = first_tap(taps, n_taps, start);
            if (src == -1) memset(blk, 0, dk * VB * sizeof(float));
            else block_in(blk, state_at(pool, scratch, src, size) + h * dk * dv, dk, dv, j0, nj);
            for (int64_t t = start; t < start + len; t++) {
                const float rq = widen_inv_norm(q, t * sq + kh * dk, dk, bf, qf) * scale;
                const float rk = widen_inv_norm(k, t * sk + kh * dk, dk, bf, kf);
                for (int64_t j = 0; j < nj; j++) vb[j] = load1(v, t * sv + h * dv + j0 + j, bf);
                const float gt = g[t * hv + h], a = gt < LOG_ZERO ? 0.0f : expf(gt);
                delta_token(blk, qf, kf, dk, vb, a, beta[t * hv + h], rq, rk, o);
                for (int64_t j = 0; j < nj; j++) store1(out, (t * hv + h) * dv + j0 + j, o[j], bf);
                for (; tap < n_taps && taps[2 * tap] == t; tap++)
                    block_out(blk, state_at(pool, scratch, taps[2 * tap + 1], size) + h * dk * dv, dk, dv, j0, nj);
            }
            block_out(blk, state_at(pool, scratch, dst, size) + h * dk * dv, dk, dv, j0, nj);
        }
        _mm_setcsr(csr);
    }
    return 0;
}

/* --- the causal depthwise conv + SiLU ------------------------------------------------ */

/* SiLU(x) for 8 floats: x / (1 + e^-x), the quotient as torch's (its exp within ~1 ulp). */
INLINE __m256 silu8(__m256 x) {
    const __m256 e = exp8(_mm256_xor_ps(x, _mm256_set1_ps(-0.0f)));
    return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

int prelude_causal_conv(const void *x, int64_t sx, int64_t tokens, const void *w, int64_t channels, int64_t kw,
                        const int64_t *rows, int64_t n_rows, void *pool, int64_t n_pool, void *scratch,
                        int64_t n_scratch, const int64_t *taps, int64_t n_taps, void *out, int bf, int threads) {
    if (kw < 2 || kw > MAX_KW || channels < 1 || !valid_rows(rows, n_rows, tokens, taps, n_taps, n_pool, n_scratch))
        return 1;
    const int64_t width = kw - 1, size = channels * width, esize = bf ? 2 : 4, units = (channels + CB - 1) / CB;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t u = 0; u < units; u++) {
        const int64_t c0 = u * CB, nc = channels - c0 < CB ? channels - c0 : CB;
        /* taps transposed [kw][CB], the window of the last `width` inputs [width][CB] (a ring) */
        float wt[MAX_KW][CB] __attribute__((aligned(32))), win[MAX_KW][CB] __attribute__((aligned(32)));
        float xin[CB] __attribute__((aligned(32))), res[CB] __attribute__((aligned(32)));
        for (int64_t j = 0; j < kw; j++)
            for (int64_t c = 0; c < CB; c++) wt[j][c] = c < nc ? load1(w, (c0 + c) * kw + j, bf) : 0.0f;
        for (int64_t r = 0; r < n_rows; r++) {
            const int64_t start = rows[4 * r], len = rows[4 * r + 1], dst = rows[4 * r + 2], src = rows[4 * r + 3];
            int64_t tap = first_tap(taps, n_taps, start);
            const char *from = src == -1 ? 0 : (const char *)(src >= 0 ? pool : scratch) +
                                                   (src >= 0 ? src : -2 - src) * size * esize;
            for (int64_t j = 0; j < width; j++)
                for (int64_t c = 0; c < CB; c++)
                    win[j][c] = from && c < nc ? load1(from, (c0 + c) * width + j, bf) : 0.0f;
            int64_t head = 0;  /* win[head] holds the oldest input */
            for (int64_t t = start; t < start + len; t++) {
                const char *xt = (const char *)x + t * sx * esize;
                if (nc == CB) {
                    for (int64_t c = 0; c < CB; c += 8) _mm256_store_ps(xin + c, load8(xt, c0 + c, bf));
                } else {
                    for (int64_t c = 0; c < CB; c++) xin[c] = c < nc ? load1(xt, c0 + c, bf) : 0.0f;
                }
                for (int64_t c = 0; c < CB; c += 8) {
                    /* the sum in tap order, as one dot product per channel */
                    __m256 acc = _mm256_mul_ps(_mm256_load_ps(wt[0] + c), _mm256_load_ps(win[head % width] + c));
                    for (int64_t j = 1; j < width; j++)
                        acc = _mm256_fmadd_ps(_mm256_load_ps(wt[j] + c), _mm256_load_ps(win[(head + j) % width] + c),
                                              acc);
                    acc = _mm256_fmadd_ps(_mm256_load_ps(wt[width] + c), _mm256_load_ps(xin + c), acc);
                    if (bf) acc = round8(acc);  /* the conv's output is in the model dtype */
                    __m256 s = silu8(acc);
                    _mm256_store_ps(res + c, bf ? round8(s) : s);
                }
                memcpy(win[head % width], xin, sizeof xin);
                head = (head + 1) % width;
                char *ot = (char *)out + t * channels * esize;
                if (nc == CB) {
                    for (int64_t c = 0; c < CB; c += 8) store8(ot, c0 + c, _mm256_load_ps(res + c), bf);
                } else {
                    for (int64_t c = 0; c < nc; c++) store1(ot, c0 + c, res[c], bf);
                }
                for (; tap < n_taps && taps[2 * tap] == t; tap++) {
                    const int64_t p = taps[2 * tap + 1];
                    char *to = (char *)(p >= 0 ? pool : scratch) + (p >= 0 ? p : -2 - p) * size * esize;
                    for (int64_t j = 0; j < width; j++)
                        for (int64_t c = 0; c < nc; c++) store1(to, (c0 + c) * width + j, win[(head + j) % width][c], bf);
                }
            }
            char *to = (char *)(dst >= 0 ? pool : scratch) + (dst >= 0 ? dst : -2 - dst) * size * esize;
            for (int64_t j = 0; j < width; j++)
                for (int64_t c = 0; c < nc; c++) store1(to, (c0 + c) * width + j, win[(head + j) % width][c], bf);
        }
    }
    return 0;
}

/* --- the gated RMSNorm after the delta rule ------------------------------------------ */

/* out[t, h, :] = w * rms_norm(x[t, h, :]) * SiLU(z[t, h, :]) over d, with the eager ops'
 * roundings in bf16 (the normed value, its product with w, the gated product); x [T, H, d]
 * contiguous, z rows of token stride sz (heads contiguous), out [T, H, d] contiguous. */
int prelude_gated_rms_norm(const void *x, const void *z, int64_t sz, const void *w, int64_t tokens, int64_t heads,
                           int64_t d, float eps, void *out, int bf, int threads) {
    if (d < 1 || heads < 1) return 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (tokens * heads * d >= 32768)
    for (int64_t u = 0; u < tokens * heads; u++) {
        const int64_t t = u / heads, h = u % heads, xo = u * d, zo = t * sz + h * d;
        float ss = 0.0f;
        int64_t i = 0;
        __m256 acc = _mm256_setzero_ps();
        for (; i + 8 <= d; i += 8) {
            const __m256 v = load8(x, xo + i, bf);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, acc);
        for (int j = 0; j < 8; j++) ss += lanes[j];
        for (; i < d; i++) ss += load1(x, xo + i, bf) * load1(x, xo + i, bf);
        const float r = 1.0f / sqrtf(ss / (float)d + eps);
        const __m256 rv = _mm256_set1_ps(r);
        for (i = 0; i + 8 <= d; i += 8) {
            __m256 n = _mm256_mul_ps(load8(x, xo + i, bf), rv);
            if (bf) n = round8(n);
            n = _mm256_mul_ps(load8(w, i, bf), n);
            if (bf) n = round8(n);
            __m256 o = _mm256_mul_ps(n, silu8(load8(z, zo + i, bf)));
            store8(out, xo + i, bf ? round8(o) : o, bf);
        }
        for (; i < d; i++) {
            float n = load1(x, xo + i, bf) * r;
            if (bf) n = bf16_to_f32(f32_to_bf16(n));
            n = load1(w, i, bf) * n;
            if (bf) n = bf16_to_f32(f32_to_bf16(n));
            const float zv = load1(z, zo + i, bf);
            store1(out, xo + i, n * (zv / (1.0f + expf(-zv))), bf);
        }
    }
    return 0;
}
