/* The elementwise work between a decoder layer's GEMMs, fused, on the CPU (AVX2 + FMA,
 * OpenMP over rows), for float32 and bfloat16 activations: the same four operations as the
 * Triton kernels of kernels/triton/fused.py, called through ctypes by cpu_fused.py.
 *
 * Eagerly that work is about 25 torch ops per layer, each a full pass over its operands
 * plus its dispatch cost; here it is four calls per layer, each one pass.
 *
 * Numerics follow the eager ops (decoder_segments.py) operation by operation: every
 * product and sum an eager op rounds is rounded here too (no contraction: built with
 * -ffp-contract=off, and no FMA intrinsic outside the exp polynomial and the sums of
 * squares), so the residual add and the rotary are bit-identical to the eager ops and
 * RMSNorm differs only by the order of its sum. SiLU uses its own exp (~1 ulp).
 * In bfloat16 the math is float32 inside and every result an eager bf16 op would round
 * to bf16 is rounded here too (round to nearest even, as torch does), so the outputs are
 * the eager ops' bf16 values up to the same sum-order and exp differences.
 *
 * Rows may be strided (row stride in elements); the last dimension is contiguous.
 * `bf` (0: float32, 1: bfloat16) is the activations' and the weights' dtype.
 */
#include "prelude_kernels.h"
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "native_shared.h"

/* Parallel only where a row loop has enough work to pay for waking the team. */
#define PAR_MIN_ELEMENTS 32768
#define INLINE static inline __attribute__((always_inline))

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* --- float32 <-> bfloat16: a bf16 is a float's upper 16 bits ------------------------- */

static inline float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even, as torch's float -> bfloat16 conversion (NaN stays NaN). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

static inline __m256 load_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
/* The CPU converts (AVX512-BF16: one instruction, round to nearest even, NaN kept quiet). */
static inline __m128i to_bf16x8(__m256 v) { return (__m128i)_mm256_cvtneps_pbh(v); }

static inline __m256 round8_bf16(__m256 v) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(to_bf16x8(v)), 16));
}
#else
/* 8 floats rounded to nearest even in their upper 16 bits (lower bits cleared): the bf16
 * values as floats. NaN lanes become quiet NaNs. */
static inline __m256i bf16_bits(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    r = _mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u));
    const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    const __m256i qnan = _mm256_or_si256(u, _mm256_set1_epi32(0x00400000));
    return _mm256_blendv_epi8(r, _mm256_and_si256(qnan, _mm256_set1_epi32((int)0xffff0000u)), _mm256_castps_si256(nan));
}

static inline __m256 round8_bf16(__m256 v) { return _mm256_castsi256_ps(bf16_bits(v)); }

static inline __m128i to_bf16x8(__m256 v) {
    const __m256i hi = _mm256_srli_epi32(bf16_bits(v), 16);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(hi, hi), 0xD8));
}
#endif

static inline void store_bf16(uint16_t *p, __m256 v) { _mm_storeu_si128((__m128i *)p, to_bf16x8(v)); }

/* Element i of a row in either dtype, as float (p: the row). */
INLINE float ld1(const int bf, const void *p, int64_t i) {
    return bf ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

INLINE __m256 ld8(const int bf, const void *p, int64_t i) {
    return bf ? load_bf16((const uint16_t *)p + i) : _mm256_loadu_ps((const float *)p + i);
}

INLINE void st1(const int bf, void *p, int64_t i, float v) {
    if (bf) ((uint16_t *)p)[i] = f32_to_bf16(v);
    else ((float *)p)[i] = v;
}

INLINE void st8(const int bf, void *p, int64_t i, __m256 v) {
    if (bf) store_bf16((uint16_t *)p + i, v);
    else _mm256_storeu_ps((float *)p + i, v);
}

/* What an eager op in the dtype stores: the float result rounded to bf16 in bf16. */
INLINE float rnd1(const int bf, float v) { return bf ? round_bf16(v) : v; }
INLINE __m256 rnd8(const int bf, __m256 v) { return bf ? round8_bf16(v) : v; }

INLINE const void *row_at(const int bf, const void *p, int64_t i) {
    return (const char *)p + i * (bf ? 2 : 4);
}

INLINE void *row_at_w(const int bf, void *p, int64_t i) { return (char *)p + i * (bf ? 2 : 4); }

/* sum of x[i]^2 in float32, the squares rounded before they are summed (as pow(2) then
 * mean on the float32 copy of x). */
INLINE float sum_squares(const int bf, const void *x, int64_t n) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256 a = ld8(bf, x, i), b = ld8(bf, x, i + 8);
        acc0 = _mm256_add_ps(acc0, _mm256_mul_ps(a, a));
        acc1 = _mm256_add_ps(acc1, _mm256_mul_ps(b, b));
    }
    float s = hsum(_mm256_add_ps(acc0, acc1));
    for (; i < n; i++) {
        const float v = ld1(bf, x, i);
        s += v * v;
    }
    return s;
}

static inline float inv_rms(float sum_sq, int64_t n, float eps) {
    return 1.0f / sqrtf(sum_sq / (float)n + eps);
}

/* dst[i] = w[i] * (src[i] * inv): normalize in float32, round to the dtype, scale (two
 * roundings, as eagerly). src and dst in the dtype (`dst_f32`: dst is float32 scratch of
 * the dtype's values instead). */
INLINE void scale_row(const int bf, const void *src, const void *w, float inv, void *dst, int dst_f32, int64_t n) {
    const __m256 vinv = _mm256_set1_ps(inv);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_mul_ps(ld8(bf, w, i), rnd8(bf, _mm256_mul_ps(ld8(bf, src, i), vinv)));
        if (dst_f32) _mm256_storeu_ps((float *)dst + i, rnd8(bf, v));
        else st8(bf, dst, i, v);
    }
    for (; i < n; i++) {
        const float v = ld1(bf, w, i) * rnd1(bf, ld1(bf, src, i) * inv);
        if (dst_f32) ((float *)dst)[i] = rnd1(bf, v);
        else st1(bf, dst, i, v);
    }
}

INLINE void add_rms_norm_rows(const int bf, const void *x, int64_t stride_x, const void *r, int64_t stride_r,
                              const void *w, void *h, void *out, int64_t rows, int64_t n, float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * n >= PAR_MIN_ELEMENTS)
    for (int64_t t = 0; t < rows; t++) {
        const void *xs = row_at(bf, x, t * stride_x);
        const void *src = xs;
        if (r != 0) {
            const void *rs = row_at(bf, r, t * stride_r);
            void *hs = row_at_w(bf, h, t * n);
            int64_t i = 0;
            for (; i + 8 <= n; i += 8) st8(bf, hs, i, _mm256_add_ps(ld8(bf, xs, i), ld8(bf, rs, i)));
            for (; i < n; i++) st1(bf, hs, i, ld1(bf, xs, i) + ld1(bf, rs, i));
            src = hs;  /* the rounded sum, read back from cache */
        }
        scale_row(bf, src, w, inv_rms(sum_squares(bf, src, n), n, eps), row_at_w(bf, out, t * n), 0, n);
    }
}

/* h = x + r (r may be NULL: h = x, not written) and out = RMSNorm(h) * w, row by row. */
int prelude_add_rms_norm(const void *x, int64_t stride_x, const void *r, int64_t stride_r, const void *w, void *h,
                         void *out, int64_t rows, int64_t n, float eps, int threads, int bf) {
    if (n <= 0 || rows < 0) return 1;
    if (bf) add_rms_norm_rows(1, x, stride_x, r, stride_r, w, h, out, rows, n, eps, threads);
    else add_rms_norm_rows(0, x, stride_x, r, stride_r, w, h, out, rows, n, eps, threads);
    return 0;
}

/* One head of one token: optional RMSNorm over the head (weights nw), then HF's
 * rotate_half rotary: dst = x * cos + cat(-x2, x1) * sin, each product and the sum
 * rounded to the dtype. */
INLINE void rotary_head(const int bf, const void *src, void *dst, const void *nw, float eps, const void *cos,
                        const void *sin, int64_t d, float *tmp) {
    /* the head's values as float32 (after the norm, rounded to the dtype); float32 rows
     * without a norm are read in place */
    const float *x = tmp;
    if (nw != 0) {
        scale_row(bf, src, nw, inv_rms(sum_squares(bf, src, d), d, eps), tmp, 1, d);
    } else if (bf) {
        int64_t i = 0;
        for (; i + 8 <= d; i += 8) _mm256_storeu_ps(tmp + i, ld8(bf, src, i));
        for (; i < d; i++) tmp[i] = ld1(bf, src, i);
    } else {
        x = (const float *)src;
    }
    const int64_t half = d / 2;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    int64_t i = 0;
    for (; i + 8 <= half; i += 8) {
        const __m256 x1 = _mm256_loadu_ps(x + i), x2 = _mm256_loadu_ps(x + half + i);
        const __m256 lo = _mm256_add_ps(rnd8(bf, _mm256_mul_ps(x1, ld8(bf, cos, i))),
                                        rnd8(bf, _mm256_mul_ps(_mm256_xor_ps(x2, sign), ld8(bf, sin, i))));
        const __m256 hi = _mm256_add_ps(rnd8(bf, _mm256_mul_ps(x2, ld8(bf, cos, half + i))),
                                        rnd8(bf, _mm256_mul_ps(x1, ld8(bf, sin, half + i))));
        st8(bf, dst, i, lo);
        st8(bf, dst, half + i, hi);
    }
    for (; i < half; i++) {
        const float x1 = x[i], x2 = x[half + i];
        st1(bf, dst, i, rnd1(bf, x1 * ld1(bf, cos, i)) + rnd1(bf, (-x2) * ld1(bf, sin, i)));
        st1(bf, dst, half + i, rnd1(bf, x2 * ld1(bf, cos, half + i)) + rnd1(bf, x1 * ld1(bf, sin, half + i)));
    }
}

INLINE void qk_norm_rope_rows(const int bf, const void *qkv, int64_t stride_qkv, int64_t rows, int64_t hq,
                              int64_t hkv, int64_t d, const void *cos, const void *sin, const void *q_norm,
                              const void *k_norm, float eps, void *q, void *k, void *v, int threads) {
    const int64_t width = (hq + 2 * hkv) * d;
    const size_t elsize = bf ? 2 : 4;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * width >= PAR_MIN_ELEMENTS)
    for (int64_t t = 0; t < rows; t++) {
        float tmp[1024];
        const void *row = row_at(bf, qkv, t * stride_qkv);
        const void *c = row_at(bf, cos, t * d), *s = row_at(bf, sin, t * d);
        for (int64_t h = 0; h < hq; h++)
            rotary_head(bf, row_at(bf, row, h * d), row_at_w(bf, q, (t * hq + h) * d), q_norm, eps, c, s, d, tmp);
        for (int64_t h = 0; h < hkv; h++)
            rotary_head(bf, row_at(bf, row, (hq + h) * d), row_at_w(bf, k, (t * hkv + h) * d), k_norm, eps, c, s, d,
                        tmp);
        memcpy(row_at_w(bf, v, t * hkv * d), row_at(bf, row, (hq + hkv) * d), (size_t)(hkv * d) * elsize);
    }
}

/* qkv [T, (hq + 2 hkv) * d] (row stride stride_qkv) -> q [T, hq, d], k [T, hkv, d] rotated
 * (after per-head q/k RMSNorm where q_norm/k_norm are given), v [T, hkv, d] copied;
 * cos/sin [T, d] contiguous. d even, at most 1024. */
int prelude_qk_norm_rope(const void *qkv, int64_t stride_qkv, int64_t rows, int64_t hq, int64_t hkv, int64_t d,
                         const void *cos, const void *sin, const void *q_norm, const void *k_norm, float eps, void *q,
                         void *k, void *v, int threads, int bf) {
    if (d <= 0 || d % 2 != 0 || d > 1024 || rows < 0) return 1;
    if (bf) qk_norm_rope_rows(1, qkv, stride_qkv, rows, hq, hkv, d, cos, sin, q_norm, k_norm, eps, q, k, v, threads);
    else qk_norm_rope_rows(0, qkv, stride_qkv, rows, hq, hkv, d, cos, sin, q_norm, k_norm, eps, q, k, v, threads);
    return 0;
}

/* exp8: native_shared.h */

#if defined(__AVX512F__) && defined(__AVX512DQ__)  /* 16 lanes: insertf32x8 is AVX512DQ */
/* exp16 (exp8 on 16 lanes): native_shared.h */
INLINE __m512 ld16(const int bf, const void *p, int64_t i) {
    if (!bf) return _mm512_loadu_ps((const float *)p + i);
    const __m256i raw = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

#ifdef __AVX512BF16__
INLINE __m512 rnd16(const int bf, __m512 v) {
    if (!bf) return v;
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

INLINE void st16(const int bf, void *p, int64_t i, __m512 v) {
    if (bf) _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), (__m256i)_mm512_cvtneps_pbh(v));
    else _mm512_storeu_ps((float *)p + i, v);
}
#else
/* 16 lanes as two halves through the 8-lane rounding and store. */
INLINE __m512 rnd16(const int bf, __m512 v) {
    if (!bf) return v;
    const __m256 lo = round8_bf16(_mm512_castps512_ps256(v));
    const __m256 hi = round8_bf16(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}

INLINE void st16(const int bf, void *p, int64_t i, __m512 v) {
    if (!bf) {
        _mm512_storeu_ps((float *)p + i, v);
        return;
    }
    store_bf16((uint16_t *)p + i, _mm512_castps512_ps256(v));
    store_bf16((uint16_t *)p + i + 8, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
#endif
#endif

#if defined(__AVX512F__) && defined(__AVX512DQ__)
/* g / (1 + e^-g) on 16 lanes, float32 (rounded by the caller where the dtype is bf16) */
INLINE __m512 silu16(__m512 g) {
    const __m512 e = exp16(_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), _mm512_set1_epi32((int)0x80000000u))));
    return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}
#endif

INLINE void silu_mul_rows(const int bf, const void *gate_up, int64_t stride_in, void *out, int64_t rows, int64_t n,
                          int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * n >= PAR_MIN_ELEMENTS)
    for (int64_t t = 0; t < rows; t++) {
        const void *g = row_at(bf, gate_up, t * stride_in), *u = row_at(bf, g, n);
        void *o = row_at_w(bf, out, t * n);
        const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
        int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
        /* Two vectors an iteration: each is one long dependent chain (exp's polynomial, the
         * division), and the pair keeps the units busy (faster at every row count). */
        for (; i + 32 <= n; i += 32) {
            /* every load before the first store: o may alias the inputs for all the compiler knows */
            const __m512 sa = silu16(ld16(bf, g, i)), sb = silu16(ld16(bf, g, i + 16));
            const __m512 ua = ld16(bf, u, i), ub = ld16(bf, u, i + 16);
            st16(bf, o, i, _mm512_mul_ps(rnd16(bf, sa), ua));
            st16(bf, o, i + 16, _mm512_mul_ps(rnd16(bf, sb), ub));
        }
        for (; i + 16 <= n; i += 16)
            st16(bf, o, i, _mm512_mul_ps(rnd16(bf, silu16(ld16(bf, g, i))), ld16(bf, u, i)));
#endif
        for (; i + 8 <= n; i += 8) {
            const __m256 gv = ld8(bf, g, i);
            const __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_xor_ps(gv, sign))));
            st8(bf, o, i, _mm256_mul_ps(rnd8(bf, silu), ld8(bf, u, i)));
        }
        for (; i < n; i++) {
            const float gv = ld1(bf, g, i);
            st1(bf, o, i, rnd1(bf, gv / (1.0f + expf(-gv))) * ld1(bf, u, i));
        }
    }
}

/* gate_up [T, 2n] (row stride stride_in; gate then up) -> out [T, n] = SiLU(gate) * up,
 * SiLU(g) = g / (1 + e^-g) as torch computes it (rounded to the dtype before the product). */
int prelude_silu_mul(const void *gate_up, int64_t stride_in, void *out, int64_t rows, int64_t n, int threads, int bf) {
    if (n <= 0 || rows < 0) return 1;
    if (bf) silu_mul_rows(1, gate_up, stride_in, out, rows, n, threads);
    else silu_mul_rows(0, gate_up, stride_in, out, rows, n, threads);
    return 0;
}
