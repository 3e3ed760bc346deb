/* A decoder's layer loop for one small step on the CPU, in one call.
 *
 * A step of SmolLM2-135M makes ~270 kernel calls (four projections, three elementwise
 * kernels and attention per layer), each through ctypes with its Python around it, and
 * that overhead is a sizeable share of a small decode step. Here the same kernels run
 * in the same order on the same buffers, called through the entry points of the libraries
 * that hold them (cpu_fused.c, bf16_rows.c, amx_gemm.c, quant_gemm.c, cpu_attention.c;
 * layer_loop.py passes their addresses), so a step's answers are bit for bit those of
 * the Python loop (fused_segments.py and the Decoder's last layer for the read
 * positions), which every other step still runs.
 *
 * bfloat16 or float32 activations (the model's dtype, `bf`); steps (decode rows and
 * prompts' rows: up to 32 tokens in bf16 on AMX, 128 where amx_gemm.c's tile form serves
 * every projection, 2,048 where its dot-product form or, in float32, f32_gemm.c does; up to
 * the blocks' bound in float32 without f32_gemm.c) where every projection has a C route: the
 * GGUF blocks up to their bound of rows, else (bf16) bf16_rows.c's tile form up to its
 * bound, the GEMM of our own past it (amx_gemm.c in bf16, f32_gemm.c in float32: one
 * signature). Returns 0, or the first
 * failing kernel's code plus 100 times its stage (nothing is undone: the caller raises).
 */
#include <stdint.h>
#include <string.h>

#include "prelude_kernels.h"

/* The kernels called through pointers, typed from their prototypes: the compiler checks
 * every call below against the definitions. */
typedef __typeof__(prelude_add_rms_norm) *norm_fn;
typedef __typeof__(prelude_qk_norm_rope) *rope_fn;
typedef __typeof__(prelude_silu_mul) *silu_fn;
typedef __typeof__(prelude_paged_attention) *attend_fn;
/* The GEMMs take either dtype's buffers (bf16 as uint16_t, or float): the forms of their
 * bf16 and float32 prototypes with untyped buffers. */
typedef int (*rows_fn)(const void *x, int64_t rows, int64_t stride_x, const void *w, int64_t out, int64_t k,
                       const void *bias, void *y, int threads, int use_amx);
typedef int (*gemm_fn)(const void *x, int64_t m, int64_t ldx, const void *wp, int64_t n, int64_t k, const void *bias,
                       void *y, int64_t ldy, int threads);
typedef int (*blocks_fn)(int kind, const void *x, int64_t m, int64_t k, const void *qs, const void *d, const void *mins,
                         int64_t n, const void *bias, void *y, int threads, float *xsum);

/* The GEMM routes this loop calls (model/layers/linear.py's C_ROUTES). */
enum { VIA_QUANT_BLOCKS = 0, VIA_TILE_ROWS = 1, VIA_OWN_GEMM = 2 };
#define ROUTE_SLOTS 3

/* One projection y [rows, out] = x [rows, k] W^T (+ bias): its plain weight (the model's
 * dtype; the tile form reads it in bf16), its GGUF blocks where it has them (kind < 0: none),
 * the packed copy of the GEMM of our own (amx_gemm.c's, f32_gemm.c's) where it has one
 * (NULL: none), and its routes as Projection.route chose them: a call of `rows` rows takes
 * via[i] for the first i with rows <= upto[i] (no rule of its own here). */
typedef struct {
    const void *weight, *bias;
    int64_t out, k;
    int32_t kind; /* quant_gemm.c's kind, or -1 */
    const void *qs, *d, *mins;
    const void *packed;
    int64_t upto[ROUTE_SLOTS]; /* ascending; unused slots 0 */
    int32_t via[ROUTE_SLOTS];
} Proj;

typedef struct {
    const void *input_norm, *post_norm, *q_norm, *k_norm; /* q/k norms: both or neither (NULL) */
    Proj qkv, o, gate_up, down;
    const void *k_cache, *v_cache;
} Layer;

typedef struct {
    norm_fn norm;
    rope_fn rope;
    silu_fn silu;
    rows_fn rows;
    gemm_fn gemm;
    blocks_fn blocks;
    attend_fn attend;
    int64_t n_layers, hidden, heads, kv_heads, head_dim, inter;
    float eps, scale;
    const Layer *layers;
    const void *final_norm;
    int64_t scb, scs, sch, block_size; /* every layer's K/V pool: strides (elements) and block size */
    int32_t attend_options;            /* the attention backend's options (OPT_AMX, OPT_ALL_WIDE) */
    int32_t bf;                        /* 1: bfloat16 activations and weights, 0: float32 */
} Model;

/* One step: its tokens' hidden states in and out, their rotary tables, the attention's rows
 * (cpu_attention.c's arguments: prompts' rows, decode rows, the K/V slots), the positions
 * read (read_index [n_read] and each prompt row's attended tail, or NULL: every position),
 * and the buffers the kernels write (the model's dtype, [rows, width] each; xsum float32
 * [rows * inter / 32]). */
typedef struct {
    int64_t rows;
    const void *h_in, *cos, *sin;
    int64_t n_pre;
    const int64_t *pre_start, *pre_len, *pre_ctx, *pre_own, *pre_tables;
    int64_t pre_tstride;
    int64_t n_dec;
    const int64_t *dec_index, *dec_ctx, *dec_tables;
    int64_t dec_tstride;
    const int64_t *slots;
    int64_t n_slots;
    int64_t n_read;
    const int64_t *read_index, *pre_tail;
    void *h_a, *h_b, *normed, *qkv, *q, *k, *v, *attn, *proj, *gate_up, *act;
    float *xsum;
    void *out;
    int32_t threads;
} Step;

/* y [rows, out] = x W^T through the route Projection takes for `rows` rows (the caller
 * takes only steps every projection has a route for) */
static int project(const Model *m, const Step *s, const Proj *p, int64_t rows, const void *x, void *y) {
    for (int i = 0; i < ROUTE_SLOTS; i++) {
        if (rows > p->upto[i]) continue;
        switch (p->via[i]) {
        case VIA_QUANT_BLOCKS:
            if (!m->blocks || p->kind < 0) return 52;
            return m->blocks(p->kind, x, rows, p->k, p->qs, p->d, p->mins, p->out, p->bias, y, s->threads, s->xsum);
        case VIA_TILE_ROWS:
            if (!m->rows) return 50;
            return m->rows(x, rows, p->k, p->weight, p->out, p->k, p->bias, y, s->threads, 1);
        case VIA_OWN_GEMM:
            if (!m->gemm || !p->packed) return 51;
            return m->gemm(x, rows, p->k, p->packed, p->out, p->k, p->bias, y, p->out, s->threads);
        default:
            return 53;
        }
    }
    return 54; /* past every route: the caller took a step this loop does not */
}

/* rows index[0..n-1] of x [*, width] (elements of esize bytes) packed at the front of dst */
static void gather_rows(const void *x, int64_t width, int64_t esize, const int64_t *index, int64_t n, void *dst) {
    const size_t row = (size_t)(width * esize);
    for (int64_t j = 0; j < n; j++) memcpy((char *)dst + j * row, (const char *)x + index[j] * row, row);
}

/* normed -> q, k, v of layer l (fused_segments.qkv_of) */
static int qkv_of(const Model *m, const Step *s, const Layer *l) {
    const int64_t width = (m->heads + 2 * m->kv_heads) * m->head_dim;
    int rc = project(m, s, &l->qkv, s->rows, s->normed, s->qkv);
    if (rc) return 100 + rc;
    rc = m->rope(s->qkv, width, s->rows, m->heads, m->kv_heads, m->head_dim, s->cos, s->sin, l->q_norm, l->k_norm,
                 m->eps, s->q, s->k, s->v, s->threads, m->bf);
    return rc ? 200 + rc : 0;
}

int prelude_layer_loop(const Model *m, const Step *s) {
    const int64_t hd = m->head_dim, hidden = m->hidden;
    const int64_t q_width = m->heads * hd, kv_width = m->kv_heads * hd, esize = m->bf ? 2 : 4;
    if (s->rows < 1 || m->n_layers < 1 || s->n_read < 1) return 1;
    /* first: RMSNorm of the embeddings (no residual yet) */
    int rc = m->norm(s->h_in, hidden, 0, 0, m->layers[0].input_norm, 0, s->normed, s->rows, hidden, m->eps,
                     s->threads, m->bf);
    if (rc) return 300 + rc;
    if ((rc = qkv_of(m, s, &m->layers[0]))) return rc;
    const void *h = s->h_in; /* the residual stream, written to h_a and h_b in turn */
    void *spare = s->h_a;
    int64_t rows = s->rows;
    for (int64_t i = 0; i < m->n_layers; i++) {
        const Layer *l = &m->layers[i];
        const int last = i + 1 == m->n_layers;
        rc = m->attend(s->q, q_width, hd, s->k, kv_width, hd, s->v, kv_width, hd, l->k_cache, l->v_cache, m->scb,
                       m->scs, m->sch, m->block_size, s->n_pre, s->pre_start, s->pre_len, s->pre_ctx, s->pre_own,
                       s->pre_tables, s->pre_tstride, last ? s->pre_tail : 0, s->n_dec, s->dec_index, s->dec_ctx,
                       s->dec_tables, s->dec_tstride, 0, s->slots, s->n_slots, s->attn, q_width, hd, m->heads,
                       m->kv_heads, hd, m->scale, m->bf, s->threads, m->attend_options, 0);
        if (rc) return 400 + rc;
        const void *attn = s->attn;
        if (last && s->read_index) { /* the last layer for the read positions only, in their order */
            gather_rows(h, hidden, esize, s->read_index, s->n_read, spare);
            gather_rows(s->attn, q_width, esize, s->read_index, s->n_read, s->q); /* q is read no more */
            h = spare;
            spare = spare == s->h_a ? s->h_b : s->h_a;
            attn = s->q;
            rows = s->n_read;
        }
        /* fused_segments.tail: h, normed = add_rms_norm(h, o_proj(attn)); mlp = down(silu_mul(gate_up(normed))) */
        if ((rc = project(m, s, &l->o, rows, attn, s->proj))) return 500 + rc;
        if ((rc = m->norm(h, hidden, s->proj, hidden, l->post_norm, spare, s->normed, rows, hidden, m->eps,
                          s->threads, m->bf)))
            return 600 + rc;
        h = spare;
        spare = spare == s->h_a ? s->h_b : s->h_a;
        if ((rc = project(m, s, &l->gate_up, rows, s->normed, s->gate_up))) return 700 + rc;
        if ((rc = m->silu(s->gate_up, 2 * m->inter, s->act, rows, m->inter, s->threads, m->bf))) return 800 + rc;
        if ((rc = project(m, s, &l->down, rows, s->act, s->proj))) return 900 + rc;
        if (last) /* the final norm of h + mlp */
            return (rc = m->norm(h, hidden, s->proj, hidden, m->final_norm, spare, s->out, rows, hidden, m->eps,
                                 s->threads, m->bf))
                       ? 1000 + rc
                       : 0;
        /* between: h, normed = add_rms_norm(h, mlp, next input_norm); the next layer's q, k, v */
        if ((rc = m->norm(h, hidden, s->proj, hidden, m->layers[i + 1].input_norm, spare, s->normed, rows, hidden,
                          m->eps, s->threads, m->bf)))
            return 1100 + rc;
        h = spare;
        spare = spare == s->h_a ? s->h_b : s->h_a;
        if ((rc = qkv_of(m, s, &m->layers[i + 1]))) return rc;
    }
    return 0;
}
