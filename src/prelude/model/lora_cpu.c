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
