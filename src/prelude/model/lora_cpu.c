/* The LoRA delta of a few-token CPU forward (decode), BGMV-style: every token reads its
 * own adapter's slot, so one call serves any mix of adapters and the base.
 *
 *   out[t, :] += (x[t, :] @ A[s, :, :]) @ B[s, :, :]   for s = slots[t] >= 0
 *
 * x: [T, in] (row stride sx), A: [S, in, W] and B: [S, W, out] contiguous (model/lora.py's
 * LoraSlots layout), out: [T, out] (row stride so). float32 or bfloat16 (`bf`) for all of
 * them, float32 math inside; a bf16 output is rounded to nearest even once, after the
 * sum (as torch's addmm in bf16 rounds its result). The inner loops run over contiguous
 * rows of A and B, so the compiler vectorizes them (-O3 -march=native). One call replaces
 * the three oneDNN/aten calls of the all-slots path and reads only each token's own slot.
 */
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
void lora_bgmv(int T, int n_in, int S, int W, int n_out, const void *x, long sx, const void *A, const void *B,
               void *out, long so, const int64_t *slots, int bf, int k, const int *cols) {
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

/* out[rows m, c0 : c0 + 16 NZ] += y[m, yoff : yoff + Rp] @ Bpack[:, c0 :] (Bpack = [Rp/2,
 * njp, 2]); columns at or past nj are padding and not stored; rows past `count` are not. */
static inline __attribute__((always_inline)) void expand_tile(const int NZ, const uint16_t *y, int Wp, int yoff,
                                                              int Rp, const uint16_t *Bp, int njp, int nj, int c0,
                                                              uint16_t *const *orow, int count) {
    __m512 acc[TILE][3];
    for (int m = 0; m < TILE; m++)
        for (int z = 0; z < NZ; z++) acc[m][z] = _mm512_setzero_ps();
    for (int r2 = 0; r2 < Rp / 2; r2++) {
        __m512bh b[3];
        for (int z = 0; z < NZ; z++) b[z] = (__m512bh)_mm512_loadu_si512(Bp + ((long)r2 * njp + c0 + 16 * z) * 2);
        for (int m = 0; m < TILE; m++) {
            const __m512bh yv = pair_of(y + m * Wp + yoff + 2 * r2);
            for (int z = 0; z < NZ; z++) acc[m][z] = _mm512_dpbf16_ps(acc[m][z], b[z], yv);
        }
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

void lora_sgmv(int T, int n_in, int S, int W, int n_out, const void *x, long sx, const void *A, const void *B,
               void *out, long so, const int64_t *slots, int k, const int *cols) {
    (void)n_out;
    const uint16_t *X = (const uint16_t *)x, *Ab = (const uint16_t *)A, *Bb = (const uint16_t *)B;
    uint16_t *O = (uint16_t *)out;
    const int R = W / k, Rp = (R + 1) & ~1, Wq = k * Rp, Wp = (Wq + 15) & ~15, n2 = (n_in + 1) / 2;
    if (Wp > MAX_WP) return;
    /* tokens by slot (a counting sort: any mix of rows, one repack per slot) */
    int *start = calloc((size_t)S + 1, sizeof(int)), *order = malloc(sizeof(int) * (size_t)(T > 0 ? T : 1));
    long bsize = 0;
    long *boff = malloc(sizeof(long) * (size_t)k);
    for (int j = 0; j < k; j++) {
        boff[j] = bsize;
        bsize += (long)(Rp / 2) * (((cols[j + 1] - cols[j]) + 15) & ~15) * 2;
    }
    uint16_t *Ap = aligned_alloc(64, (((size_t)n2 * Wp * 2 * 2) + 63) & ~(size_t)63);
    uint16_t *Bp = aligned_alloc(64, (((size_t)bsize * 2) + 63) & ~(size_t)63);
    if (!start || !order || !boff || !Ap || !Bp) goto done;
    for (int t = 0; t < T; t++)
        if (slots[t] >= 0 && slots[t] < S) start[slots[t] + 1]++;
    for (int s = 0; s < S; s++) start[s + 1] += start[s];
    {
        int *fill = malloc(sizeof(int) * (size_t)(S > 0 ? S : 1));
        if (!fill) goto done;
        memcpy(fill, start, sizeof(int) * (size_t)S);
        for (int t = 0; t < T; t++)
            if (slots[t] >= 0 && slots[t] < S) order[fill[slots[t]]++] = t;
        free(fill);
    }
    for (int s = 0; s < S; s++) {
        const int n = start[s + 1] - start[s];
        if (n == 0) continue;
        const int *rows = order + start[s];
        const int tiles = (n + TILE - 1) / TILE;
        #pragma omp parallel if (tiles > 1)
        {
            /* A[s] [n_in, W] -> Apack [n2, Wp, 2]: column j Rp + r holds target j's rank r */
            #pragma omp for schedule(static)
            for (int i2 = 0; i2 < n2; i2++) {
                const uint16_t *a0 = Ab + ((long)s * n_in + 2 * i2) * W;
                const uint16_t *a1 = 2 * i2 + 1 < n_in ? a0 + W : NULL;
                uint16_t *dst = Ap + (long)i2 * Wp * 2;
                for (int j = 0; j < k; j++) interleave(dst + 2 * j * Rp, a0 + j * R, a1 ? a1 + j * R : NULL, R, Rp);
                memset(dst + 2 * Wq, 0, sizeof(uint16_t) * 2 * (size_t)(Wp - Wq));
            }
            /* B[s]'s diagonal block j [R, nj] -> [Rp/2, njp, 2] */
            #pragma omp for schedule(static)
            for (int jr = 0; jr < k * (Rp / 2); jr++) {
                const int j = jr / (Rp / 2), r2 = jr % (Rp / 2);
                const int c_lo = cols[j], nj = cols[j + 1] - c_lo, njp = (nj + 15) & ~15;
                const uint16_t *b0 = Bb + ((long)s * W + j * R + 2 * r2) * n_out + c_lo;
                interleave(Bp + boff[j] + (long)r2 * njp * 2, b0, 2 * r2 + 1 < R ? b0 + n_out : NULL, nj, njp);
            }
            #pragma omp for schedule(static)
            for (int tile = 0; tile < tiles; tile++) {
                const int first = tile * TILE, count = n - first < TILE ? n - first : TILE;
                const uint16_t *xr[TILE];
                uint16_t *orow[TILE];
                for (int m = 0; m < TILE; m++) {  /* a short tile repeats its first row (not stored) */
                    const int t = rows[first + (m < count ? m : 0)];
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
    free(boff);
    free(Ap);
    free(Bp);
}
#else
int lora_sgmv_available(void) { return 0; }

void lora_sgmv(int T, int n_in, int S, int W, int n_out, const void *x, long sx, const void *A, const void *B,
               void *out, long so, const int64_t *slots, int k, const int *cols) {
    (void)T; (void)n_in; (void)S; (void)W; (void)n_out; (void)x; (void)sx; (void)A; (void)B;
    (void)out; (void)so; (void)slots; (void)k; (void)cols;
}
#endif
