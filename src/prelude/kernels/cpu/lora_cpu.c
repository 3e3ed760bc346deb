/* The LoRA delta of a few-token CPU forward (decode), BGMV-style: every token reads its
 * own adapter's slot, so one call serves any mix of adapters and the base.
 *
 *   out[t, :] += (x[t, :] @ A[s, :, :]) @ B[s, :, :]   for s = slots[t] >= 0
 *
 * x: [T, in] (row stride sx), A: [S, in, W] and B: [S, W, out] contiguous (model/lora/adapters.py's
 * LoraSlots layout), out: [T, out] (row stride so). float32 or bfloat16 (`bf`) for all of
 * them, float32 sums; a bf16 output is rounded to nearest even once, after the sum (as
 * torch's addmm in bf16 rounds its result). One call replaces the three oneDNN/aten calls
 * of the all-slots path and reads only each token's own slot.
 *
 * bf16 on an AVX512-BF16 CPU: vdpbf16ps on pairs of rows interleaved in registers, y
 * rounded to bf16 between the products (as torch's x @ A is), and software prefetch: every
 * token streams its own adapter from memory, and prefetching ahead hides much of that
 * latency.
 * Elsewhere (AVX2) the portable loops below, which the compiler vectorizes.
 */
#include "prelude_kernels.h"
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#define MAX_WIDTH 1024  /* W = targets x rank: at most 3 x 341 */
#define MAX_OUT 65536

/* `k` targets share the slot (a fused projection: q/k/v or gate/up): target j owns rows
 * [j W/k, (j+1) W/k) of B and only columns [cols[j], cols[j+1]) of them are nonzero (B is
 * block diagonal), so the expand reads just those blocks. */
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define HAVE_BF16_DOT 1
#ifndef PF_ROWS
#define PF_ROWS 16
#endif
#ifndef PF_COLS
#define PF_COLS 128
#endif

/* Word indices that interleave two rows' 32 bf16 (vpermt2w): lo pairs their first 16
 * words, hi their last 16, as vdpbf16ps operand pairs. */
static inline __m512i pair_index(int half) {
    uint16_t ix[32];
    for (int i = 0; i < 16; i++) {
        ix[2 * i] = (uint16_t)(16 * half + i);
        ix[2 * i + 1] = (uint16_t)(32 + 16 * half + i);
    }
    return _mm512_loadu_si512(ix);
}

static inline __mmask32 mask32(int left) {
    return left >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << left) - 1);
}

/* One token's delta in bf16 with vdpbf16ps: pairs of A's rows (inputs) and of B's rows
 * (ranks) interleaved in registers. y is rounded to bf16 between the two products, as
 * torch's x @ A in bf16 is. */
static void bgmv_token_bf16(int n_in, int W, int n_out, const uint16_t *xt, const uint16_t *As, const uint16_t *Bs,
                            uint16_t *o, int k, const int *cols) {
    const __m512i ilo = pair_index(0), ihi = pair_index(1);
    const int R = W / k, Rp = (R + 1) & ~1;
    float y[MAX_WIDTH + 64] __attribute__((aligned(64)));
    uint16_t yb[MAX_WIDTH + 64];
    /* the first lines of every stream, ahead of the loops' own prefetches */
    for (long l = 0; l < (long)PF_ROWS * W && l < (long)n_in * W; l += 32) _mm_prefetch((const char *)(As + l), _MM_HINT_T0);
    for (int j = 0; j < k; j++)
        for (int r = 0; r < R; r++)
            for (int c = cols[j]; c < cols[j + 1] && c < cols[j] + PF_COLS; c += 32)
                _mm_prefetch((const char *)(Bs + (long)(j * R + r) * n_out + c), _MM_HINT_T1);
    for (int w0 = 0; w0 < W; w0 += 64) {  /* y[w0 : w0 + 64]: 4 accumulators, two input pairs apart */
        const __mmask32 m0 = mask32(W - w0), m1 = mask32(W - w0 - 32 > 0 ? W - w0 - 32 : 0);
        __m512 acc[2][4];
        for (int u = 0; u < 2; u++)
            for (int z = 0; z < 4; z++) acc[u][z] = _mm512_setzero_ps();
        int i = 0;
        for (; i + 4 <= n_in; i += 4) {
            /* prefetch A PF_ROWS rows ahead: the slots are far larger than the caches and
             * every token reads its own adapter, so decode streams them from memory */
            for (int l = 0; l < 4 * W; l += 32) _mm_prefetch((const char *)(As + (long)(i + PF_ROWS) * W + w0 + l), _MM_HINT_T0);
            for (int u = 0; u < 2; u++) {
                const uint16_t *a0 = As + (long)(i + 2 * u) * W + w0, *a1 = a0 + W;
                uint32_t xp;
                memcpy(&xp, xt + i + 2 * u, 4);
                const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xp);
                const __m512i r00 = _mm512_maskz_loadu_epi16(m0, a0), r10 = _mm512_maskz_loadu_epi16(m0, a1);
                const __m512i r01 = _mm512_maskz_loadu_epi16(m1, a0 + 32), r11 = _mm512_maskz_loadu_epi16(m1, a1 + 32);
                acc[u][0] = _mm512_dpbf16_ps(acc[u][0], (__m512bh)_mm512_permutex2var_epi16(r00, ilo, r10), xv);
                acc[u][1] = _mm512_dpbf16_ps(acc[u][1], (__m512bh)_mm512_permutex2var_epi16(r00, ihi, r10), xv);
                acc[u][2] = _mm512_dpbf16_ps(acc[u][2], (__m512bh)_mm512_permutex2var_epi16(r01, ilo, r11), xv);
                acc[u][3] = _mm512_dpbf16_ps(acc[u][3], (__m512bh)_mm512_permutex2var_epi16(r01, ihi, r11), xv);
            }
        }
        for (; i < n_in; i += 2) {  /* the last pair, or the last input alone */
            const uint16_t *a0 = As + (long)i * W + w0;
            const int two = i + 1 < n_in;
            const uint32_t xp = (uint32_t)xt[i] | (two ? (uint32_t)xt[i + 1] << 16 : 0u);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xp);
            const __m512i r00 = _mm512_maskz_loadu_epi16(m0, a0), r01 = _mm512_maskz_loadu_epi16(m1, a0 + 32);
            const __m512i r10 = two ? _mm512_maskz_loadu_epi16(m0, a0 + W) : _mm512_setzero_si512();
            const __m512i r11 = two ? _mm512_maskz_loadu_epi16(m1, a0 + W + 32) : _mm512_setzero_si512();
            acc[0][0] = _mm512_dpbf16_ps(acc[0][0], (__m512bh)_mm512_permutex2var_epi16(r00, ilo, r10), xv);
            acc[0][1] = _mm512_dpbf16_ps(acc[0][1], (__m512bh)_mm512_permutex2var_epi16(r00, ihi, r10), xv);
            acc[0][2] = _mm512_dpbf16_ps(acc[0][2], (__m512bh)_mm512_permutex2var_epi16(r01, ilo, r11), xv);
            acc[0][3] = _mm512_dpbf16_ps(acc[0][3], (__m512bh)_mm512_permutex2var_epi16(r01, ihi, r11), xv);
        }
        for (int z = 0; z < 4; z++) _mm512_store_ps(y + w0 + 16 * z, _mm512_add_ps(acc[0][z], acc[1][z]));
    }
    /* y in bf16, each target's ranks padded to even (pairs never cross targets) */
    for (int j = 0; j < k; j++) {
        for (int r = 0; r < R; r++) yb[j * Rp + r] = f32_to_bf16(y[j * R + r]);
        if (Rp > R) yb[j * Rp + R] = 0;
    }
    for (int j = 0; j < k; j++) {
        const int lo = cols[j], hi = cols[j + 1];
        for (int c0 = lo; c0 < hi; c0 += 32) {
            const __mmask32 m = mask32(hi - c0);
            __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
            for (int r = 0; r < R; r += 2) {
                const uint16_t *b0 = Bs + (long)(j * R + r) * n_out + c0;
                _mm_prefetch((const char *)(b0 + PF_COLS), _MM_HINT_T0);
                _mm_prefetch((const char *)(b0 + PF_COLS + 32), _MM_HINT_T0);
                _mm_prefetch((const char *)(b0 + n_out + PF_COLS), _MM_HINT_T0);
                _mm_prefetch((const char *)(b0 + n_out + PF_COLS + 32), _MM_HINT_T0);
                const __m512i r0 = _mm512_maskz_loadu_epi16(m, b0);
                const __m512i r1 = r + 1 < R ? _mm512_maskz_loadu_epi16(m, b0 + n_out) : _mm512_setzero_si512();
                uint32_t yp;
                memcpy(&yp, yb + j * Rp + r, 4);
                const __m512bh yv = (__m512bh)_mm512_set1_epi32((int)yp);
                acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_permutex2var_epi16(r0, ilo, r1), yv);
                acc1 = _mm512_dpbf16_ps(acc1, (__m512bh)_mm512_permutex2var_epi16(r0, ihi, r1), yv);
            }
            const __mmask16 k0 = (__mmask16)(m & 0xffffu), k1 = (__mmask16)(m >> 16);
            uint16_t *oc = o + c0;
            const __m512 o0 = _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(k0, oc));
            _mm256_mask_storeu_epi16(oc, k0, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(o0, acc0)));
            if (k1) {
                const __m512 o1 = _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(k1, oc + 16));
                _mm256_mask_storeu_epi16(oc + 16, k1, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(o1, acc1)));
            }
        }
    }
}
#endif

void lora_bgmv(int T, int n_in, int S, int W, int n_out, const void *x, long sx, const void *A, const void *B,
               void *out, long so, const int64_t *slots, int bf, int k, const int *cols) {
#ifdef HAVE_BF16_DOT
    if (bf) {
        #pragma omp parallel for if (T > 1) schedule(static)
        for (int t = 0; t < T; t++) {
            const int64_t s = slots[t];
            if (s < 0 || s >= S) continue;
            bgmv_token_bf16(n_in, W, n_out, (const uint16_t *)x + t * sx, (const uint16_t *)A + (long)s * n_in * W,
                            (const uint16_t *)B + (long)s * W * n_out, (uint16_t *)out + t * so, k, cols);
        }
        return;
    }
#endif
    #pragma omp parallel for if (T > 1) schedule(static)
    for (int t = 0; t < T; t++) {
        const int64_t s = slots[t];
        if (s < 0 || s >= S) continue;
        float y[MAX_WIDTH];
        static __thread float acc[MAX_OUT];
        for (int w = 0; w < W; w++) y[w] = 0.0f;
        for (int i = 0; i < n_in; i++) {
            const long a_off = ((long)s * n_in + i) * W;
            if (bf) {
                const float xi = bf16_to_f32(((const uint16_t *)x)[t * sx + i]);
                const uint16_t *a = (const uint16_t *)A + a_off;
                for (int w = 0; w < W; w++) y[w] += xi * bf16_to_f32(a[w]);
            } else {
                const float xi = ((const float *)x)[t * sx + i];
                const float *a = (const float *)A + a_off;
                for (int w = 0; w < W; w++) y[w] += xi * a[w];
            }
        }
        const int per = W / k;
        if (bf) {
            const uint16_t *o = (const uint16_t *)out + t * so;
            for (int j = 0; j < n_out; j++) acc[j] = 0.0f;
            for (int w = 0; w < W; w++) {
                const float yw = y[w];
                const int lo = cols[w / per], hi = cols[w / per + 1];
                const uint16_t *b = (const uint16_t *)B + ((long)s * W + w) * n_out;
                for (int j = lo; j < hi; j++) acc[j] += yw * bf16_to_f32(b[j]);
            }
            uint16_t *ow = (uint16_t *)out + t * so;
            for (int j = 0; j < n_out; j++) ow[j] = f32_to_bf16(bf16_to_f32(o[j]) + acc[j]);
        } else {
            float *o = (float *)out + t * so;
            for (int j = 0; j < n_out; j++) acc[j] = 0.0f;
            for (int w = 0; w < W; w++) {
                const float yw = y[w];
                const int lo = cols[w / per], hi = cols[w / per + 1];
                const float *b = (const float *)B + ((long)s * W + w) * n_out;
                for (int j = lo; j < hi; j++) acc[j] += yw * b[j];
            }
            for (int j = 0; j < n_out; j++) o[j] += acc[j];
        }
    }
}

/* The LoRA delta of a many-token CPU forward (prefill), SGMV-style, bf16 on an AVX512-BF16
 * CPU: tokens grouped by slot, one adapter's A and B repacked once per call into vdpbf16ps
 * pairs, then tiles of 8 tokens: y = x A (fp32 sums, rounded to bf16 as torch's x @ A
 * is), out += y B over B's diagonal blocks only, added to out in fp32 and rounded once.
 * Against one oneDNN shrink and one addmm_ per adapter (the torch grouped path), it skips
 * the zero blocks of a fused projection's B (2/3 of q/k/v's, 1/2 of gate/up's) and the
 * round trip of y through memory. Same arguments as lora_bgmv, bf16 only. */
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#include <stdlib.h>

#define TILE 8
#define MAX_WP (MAX_WIDTH + 64)  /* the repacked width: each target's rank rounded up to even, then to 16 */

int lora_sgmv_available(void) { return 1; }

static inline __m512bh pair_of(const uint16_t *p) {  /* two adjacent bf16, broadcast */
    uint32_t v;
    memcpy(&v, p, 4);
    return (__m512bh)_mm512_set1_epi32((int)v);
}

/* dst[2 c], dst[2 c + 1] = a0[c], a1[c] for c < n (a1 NULL: zeros), then zero pairs up to
 * npad: two rows of a matrix as vdpbf16ps operand pairs. */
static void interleave(uint16_t *dst, const uint16_t *a0, const uint16_t *a1, int n, int npad) {
    int c = 0;
    for (; c < n; c += 16) {
        const __mmask16 k = n - c >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - c)) - 1);
        const __m512i lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, a0 + c));
        const __m512i hi = a1 ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, a1 + c)) : _mm512_setzero_si512();
        _mm512_mask_storeu_epi32(dst + 2 * c, k, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
    if (npad > n) memset(dst + 2 * n, 0, sizeof(uint16_t) * 2 * (size_t)(npad - n));
}

/* y[m, w0 : w0 + 16 NZ] (bf16, row stride Wp) = x[rows m] @ Apack, Apack = [n_in/2, Wp, 2]. */
static inline __attribute__((always_inline)) void shrink_tile(const int NZ, const uint16_t *const *xr, int n_in,
                                                              const uint16_t *Ap, int Wp, int w0, uint16_t *y) {
    __m512 acc[TILE][3];
    for (int m = 0; m < TILE; m++)
        for (int z = 0; z < NZ; z++) acc[m][z] = _mm512_setzero_ps();
    const int full = n_in / 2;
    for (int i2 = 0; i2 < full; i2++) {
        __m512bh a[3];
        for (int z = 0; z < NZ; z++) a[z] = (__m512bh)_mm512_loadu_si512(Ap + ((long)i2 * Wp + w0 + 16 * z) * 2);
        for (int m = 0; m < TILE; m++) {
            const __m512bh xv = pair_of(xr[m] + 2 * i2);
            for (int z = 0; z < NZ; z++) acc[m][z] = _mm512_dpbf16_ps(acc[m][z], a[z], xv);
        }
    }
    if (n_in & 1) {  /* the last input alone: its pair's second half is zero in Apack and here */
        __m512bh a[3];
        for (int z = 0; z < NZ; z++) a[z] = (__m512bh)_mm512_loadu_si512(Ap + ((long)full * Wp + w0 + 16 * z) * 2);
        for (int m = 0; m < TILE; m++) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xr[m][n_in - 1]);
            for (int z = 0; z < NZ; z++) acc[m][z] = _mm512_dpbf16_ps(acc[m][z], a[z], xv);
        }
    }
    for (int m = 0; m < TILE; m++)
        for (int z = 0; z < NZ; z++)
            _mm256_storeu_si256((__m256i *)(y + m * Wp + w0 + 16 * z), (__m256i)_mm512_cvtneps_pbh(acc[m][z]));
}

/* out[rows m, c0 : c0 + 16 NZ] += y[m, yoff : yoff + Rp] @ Bpack[:, c0 :] (Bpack = [njp/16,
 * Rp/2, 16, 2], the StreamLayout's); columns at or past nj are padding and not stored; rows
 * past `count` are not. */
static inline __attribute__((always_inline)) void expand_tile(const int NZ, const uint16_t *y, int Wp, int yoff,
                                                              int Rp, const uint16_t *Bp, int njp, int nj, int c0,
                                                              uint16_t *const *orow, int count) {
    __m512 acc[TILE][3];
    const int whole = nj - c0 >= 16 * NZ;
    for (int m = 0; m < TILE; m++)  /* a whole chunk starts from out itself (one add less) */
        for (int z = 0; z < NZ; z++)
            acc[m][z] = whole ? _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i *)(orow[m] + c0 + 16 * z)))
                              : _mm512_setzero_ps();
    for (int r2 = 0; r2 < Rp / 2; r2++) {
        __m512bh b[3];
        for (int z = 0; z < NZ; z++) b[z] = (__m512bh)_mm512_loadu_si512(Bp + ((long)(c0 / 16 + z) * (Rp / 2) + r2) * 32);
        for (int m = 0; m < TILE; m++) {
            const __m512bh yv = pair_of(y + m * Wp + yoff + 2 * r2);
            for (int z = 0; z < NZ; z++) acc[m][z] = _mm512_dpbf16_ps(acc[m][z], b[z], yv);
        }
    }
    if (whole) {  /* plain stores: masked ones are slow on some AMD CPUs */
        for (int m = 0; m < count; m++)
            for (int z = 0; z < NZ; z++)
                _mm256_storeu_si256((__m256i *)(orow[m] + c0 + 16 * z), (__m256i)_mm512_cvtneps_pbh(acc[m][z]));
        return;
    }
    for (int m = 0; m < count; m++)
        for (int z = 0; z < NZ; z++) {
            const int left = nj - c0 - 16 * z;
            if (left <= 0) break;
            const __mmask16 k = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
            uint16_t *o = orow[m] + c0 + 16 * z;
            const __m512 ov = _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(k, o));
            _mm256_mask_storeu_epi16(o, k, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(ov, acc[m][z])));
        }
}

/* Slot s's A [n_in, W] -> Ap [n2, Wp, 2] (column j Rp + r holds target j's rank r) and
 * its B's diagonal blocks j [R, nj] -> Bp + boff[j] as [njp/16, Rp/2, 16, 2]: the
 * StreamLayout (lora_cpu.py), in which LoraSlots keeps bf16 slots (no repack then). */
static void repack(int s, int n_in, int W, int n_out, int k, const int *cols, int R, int Rp, int Wq, int Wp,
                   const uint16_t *Ab, const uint16_t *Bb, const long *boff, uint16_t *Ap, uint16_t *Bp) {
    const int n2 = (n_in + 1) / 2;
    for (int i2 = 0; i2 < n2; i2++) {
        const uint16_t *a0 = Ab + ((long)s * n_in + 2 * i2) * W;
        const uint16_t *a1 = 2 * i2 + 1 < n_in ? a0 + W : NULL;
        uint16_t *dst = Ap + (long)i2 * Wp * 2;
        for (int j = 0; j < k; j++) interleave(dst + 2 * j * Rp, a0 + j * R, a1 ? a1 + j * R : NULL, R, Rp);
        memset(dst + 2 * Wq, 0, sizeof(uint16_t) * 2 * (size_t)(Wp - Wq));
    }
    for (int j = 0; j < k; j++) {
        const int c_lo = cols[j], nj = cols[j + 1] - c_lo, njp = (nj + 15) & ~15;
        for (int r2 = 0; r2 < Rp / 2; r2++) {
            const uint16_t *b0 = Bb + ((long)s * W + j * R + 2 * r2) * n_out + c_lo;
            for (int c = 0; c < njp; c += 16)  /* one 16-column block of the pair of rows */
                interleave(Bp + boff[j] + ((long)(c / 16) * (Rp / 2) + r2) * 32, b0 + c, 2 * r2 + 1 < R ? b0 + n_out + c : NULL,
                           nj - c < 16 ? nj - c : 16, 16);
        }
    }
}

#define CHUNK_TILES 8  /* a work item: up to this many tiles of one slot (one repack each) */

/* A thread's repack scratch, kept between calls and grown when a projection needs more
 * (a few hundred KB at most): large allocations freed every call would be fresh mmaps,
 * page-faulted each time. */
static uint16_t *scratch(int which, size_t elems) {
    static __thread uint16_t *buf[2];
    static __thread size_t cap[2];
    if (elems > cap[which]) {
        free(buf[which]);
        const size_t bytes = (elems * sizeof(uint16_t) + 63) & ~(size_t)63;
        buf[which] = aligned_alloc(64, bytes);
        cap[which] = buf[which] ? bytes / sizeof(uint16_t) : 0;
    }
    return buf[which];
}

void lora_sgmv(int T, int n_in, int S, int W, int n_out, const void *x, long sx, const void *A, const void *B,
               void *out, long so, const int64_t *slots, int k, const int *cols, const void *P, long stride,
               long pboff) {
    const uint16_t *X = (const uint16_t *)x, *Ab = (const uint16_t *)A, *Bb = (const uint16_t *)B;
    uint16_t *O = (uint16_t *)out;
    const int R = W / k, Rp = (R + 1) & ~1, Wq = k * Rp, Wp = (Wq + 15) & ~15, n2 = (n_in + 1) / 2;
    if (Wp > MAX_WP || T <= 0 || S <= 0) return;
    /* tokens by slot (a counting sort: any mix of rows), then work items of up to
     * CHUNK_TILES tiles of one slot. Each thread repacks the slot of its item into its own
     * scratch (again only when the slot changes): one parallel region a call and no
     * barrier inside it, which a loaded machine makes costly. */
    int *start = calloc((size_t)S + 1, sizeof(int)), *order = malloc(sizeof(int) * (size_t)T);
    int *fill = malloc(sizeof(int) * (size_t)S), *items = malloc(sizeof(int) * 3 * (size_t)(T / TILE + S + 1));
    long *boff = malloc(sizeof(long) * (size_t)k);
    if (!start || !order || !fill || !items || !boff) goto done;
    long bsize = 0;
    for (int j = 0; j < k; j++) {
        boff[j] = bsize;
        bsize += (long)(Rp / 2) * (((cols[j + 1] - cols[j]) + 15) & ~15) * 2;
    }
    for (int t = 0; t < T; t++)
        if (slots[t] >= 0 && slots[t] < S) start[slots[t] + 1]++;
    for (int s = 0; s < S; s++) start[s + 1] += start[s];
    memcpy(fill, start, sizeof(int) * (size_t)S);
    for (int t = 0; t < T; t++)
        if (slots[t] >= 0 && slots[t] < S) order[fill[slots[t]]++] = t;
    int n_items = 0;
    for (int s = 0; s < S; s++)
        for (int first = start[s]; first < start[s + 1]; first += CHUNK_TILES * TILE) {
            items[3 * n_items] = s;
            items[3 * n_items + 1] = first;
            items[3 * n_items + 2] = first + CHUNK_TILES * TILE < start[s + 1] ? first + CHUNK_TILES * TILE : start[s + 1];
            n_items++;
        }
    #pragma omp parallel if (n_items > 1)
    {
        /* P: slots kept in the StreamLayout (A and B as the tiles read them): no repack */
        uint16_t *Ap = P ? NULL : scratch(0, (size_t)n2 * Wp * 2), *Bp = P ? NULL : scratch(1, (size_t)bsize);
        int packed = -1;
        #pragma omp for schedule(dynamic, 1)
        for (int it = 0; it < n_items; it++) {
            const int s = items[3 * it], lo = items[3 * it + 1], hi = items[3 * it + 2];
            if (P) {
                Ap = (uint16_t *)P + s * stride;
                Bp = Ap + pboff;
            } else if (!Ap || !Bp) {
                continue;
            } else if (packed != s) {
                repack(s, n_in, W, n_out, k, cols, R, Rp, Wq, Wp, Ab, Bb, boff, Ap, Bp);
                packed = s;
            }
            for (int first = lo; first < hi; first += TILE) {
                const int count = hi - first < TILE ? hi - first : TILE;
                const uint16_t *xr[TILE];
                uint16_t *orow[TILE];
                for (int m = 0; m < TILE; m++) {  /* a short tile repeats its first row (not stored) */
                    const int t = order[first + (m < count ? m : 0)];
                    xr[m] = X + (long)t * sx;
                    orow[m] = O + (long)t * so;
                }
                uint16_t y[TILE * MAX_WP] __attribute__((aligned(64)));
                for (int w0 = 0; w0 < Wp; w0 += 48) {
                    const int nz = (Wp - w0) / 16;
                    if (nz >= 3) shrink_tile(3, xr, n_in, Ap, Wp, w0, y);
                    else if (nz == 2) shrink_tile(2, xr, n_in, Ap, Wp, w0, y);
                    else shrink_tile(1, xr, n_in, Ap, Wp, w0, y);
                }
                for (int j = 0; j < k; j++) {
                    const int nj = cols[j + 1] - cols[j], njp = (nj + 15) & ~15;
                    uint16_t *oj[TILE];
                    for (int m = 0; m < TILE; m++) oj[m] = orow[m] + cols[j];
                    for (int c0 = 0; c0 < njp; c0 += 48) {
                        const int nz = (njp - c0) / 16;
                        if (nz >= 3) expand_tile(3, y, Wp, j * Rp, Rp, Bp + boff[j], njp, nj, c0, oj, count);
                        else if (nz == 2) expand_tile(2, y, Wp, j * Rp, Rp, Bp + boff[j], njp, nj, c0, oj, count);
                        else expand_tile(1, y, Wp, j * Rp, Rp, Bp + boff[j], njp, nj, c0, oj, count);
                    }
                }
            }
        }
    }
done:
    free(start);
    free(order);
    free(fill);
    free(items);
    free(boff);
}

/* The LoRA delta of a few-token forward (decode) on slots kept in the kernels' own layout
 * (lora_cpu.py's StreamLayout: how model/lora/adapters.py's LoraSlots holds bf16 slots here), bf16
 * on an AVX512-BF16 CPU. Slot s is one contiguous run P + s * stride: A as [n2, Wp, 2] (pairs of
 * inputs interleaved: vdpbf16ps operands as they are, no permute) then, at boff, each
 * target's diagonal block of B as [njp / 16, Rp / 2, 16, 2] (16 columns x all ranks
 * contiguous). Every token thus reads one sequential stream, which the hardware
 * prefetcher follows: against lora_bgmv's row-major slots (a permute per product, B read
 * across 16 rows at once, software prefetch) a decode step's deltas take less time, and
 * software prefetch on top of it did not help. Same sums as lora_bgmv: y = x A in
 * fp32, rounded to bf16, out += y B in fp32, rounded once. */
static inline __attribute__((always_inline)) void pk_shrink(const int NZ, const int U, int n_in, const uint16_t *xt,
                                                             const uint16_t *Ap, int Wp, int w0, float *y) {
    __m512 acc[8][3];  /* U pairs of inputs in flight: vdpbf16ps' latency, not its throughput */
    for (int u = 0; u < U; u++)
        for (int z = 0; z < NZ; z++) acc[u][z] = _mm512_setzero_ps();
    const int full = n_in / 2;
    int i2 = 0;
    for (; i2 + U <= full; i2 += U)
        for (int u = 0; u < U; u++) {
            const __m512bh xv = pair_of(xt + 2 * (i2 + u));
            for (int z = 0; z < NZ; z++)
                acc[u][z] = _mm512_dpbf16_ps(
                    acc[u][z], (__m512bh)_mm512_loadu_si512(Ap + ((long)(i2 + u) * Wp + w0 + 16 * z) * 2), xv);
        }
    for (; i2 < full; i2++) {
        const __m512bh xv = pair_of(xt + 2 * i2);
        for (int z = 0; z < NZ; z++)
            acc[0][z] = _mm512_dpbf16_ps(acc[0][z], (__m512bh)_mm512_loadu_si512(Ap + ((long)i2 * Wp + w0 + 16 * z) * 2), xv);
    }
    if (n_in & 1) {  /* the last input alone: its pair's second half is zero in Ap and here */
        const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xt[n_in - 1]);
        for (int z = 0; z < NZ; z++)
            acc[0][z] = _mm512_dpbf16_ps(acc[0][z], (__m512bh)_mm512_loadu_si512(Ap + ((long)full * Wp + w0 + 16 * z) * 2), xv);
    }
    for (int z = 0; z < NZ; z++) {
        __m512 sum = acc[0][z];
        for (int u = 1; u < U; u++) sum = _mm512_add_ps(sum, acc[u][z]);
        _mm512_store_ps(y + w0 + 16 * z, sum);
    }
}

/* o[16 c ...] += yb[0 : Rp] @ column blocks c = cb0 .. cb0 + NB of Bj ([nb, Rp/2, 16, 2]);
 * columns at or past nj are padding, not stored. */
static inline __attribute__((always_inline)) void pk_expand(const int NB, const uint16_t *yb, int Rp, const uint16_t *Bj,
                                                             int cb0, int nj, uint16_t *o) {
    __m512 acc[4];
    for (int c = 0; c < NB; c++) acc[c] = _mm512_setzero_ps();
    const int h = Rp / 2;
    const uint16_t *blk = Bj + (long)cb0 * h * 32;
    for (int r2 = 0; r2 < h; r2++) {
        const __m512bh yv = pair_of(yb + 2 * r2);
        for (int c = 0; c < NB; c++)
            acc[c] = _mm512_dpbf16_ps(acc[c], (__m512bh)_mm512_loadu_si512(blk + ((long)c * h + r2) * 32), yv);
    }
    for (int c = 0; c < NB; c++) {
        const int col = 16 * (cb0 + c), left = nj - col;
        uint16_t *oc = o + col;
        if (left >= 16) {  /* plain loads and stores: masked ones are slow on some AMD CPUs */
            const __m512 ov = _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i *)oc));
            _mm256_storeu_si256((__m256i *)oc, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(ov, acc[c])));
        } else {
            const __mmask16 m = (__mmask16)((1u << left) - 1);
            const __m512 ov = _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(m, oc));
            _mm256_mask_storeu_epi16(oc, m, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(ov, acc[c])));
        }
    }
}

static void packed_token(int n_in, int Wp, int Rp, int k, const int *cols, const uint16_t *xt, const uint16_t *Ap,
                         const uint16_t *Bp, uint16_t *o) {
    float y[MAX_WP] __attribute__((aligned(64)));
    uint16_t yb[MAX_WP] __attribute__((aligned(64)));
    for (int w0 = 0; w0 < Wp; w0 += 48) {
        const int nz = (Wp - w0) / 16;
        if (nz >= 3) pk_shrink(3, 4, n_in, xt, Ap, Wp, w0, y);
        else if (nz == 2) pk_shrink(2, 4, n_in, xt, Ap, Wp, w0, y);
        else pk_shrink(1, 8, n_in, xt, Ap, Wp, w0, y);
    }
    for (int w = 0; w < Wp; w += 32) {  /* y rounded to bf16 (as torch's x @ A is); Wp is a multiple of 16 */
        const __m512 lo = _mm512_load_ps(y + w), hi = w + 16 < Wp ? _mm512_load_ps(y + w + 16) : _mm512_setzero_ps();
        _mm512_store_si512(yb + w, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
    long boff = 0;
    for (int j = 0; j < k; j++) {
        const int nj = cols[j + 1] - cols[j], nb = (nj + 15) / 16;
        const uint16_t *Bj = Bp + boff, *yj = yb + j * Rp;
        uint16_t *oj = o + cols[j];
        int cb = 0;
        for (; cb + 4 <= nb; cb += 4) pk_expand(4, yj, Rp, Bj, cb, nj, oj);
        if (nb - cb == 3) pk_expand(3, yj, Rp, Bj, cb, nj, oj);
        else if (nb - cb == 2) pk_expand(2, yj, Rp, Bj, cb, nj, oj);
        else if (nb - cb == 1) pk_expand(1, yj, Rp, Bj, cb, nj, oj);
        boff += (long)nb * 16 * Rp;
    }
}

/* out[t] += (x[t] @ A[s]) @ B[s] for s = slots[t] in [0, S), on the packed layout above
 * (Wp: the packed width, a multiple of 16; Rp: each target's rank rounded up to even). */
void lora_bgmv_packed(int T, int n_in, int S, int Wp, int Rp, int k, const int *cols, const void *x, long sx,
                      const void *P, long stride, long boff, void *out, long so, const int64_t *slots) {
    if (Wp > MAX_WP || Wp % 16) return;
    const uint16_t *base = (const uint16_t *)P;
    #pragma omp parallel for if (T > 1) schedule(static)
    for (int t = 0; t < T; t++) {
        const int64_t s = slots[t];
        if (s < 0 || s >= S) continue;
        packed_token(n_in, Wp, Rp, k, cols, (const uint16_t *)x + t * sx, base + s * stride, base + s * stride + boff,
                     (uint16_t *)out + t * so);
    }
}
#else
int lora_sgmv_available(void) { return 0; }

void lora_sgmv(int T, int n_in, int S, int W, int n_out, const void *x, long sx, const void *A, const void *B,
               void *out, long so, const int64_t *slots, int k, const int *cols, const void *P, long stride,
               long pboff) {
    (void)P; (void)stride; (void)pboff;
    (void)T; (void)n_in; (void)S; (void)W; (void)n_out; (void)x; (void)sx; (void)A; (void)B;
    (void)out; (void)so; (void)slots; (void)k; (void)cols;
}

void lora_bgmv_packed(int T, int n_in, int S, int Wp, int Rp, int k, const int *cols, const void *x, long sx,
                      const void *P, long stride, long boff, void *out, long so, const int64_t *slots) {
    (void)T; (void)n_in; (void)S; (void)Wp; (void)Rp; (void)k; (void)cols; (void)x; (void)sx; (void)P;
    (void)stride; (void)boff; (void)out; (void)so; (void)slots;
}
#endif

/* One projection's slots as lora_decode takes them, filled once when the slots are built
 * (lora_cpu.py's SlotOperands): a decode step makes about a hundred calls, and a ctypes
 * call's cost grows with its arguments, so a call passes only what changes (its tokens). P: the
 * StreamLayout slots (lora_bgmv_packed), or NULL (lora_bgmv on row-major A and B). */
typedef struct {
    int n_in, S, W, n_out, k, bf, Wp, Rp;
    const int *cols;
    const void *A, *B, *P;
    long stride, boff;
} LoraOperands;

void lora_decode(const LoraOperands *o, int T, const void *x, long sx, void *out, long so, const int64_t *slots) {
    if (o->P)
        lora_bgmv_packed(T, o->n_in, o->S, o->Wp, o->Rp, o->k, o->cols, x, sx, o->P, o->stride, o->boff, out, so, slots);
    else
        lora_bgmv(T, o->n_in, o->S, o->W, o->n_out, x, sx, o->A, o->B, out, so, slots, o->bf, o->k, o->cols);
}
