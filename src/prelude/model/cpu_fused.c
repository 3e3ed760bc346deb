/* The elementwise work between a decoder layer's GEMMs, fused, for float32 on the CPU
 * (AVX2 + FMA, OpenMP over rows): the same four operations as the Triton kernels of
 * fused_kernels.py, called through ctypes by cpu_fused_kernels.py.
 *
 * Eagerly that work is ~25 torch ops per layer, each a full pass over its operands plus
 * ~5 us of dispatch; here it is four calls per layer, each one pass.
 *
 * Numerics follow the eager ops (decoder_segments.py) operation by operation: every
 * product and sum an eager op rounds is rounded here too (no contraction: built with
 * -ffp-contract=off, and no FMA intrinsic outside the exp polynomial and the sums of
 * squares), so the residual add and the rotary are bit-identical to the eager ops and
 * RMSNorm differs only by the order of its sum. SiLU uses its own exp (~1 ulp).
 *
 * Rows may be strided (row stride in elements); the last dimension is contiguous.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

/* Parallel only where a row loop has enough work to pay for waking the team. */
#define PAR_MIN_ELEMENTS 32768

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* sum of x[i]^2, the squares rounded before they are summed (as pow(2) then mean). */
static inline float sum_squares(const float *x, int64_t n) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
        acc0 = _mm256_add_ps(acc0, _mm256_mul_ps(a, a));
        acc1 = _mm256_add_ps(acc1, _mm256_mul_ps(b, b));
    }
    float s = hsum(_mm256_add_ps(acc0, acc1));
    for (; i < n; i++) s += x[i] * x[i];
    return s;
}

static inline float inv_rms(float sum_sq, int64_t n, float eps) {
    return 1.0f / sqrtf(sum_sq / (float)n + eps);
}

/* dst[i] = w[i] * (src[i] * inv): normalize, then scale (two roundings, as eagerly). */
static inline void scale_row(const float *src, const float *w, float inv, float *dst, int64_t n) {
    const __m256 vinv = _mm256_set1_ps(inv);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(src + i), vinv)));
    for (; i < n; i++) dst[i] = w[i] * (src[i] * inv);
}

/* h = x + r (r may be NULL: h = x, not written) and out = RMSNorm(h) * w, row by row. */
int prelude_add_rms_norm(const float *x, int64_t stride_x, const float *r, int64_t stride_r, const float *w,
                         float *h, float *out, int64_t rows, int64_t n, float eps, int threads) {
    if (n <= 0 || rows < 0) return 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * n >= PAR_MIN_ELEMENTS)
    for (int64_t t = 0; t < rows; t++) {
        const float *xs = x + t * stride_x;
        const float *src = xs;
        if (r != 0) {
            const float *rs = r + t * stride_r;
            float *hs = h + t * n;
            int64_t i = 0;
            for (; i + 8 <= n; i += 8)
                _mm256_storeu_ps(hs + i, _mm256_add_ps(_mm256_loadu_ps(xs + i), _mm256_loadu_ps(rs + i)));
            for (; i < n; i++) hs[i] = xs[i] + rs[i];
            src = hs;
        }
        scale_row(src, w, inv_rms(sum_squares(src, n), n, eps), out + t * n, n);
    }
    return 0;
}

/* One head of one token: optional RMSNorm over the head (weights nw), then HF's
 * rotate_half rotary: dst = x * cos + cat(-x2, x1) * sin. */
static inline void rotary_head(const float *src, float *dst, const float *nw, float eps, const float *cos,
                               const float *sin, int64_t d, float *tmp) {
    const float *x = src;
    if (nw != 0) {
        scale_row(src, nw, inv_rms(sum_squares(src, d), d, eps), tmp, d);
        x = tmp;
    }
    const int64_t half = d / 2;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    int64_t i = 0;
    for (; i + 8 <= half; i += 8) {
        const __m256 x1 = _mm256_loadu_ps(x + i), x2 = _mm256_loadu_ps(x + half + i);
        const __m256 lo = _mm256_add_ps(_mm256_mul_ps(x1, _mm256_loadu_ps(cos + i)),
                                        _mm256_mul_ps(_mm256_xor_ps(x2, sign), _mm256_loadu_ps(sin + i)));
        const __m256 hi = _mm256_add_ps(_mm256_mul_ps(x2, _mm256_loadu_ps(cos + half + i)),
                                        _mm256_mul_ps(x1, _mm256_loadu_ps(sin + half + i)));
        _mm256_storeu_ps(dst + i, lo);
        _mm256_storeu_ps(dst + half + i, hi);
    }
    for (; i < half; i++) {
        const float x1 = x[i], x2 = x[half + i];
        dst[i] = x1 * cos[i] + (-x2) * sin[i];
        dst[half + i] = x2 * cos[half + i] + x1 * sin[half + i];
    }
}

/* qkv [T, (hq + 2 hkv) * d] (row stride stride_qkv) -> q [T, hq, d], k [T, hkv, d] rotated
 * (after per-head q/k RMSNorm where q_norm/k_norm are given), v [T, hkv, d] copied;
 * cos/sin [T, d] contiguous. d even, at most 1024. */
int prelude_qk_norm_rope(const float *qkv, int64_t stride_qkv, int64_t rows, int64_t hq, int64_t hkv, int64_t d,
                         const float *cos, const float *sin, const float *q_norm, const float *k_norm, float eps,
                         float *q, float *k, float *v, int threads) {
    if (d <= 0 || d % 2 != 0 || d > 1024 || rows < 0) return 1;
    const int64_t width = (hq + 2 * hkv) * d;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * width >= PAR_MIN_ELEMENTS)
    for (int64_t t = 0; t < rows; t++) {
        float tmp[1024];
        const float *row = qkv + t * stride_qkv, *c = cos + t * d, *s = sin + t * d;
        for (int64_t h = 0; h < hq; h++) rotary_head(row + h * d, q + (t * hq + h) * d, q_norm, eps, c, s, d, tmp);
        for (int64_t h = 0; h < hkv; h++)
            rotary_head(row + (hq + h) * d, k + (t * hkv + h) * d, k_norm, eps, c, s, d, tmp);
        const float *vs = row + (hq + hkv) * d;
        float *vd = v + t * hkv * d;
        for (int64_t i = 0; i < hkv * d; i++) vd[i] = vs[i];
    }
    return 0;
}

/* e^x for 8 floats (range reduction by ln 2, degree-5 polynomial; ~1 ulp). Inputs are
 * clamped to [-87.3, 88]: the result stays a normal float (2^-126 .. 2^127 * 1.4). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.33654f)), _mm256_set1_ps(88.0f));
    __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* gate_up [T, 2n] (row stride stride_in; gate then up) -> out [T, n] = SiLU(gate) * up,
 * SiLU(g) = g / (1 + e^-g) as torch computes it. */
int prelude_silu_mul(const float *gate_up, int64_t stride_in, float *out, int64_t rows, int64_t n, int threads) {
    if (n <= 0 || rows < 0) return 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * n >= PAR_MIN_ELEMENTS)
    for (int64_t t = 0; t < rows; t++) {
        const float *g = gate_up + t * stride_in, *u = g + n;
        float *o = out + t * n;
        const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_xor_ps(gv, sign))));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
        }
        for (; i < n; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
    return 0;
}
