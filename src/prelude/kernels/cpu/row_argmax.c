/* First index of each row's maximum over float32 rows: torch.argmax(x, -1)'s answer
 * (the first of equal maxima; a NaN counts as the maximum, so its first index wins),
 * in two cheap passes instead of torch's index-tracking reduction, which does not
 * vectorize. Pass 1 takes the max of each block of BLOCK values (a plain max
 * reduction the compiler vectorizes) and keeps the first block whose max is strictly
 * the largest; pass 2 finds the first index of that max inside that block. Earlier
 * blocks' maxima are all smaller, so that index is the row's first maximum. */
#include "prelude_kernels.h"
#include <stdint.h>
#include <math.h>

enum { BLOCK = 256 };

static int64_t first_nan(const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (x[i] != x[i])
            return i;
    return -1;
}

static int64_t argmax_row(const float *x, int64_t n) {
    float best = -INFINITY;
    int64_t best_start = 0;
    for (int64_t start = 0; start < n; start += BLOCK) {
        const int64_t len = n - start < BLOCK ? n - start : BLOCK;
        const float *b = x + start;
        float m = -INFINITY;
        int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
        for (int64_t i = 0; i < len; i++) {
            m = b[i] > m ? b[i] : m;
            nan |= b[i] != b[i];
        }
        if (nan)
            return start + first_nan(b, len);
        if (m > best) {
            best = m;
            best_start = start;
        }
    }
    /* All -inf (or the row's max is -inf): the first index holding it. */
    for (int64_t i = best_start; i < n; i++)
        if (x[i] == best)
            return i;
    return 0;
}

/* rows x n values, row r at x + r * stride; out[r] = argmax of row r. */
void prelude_row_argmax(const float *x, int64_t rows, int64_t n, int64_t stride, int64_t *out) {
    for (int64_t r = 0; r < rows; r++)
        out[r] = argmax_row(x + r * stride, n);
}

/* The exponential race of sampler.py, per row: argmax over tokens of p / E with
 * E = -log(u) in float64 rounded to float32, u = uniform_noise(seed, position, token),
 * exactly the torch expression's values, without building the [rows, vocab] noise and
 * its ~20 int64 temporaries, which dominate torch's time for a few rows of a large vocabulary.
 * Most tokens cannot win: E >= 1 - u, so p / (1 - u) bounds a token's value, and a token
 * whose bound is below the best so far skips the log (a 1e-6 margin covers the float32
 * roundings and log's last bit). Ties keep the first index, NaN wins, as in argmax. */
static const uint64_t GOLDEN = 0x9E3779B97F4A7C15ull, MIX1 = 0xBF58476D1CE4E5B9ull,
                      MIX2 = 0x94D049BB133111EBull, POS = 0xD6E8FEB86659FD93ull;

static inline uint64_t splitmix(uint64_t x) {
    x = (x ^ (x >> 30)) * MIX1;
    x = (x ^ (x >> 27)) * MIX2;
    return x ^ (x >> 31);
}

static int64_t race_row(const float *p, int64_t n, uint64_t seed, uint64_t position) {
    const uint64_t row = splitmix(seed * GOLDEN + position * POS);
    float best = -INFINITY;
    int64_t best_i = 0;
    for (int64_t t = 0; t < n; t++) {
        const float pt = p[t];
        if (pt != pt)
            return t;
        if (pt <= 0.0f && best > 0.0f)
            continue; /* a token top-k / top-p dropped: 0 / E never beats a positive best */
        const uint64_t x = splitmix(row + (uint64_t)(t + 1) * GOLDEN);
        const double u = ((double)(x >> 11) + 0.5) * 0x1.0p-53;
        if (best > 0.0f && (double)pt / (1.0 - u) * (1.0 + 1e-6) < (double)best)
            continue;
        const float e = -(float)log(u);
        const float r = pt / e;
        if (r > best) {
            best = r;
            best_i = t;
        }
    }
    return best_i;
}

/* rows x n probabilities, row r at p + r * stride, drawn with seeds[r] at positions[r]. */
void prelude_race_argmax(const float *p, int64_t rows, int64_t n, int64_t stride, const int64_t *seeds,
                         const int64_t *positions, int64_t *out) {
    for (int64_t r = 0; r < rows; r++)
        out[r] = race_row(p + r * stride, n, (uint64_t)seeds[r], (uint64_t)positions[r]);
}
