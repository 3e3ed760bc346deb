/* The entry points of the CPU kernels, one prototype each: every C file that defines one
 * includes this header (so its definition is checked against the prototype), and
 * layer_loop.c takes the types of the functions it calls through pointers from here. The
 * ctypes declarations in the wrappers of the same names follow these prototypes. */
#ifndef PRELUDE_KERNELS_H
#define PRELUDE_KERNELS_H

#include <stdint.h>


/* amx_gemm.c */
int prelude_amx_gemm_ready(void);
int prelude_amx_gemm_pack(const uint16_t *w, int64_t n, int64_t k, uint32_t *wp, int threads);
int prelude_amx_gemm(const uint16_t *x, int64_t m, int64_t ldx, const uint32_t *wp, int64_t n, int64_t k, const
    uint16_t *bias, uint16_t *y, int64_t ldy, int threads);

/* bf16_rows.c */
int prelude_bf16_rows_amx_ready(void);
int prelude_bf16_rows_available(void);
int prelude_bf16_rows(const uint16_t *x, int64_t rows, int64_t stride_x, const uint16_t *w, int64_t out, int64_t k,
    const uint16_t *bias, uint16_t *y, int threads, int use_amx);

/* cpu_attention.c */
int prelude_attention_bf16_forms(void);
int prelude_attention_amx_ready(void);
int prelude_write_kv(const void *k, int64_t skt, int64_t skh, const void *v, int64_t svt, int64_t svh, void *kc, void
    *vc, int64_t scb, int64_t scs, int64_t sch, int64_t block_size, const int64_t *slots, int64_t t, int64_t kv_heads,
    int64_t d, int64_t esize, int threads);
int prelude_paged_attention(const void *q, int64_t sqt, int64_t sqh, const void *k, int64_t skt, int64_t skh, const
    void *v, int64_t svt, int64_t svh, const void *kc, const void *vc, int64_t scb, int64_t scs, int64_t sch, int64_t
    block_size, int64_t n_pre, const int64_t *pre_start, const int64_t *pre_len, const int64_t *pre_ctx, const int64_t
    *pre_own, const int64_t *pre_tables, int64_t pre_tstride, const int64_t *pre_tail, int64_t n_dec, const int64_t
    *dec_index, const int64_t *dec_ctx, const int64_t *dec_tables, int64_t dec_tstride, const int64_t *segments, const
    int64_t *slots, int64_t n_slots, void *out, int64_t sot, int64_t soh, int64_t heads, int64_t kv_heads, int64_t d,
    float scale, int bf16, int threads, int options, int64_t window);

/* cpu_fused.c */
int prelude_add_rms_norm(const void *x, int64_t stride_x, const void *r, int64_t stride_r, const void *w, void *h,
    void *out, int64_t rows, int64_t n, float eps, int threads, int bf);
int prelude_qk_norm_rope(const void *qkv, int64_t stride_qkv, int64_t rows, int64_t hq, int64_t hkv, int64_t d, const
    void *cos, const void *sin, const void *q_norm, const void *k_norm, float eps, void *q, void *k, void *v, int
    threads, int bf);
int prelude_silu_mul(const void *gate_up, int64_t stride_in, void *out, int64_t rows, int64_t n, int threads, int bf);

/* delta_rule.c */
int prelude_gated_delta_rule(const void *q, int64_t sq, const void *k, int64_t sk, const void *v, int64_t sv, const
    float *g, const float *beta, int64_t tokens, int64_t hk, int64_t hv, int64_t dk, int64_t dv, float scale, const
    int64_t *rows, int64_t n_rows, float *pool, int64_t n_pool, float *scratch, int64_t n_scratch, const int64_t *taps,
    int64_t n_taps, void *out, int bf, int threads);
int prelude_causal_conv(const void *x, int64_t sx, int64_t tokens, const void *w, int64_t channels, int64_t kw, const
    int64_t *rows, int64_t n_rows, void *pool, int64_t n_pool, void *scratch, int64_t n_scratch, const int64_t *taps,
    int64_t n_taps, void *out, int bf, int threads);
int prelude_gated_rms_norm(const void *x, const void *z, int64_t sz, const void *w, int64_t tokens, int64_t heads,
    int64_t d, float eps, void *out, int bf, int threads);

/* f32_gemm.c */
int prelude_f32_gemm_ready(void);
int prelude_f32_gemm_pack(const float *w, int64_t n, int64_t k, float *wp, int threads);
int prelude_f32_gemm(const float *x, int64_t m, int64_t ldx, const float *wp, int64_t n, int64_t k, const float *bias,
    float *y, int64_t ldy, int threads);

/* head_argmax.c */
int prelude_head_argmax_available(void);
int prelude_head_argmax_f32(const float *x, int64_t rows, const uint16_t *wb, const float *w, const float *wnorm,
    int64_t out, int64_t k, int64_t limit, float *scratch, int64_t *ids, int threads);

/* moe_experts.c */
int prelude_moe_experts_forms(void);
int64_t prelude_moe_packed_gate_up(int bf, int64_t hidden, int64_t inter);
int64_t prelude_moe_packed_down(int bf, int64_t hidden, int64_t inter);
int prelude_moe_pack(int bf, const void *gate_up, const void *down, int64_t experts, int64_t hidden, int64_t inter,
    void *gu_p, void *dn_p, int threads);
int prelude_moe_experts(int bf, const void *x, int64_t t_n, int64_t ldx, const int64_t *experts, const float *weights,
    int64_t k, const void *gu_p, const void *dn_p, int64_t e_n, int64_t hidden, int64_t inter, void *out, int64_t ldo,
    int threads);

/* quant_gemm.c */
int prelude_blocks_gemm(int kind, const float *x, int64_t M, int64_t K, const uint8_t *qs, const float *d, const float
    *m, int64_t N, const float *bias, float *y, int threads, float *xsum);
int prelude_blocks_gemm_bf16_available(void);
int prelude_blocks_gemm_bf16(int kind, const uint16_t *x, int64_t M, int64_t K, const uint8_t *qs, const float *d,
    const float *m, int64_t N, const uint16_t *bias, uint16_t *y, int threads, float *xsum);

/* row_argmax.c */
void prelude_row_argmax(const float *x, int64_t rows, int64_t n, int64_t stride, int64_t *out);
void prelude_race_argmax(const float *p, int64_t rows, int64_t n, int64_t stride, const int64_t *seeds, const int64_t
    *positions, int64_t *out);

/* row_gemv.c */
int prelude_row_gemv_available(void);
int prelude_row_gemv_f32(const float *x, const float *w, int64_t out, int64_t k, const float *bias, float *y, int
    threads);
int prelude_rows_gemm_blocked_f32(const float *x, int64_t rows, const float *wb, int64_t out, int64_t k, const float
    *bias, float *y, int threads);

#endif
