/* A whole decode step of a Llama-family model in C: every layer, the final norm and the LM
 * head, for B sequences of one new token each, in one call (no Python between ops); or one
 * call per layer where the caller runs code between two layers (first_layer / end_layer of
 * pdserve_decode_step), the residual stream kept by the caller from one call to the next.
 *
 * Built and loaded by model_runtime/kernels/decode_step.py, which states the contract; the
 * plain reference is the torch model (model_runtime/model.py) on the same packed weights.
 * Runs in the engine thread of a worker process; the GEMMs (panel_gemm.c's column groups) and
 * the attention (decode_attention.c, one item per sequence) run on nthreads threads of the
 * claim-counter pool in pool.h, not OpenMP (pool.h says why).
 *
 * Per layer, for rows r < B (hidden x[r] kept in the weight dtype, as the torch model keeps
 * it, so bf16 rounds at the same points: after each residual add and each GEMM):
 *
 *     h = rmsnorm(x) * ln1                 (fp32 sum of squares; HF's two roundings in bf16)
 *     qkv = h @ Wqkv^T (+ bias)            panel GEMM, one call for q, k and v
 *     q, k = rope(q, k) at position len-1  rotate-half, HF's products, no FMA contraction
 *     K/V cache <- k, v at the slot        table[r][pos / bs] * block_stride + pos % bs rows
 *                                          (int8 cache: each head row quantized, kv_quant.h)
 *     a = attention(q, cache)              decode_attention.c's one_sequence, in place
 *     x = x + a @ Wo^T
 *     h = rmsnorm(x) * ln2
 *     g, u = split(h @ Wgu^T)              one GEMM for gate and up
 *     x = x + (silu(g) * u) @ Wdown^T
 *
 * then logits = rmsnorm(x) * norm @ Wlm^T in the weight dtype.
 *
 * Any GEMM's weight (and the embedding) may instead be kept quantized (its code != 0: qgemm.c's
 * Q8_0 / Q4_0 / Q4_1 panels), multiplied by qgemm.c's kernels (int8 path where m->int8) with
 * the same inputs and outputs in the weight dtype; the embedding rows are then dequantized.
 */
#include "panel_gemm.c"
#include "qgemm.c"
#include "decode_attention.c"
#include "pool.h"

#include <math.h>
#include <time.h>

#define MAX_HEAD_DIM 512 /* an int8 cache's rows are widened on the stack before quantizing */

/* Where a step's time goes (pdserve_decode_step's `op_seconds`, summed over layers). */
enum {
    OP_EMBED, OP_NORM, OP_QKV, OP_ROPE_KV, OP_ATTENTION, OP_O, OP_RESIDUAL, OP_GATE_UP,
    OP_ACT, OP_DOWN, OP_LM_HEAD, OP_COUNT
};

static inline double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* With op_seconds non-NULL, add the time since *t to op_seconds[op] and restart *t. */
static inline void lap(double *op_seconds, int op, double *t) {
    if (op_seconds == NULL) return;
    const double n = now_s();
    op_seconds[op] += n - *t;
    *t = n;
}

/* Per-layer pointers, in this order, in pd_model.layers (int64 each), then the four GEMM
 * weights' codes (0: panel_gemm panels in the weight dtype; else qgemm.c's QT_*). */
enum {
    L_LN1, L_QKV, L_QKV_BIAS, L_O, L_LN2, L_GATE_UP, L_DOWN, L_KV,
    L_QKV_CODE, L_O_CODE, L_GATE_UP_CODE, L_DOWN_CODE, L_FIELDS
};

typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, inter, vocab;
    int64_t block_size;   /* tokens per KV block */
    int64_t block_stride; /* elements from one block of a layer to the next */
    int64_t v_offset;     /* elements from a block's K half to its V half */
    int64_t max_position; /* rows of the rope tables */
    float eps, scale;
    int bf16;
    const void *embed;      /* [vocab, hidden] plain */
    const void *final_norm; /* [hidden] */
    const void *lm_head;    /* packed panels */
    const float *cos_table; /* [max_position, head_dim] fp32 */
    const float *sin_table;
    const int64_t *layers; /* [num_layers][L_FIELDS] addresses */
    /* int8 KV cache (model_runtime/kv_cache.py): values at the offsets above in bytes, the
     * float16 scales of K and V at ks_offset / vs_offset bytes into a block, scale_stride
     * scales from one block to the next. kv_int8 == 0: the cache holds the weight dtype. */
    int kv_int8;
    int64_t ks_offset, vs_offset, scale_stride;
    int64_t embed_code;    /* 0: embed is plain [vocab, hidden]; else its quantized type */
    int64_t lm_head_code;  /* 0: panel_gemm panels; else its quantized type */
    int64_t int8;          /* quantized weights: the int8 path (where the CPU has it) */
} pd_model;

static inline float ld(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void st(void *p, int64_t i, float f, int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = bf16_scalar(f);
    else
        ((float *)p)[i] = f;
}

/* The value a torch op in the weight dtype leaves: rounded to bf16 for bf16 models. */
static inline float rnd(float f, int bf16) { return bf16 ? bf16_to_f32(bf16_scalar(f)) : f; }

/* y = x @ W^T (+ bias) on the panel kernel (code 0) or qgemm.c's (a quantized type), its
 * column groups spread over the pool. xf: scratch for panel_gemm's packed x or qgemm's
 * activations (q_scratch_bytes). */
static int gemm(const pd_model *m, const void *x, int64_t rows, int64_t k, const void *w,
                int64_t code, int64_t n, const void *bias, void *y, float *xf, int nthreads) {
    if (rows <= 0 || k <= 0 || n <= 0) return -1;
    if (code != 0)
        return q_gemm(x, m->bf16, rows, k, w, (int)code, n, bias, y, xf, nthreads, (int)m->int8);
    const int64_t groups = (n + GROUP - 1) / GROUP;
    if (m->bf16) {
        pack_x_bf16(x, rows, k, xf);
        gemm_args_bf16 a = {xf, rows, k, n, groups, w, bias, y};
        pd_parallel_for(gemm_items_bf16(&a), nthreads, gemm_item_bf16, &a);
    } else {
        pack_x_f32(x, rows, k, xf);
        gemm_args_f32 a = {xf, rows, k, n, groups, w, bias, y};
        pd_parallel_for(gemm_items_f32(&a), nthreads, gemm_item_f32, &a);
    }
    return 0;
}

/* out = weight * dtype(x * rsqrt(mean(x^2) + eps)), as RMSNorm in model.py / HF. */
static void rmsnorm(const void *x, const void *w, int64_t n, float eps, int bf16, void *out) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        const float v = ld(x, i, bf16);
        ss += v * v;
    }
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++)
        st(out, i, ld(w, i, bf16) * rnd(ld(x, i, bf16) * inv, bf16), bf16);
}

/* Rotate-half RoPE of `heads` heads of x (in place) with one position's cos/sin rows:
 * x1' = x1 * c - x2 * s, x2' = x2 * c + x1 * s, as HF computes them (each product rounded,
 * then the sum; bf16 products round to bf16 as torch's bf16 ops do, with the tables in bf16). */
__attribute__((optimize("fp-contract=off"))) static void rope(void *x, int64_t heads,
                                                             int64_t D, const float *c,
                                                             const float *s, int bf16) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < heads; h++) {
        const int64_t o = h * D;
        for (int64_t i = 0; i < half; i++) {
            const float x1 = ld(x, o + i, bf16), x2 = ld(x, o + half + i, bf16);
            const float c1 = rnd(c[i], bf16), c2 = rnd(c[half + i], bf16);
            const float s1 = rnd(s[i], bf16), s2 = rnd(s[half + i], bf16);
            const float a1 = rnd(x1 * c1, bf16), b1 = rnd(x2 * -s1, bf16);
            const float a2 = rnd(x2 * c2, bf16), b2 = rnd(x1 * s2, bf16);
            st(x, o + i, a1 + b1, bf16);
            st(x, o + half + i, a2 + b2, bf16);
        }
    }
}

/* 8 values of the weight dtype as fp32, and back (bf16: round to nearest even). */
static inline __m256 load8_wt(const void *p, int64_t i, int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)p + i);
    __m128i raw = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

static inline void store8_wt(void *p, int64_t i, __m256 v, int bf16) {
    if (bf16)
        store_bf16x8((uint16_t *)p + i, v);
    else
        _mm256_storeu_ps((float *)p + i, v);
}

/* act[r] = silu(g) * u for one row of wide = [g | u] (2I values): silu rounded to the weight
 * dtype, then the product, as torch's two bf16 ops round. */
typedef struct {
    const char *wide;
    char *act;
    int64_t I;
    int bf16;
} act_args;

static void act_item(void *ctx, int64_t r) {
    const act_args *a = ctx;
    const int bf16 = a->bf16;
    const int64_t I = a->I, elem = bf16 ? 2 : 4;
    const char *g = a->wide + r * 2 * I * elem, *u = g + I * elem;
    char *out = a->act + r * I * elem;
    int64_t i = 0;
    for (; i + 8 <= I; i += 8) {
        const __m256 gv = load8_wt(g, i, bf16);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        __m256 s = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
        if (bf16) { /* silu's own rounding to bf16 */
            uint16_t tmp[8];
            store_bf16x8(tmp, s);
            s = load8_wt(tmp, 0, 1);
        }
        store8_wt(out, i, _mm256_mul_ps(s, load8_wt(u, i, bf16)), bf16);
    }
    for (; i < I; i++) {
        const float gs = ld(g, i, bf16);
        st(out, i, rnd(gs / (1.0f + expf(-gs)), bf16) * ld(u, i, bf16), bf16);
    }
}

/* One layer's attention for the decode rows, one row per pool item (scratch per row). */
typedef struct {
    const pd_model *m;
    const char *qkv;
    const char *kv;
    const int64_t *tables;
    int64_t table_stride;
    const int64_t *seq_lens;
    char *att;
    float *scratch;
    int64_t scratch_per_row;
} attn_args;

/* How one layer's cache is read (decode_attention.c's kv_src). */
static kv_src layer_kv(const pd_model *m, const char *kv) {
    if (m->kv_int8)
        return (kv_src){kv,
                        kv + m->v_offset,
                        (const uint16_t *)(kv + m->ks_offset),
                        (const uint16_t *)(kv + m->vs_offset),
                        m->block_stride,
                        m->scale_stride,
                        KV_I8};
    const int64_t elem = m->bf16 ? 2 : 4;
    return (kv_src){kv,   kv + m->v_offset * elem, NULL, NULL, m->block_stride, 0,
                    m->bf16 ? KV_BF16 : KV_F32};
}

/* Write row r's new K and V (qkv row after RoPE, weight dtype) into its slot: copied, or on an
 * int8 cache quantized one head row at a time with its scale (kv_quant.h: the bytes
 * model_runtime/kv_quant.py writes). */
static void write_kv_row(const pd_model *m, char *kv, const char *row, int64_t block,
                         int64_t off) {
    const int64_t KVH = m->kv_heads, D = m->head_dim, Q = m->heads * D, KV = KVH * D;
    const int64_t elem = m->bf16 ? 2 : 4;
    if (!m->kv_int8) {
        char *slot = kv + (block * m->block_stride + off * KV) * elem;
        memcpy(slot, row + Q * elem, KV * elem);
        memcpy(slot + m->v_offset * elem, row + (Q + KV) * elem, KV * elem);
        return;
    }
    float x[MAX_HEAD_DIM];
    for (int64_t half = 0; half < 2; half++) { /* K, then V */
        int8_t *vals = (int8_t *)kv + block * m->block_stride + half * m->v_offset + off * KV;
        uint16_t *scales = (uint16_t *)(kv + (half ? m->vs_offset : m->ks_offset)) +
                           block * m->scale_stride + off * KVH;
        const char *src = row + (Q + half * KV) * elem;
        for (int64_t h = 0; h < KVH; h++) {
            for (int64_t d = 0; d < D; d++) x[d] = ld(src, h * D + d, m->bf16);
            scales[h] = kvq_quantize_row(x, D, vals + h * D);
        }
    }
}

static void attn_item(void *ctx, int64_t r) {
    const attn_args *a = ctx;
    const pd_model *m = a->m;
    const int64_t NH = m->heads, D = m->head_dim, Q = NH * D, KV = m->kv_heads * D;
    const int64_t elem = m->bf16 ? 2 : 4;
    float *buf = a->scratch + a->scratch_per_row * r;
    const kv_src c = layer_kv(m, a->kv);
    one_sequence(a->qkv + r * (Q + 2 * KV) * elem, &c, a->tables + r * a->table_stride,
                 a->seq_lens[r], NH, m->kv_heads, D, m->block_size, m->scale, m->bf16,
                 a->att + r * Q * elem, buf, buf + NH * D, buf + 2 * NH * D);
}

/* Layers [first_layer, end_layer) of a decode step for B decode rows, on the residual stream
 * x_state ([B, hidden] in the weight dtype, the caller's, carried from one call to the next).
 * With first_layer == 0 the call first gathers the embeddings of tokens into x_state; with
 * head != 0 (only with end_layer == num_layers) it ends with the final norm and the LM head
 * into logits. So (0, L, head) is the whole step in one call, and (0, 1, 0), (1, 2, 0), ...,
 * (L - 1, L, 0), (L, L, 1) on the same x_state are the same step with the caller free to run
 * code between two layers (the same bits either way).
 * tokens[B]: the new token; tables [B, table_stride] int64 block ids; seq_lens[B]: tokens in
 * each sequence counting the new one (its position is seq_lens[r] - 1, its K/V slot there).
 * logits: [B, vocab] fp32 (for bf16 models the bf16 LM head outputs, widened). op_seconds:
 * NULL, or OP_COUNT doubles to which each op's wall time is added. Returns 0; -1 for
 * arguments out of range; -2 out of memory (nothing written to logits; the KV cache may hold
 * this step's rows for some layers). */
int pdserve_decode_step(const pd_model *m, const int64_t *tokens, const int64_t *tables,
                        int64_t table_stride, const int64_t *seq_lens, int64_t B, void *logits,
                        int nthreads, double *op_seconds, int64_t first_layer,
                        int64_t end_layer, int head, void *x_state) {
    char *x = x_state;
    const int64_t H = m->hidden, NH = m->heads, KVH = m->kv_heads, D = m->head_dim;
    const int64_t Q = NH * D, KV = KVH * D, NQKV = Q + 2 * KV, I = m->inter, bs = m->block_size;
    const int bf16 = m->bf16;
    const int64_t elem = bf16 ? 2 : 4;
    if (B <= 0 || nthreads < 1 || KVH <= 0 || NH % KVH != 0 || NH > MAX_HEADS ||
        NH / KVH > MAX_GROUP || D % 8 != 0 || bs <= 0 || bs > MAX_BLOCK || x_state == NULL ||
        (m->kv_int8 && D > MAX_HEAD_DIM) ||
        first_layer < 0 || first_layer > end_layer || end_layer > m->num_layers ||
        (head && end_layer != m->num_layers))
        return -1;
    for (int64_t r = 0; r < B; r++)
        if (seq_lens[r] <= 0 || seq_lens[r] > m->max_position || tokens[r] < 0 ||
            tokens[r] >= m->vocab)
            return -1;
    const int64_t widest = (2 * I > H ? 2 * I : H) > Q ? (2 * I > H ? 2 * I : H) : Q;
    const int64_t kmax = (I > H ? I : H) > Q ? (I > H ? I : H) : Q;
    const int64_t attn_scratch = 2 * NH * D + NH * bs;
    /* h, qkv, attention out, wide (gate/up), act: weight dtype; then fp32 scratch */
    const int64_t nwt = B * (H + NQKV + Q + widest + I);
    const int64_t qscratch = (q_scratch_bytes(B, kmax) + 3) / 4;
    const int64_t nf32 = (B * kmax > qscratch ? B * kmax : qscratch) + attn_scratch * B;
    /* bf16 LM head outputs, in the call that runs the head */
    const int64_t nlogits = bf16 && head ? B * m->vocab : 0;
    char *arena = malloc((size_t)((nwt + nlogits) * elem + nf32 * 4 + 64));
    if (arena == NULL) return -2;
    char *h = arena, *qkv = h + B * H * elem, *att = qkv + B * NQKV * elem;
    char *wide = att + B * Q * elem, *act = wide + B * widest * elem;
    float *xf = (float *)(((uintptr_t)(act + (B * I + nlogits) * elem) + 63) & ~(uintptr_t)63);
    float *ascratch = xf + (B * kmax > qscratch ? B * kmax : qscratch);

    double t = op_seconds != NULL ? now_s() : 0.0;
    if (first_layer == 0) {
        if (m->embed_code != 0)
            q_rows(m->embed, (int)m->embed_code, m->vocab, H, tokens, B, x, bf16);
        else
            for (int64_t r = 0; r < B; r++)
                memcpy(x + r * H * elem, (const char *)m->embed + tokens[r] * H * elem, H * elem);
        lap(op_seconds, OP_EMBED, &t);
    }

    int rc = 0;
    for (int64_t l = first_layer; l < end_layer && rc == 0; l++) {
        const int64_t *lp = m->layers + l * L_FIELDS;
        char *kv = (char *)(uintptr_t)lp[L_KV];
        for (int64_t r = 0; r < B; r++)
            rmsnorm(x + r * H * elem, (const void *)(uintptr_t)lp[L_LN1], H, m->eps, bf16,
                    h + r * H * elem);
        lap(op_seconds, OP_NORM, &t);
        rc |= gemm(m, h, B, H, (const void *)(uintptr_t)lp[L_QKV], lp[L_QKV_CODE], NQKV,
                   (const void *)(uintptr_t)lp[L_QKV_BIAS], qkv, xf, nthreads);
        lap(op_seconds, OP_QKV, &t);
        for (int64_t r = 0; r < B; r++) {
            const int64_t pos = seq_lens[r] - 1;
            char *row = qkv + r * NQKV * elem;
            rope(row, NH + KVH, D, m->cos_table + pos * D, m->sin_table + pos * D, bf16);
            write_kv_row(m, kv, row, tables[r * table_stride + pos / bs], pos % bs);
        }
        lap(op_seconds, OP_ROPE_KV, &t);
        attn_args aa = {m, qkv, kv, tables, table_stride, seq_lens, att, ascratch, attn_scratch};
        pd_parallel_for(B, nthreads, attn_item, &aa);
        lap(op_seconds, OP_ATTENTION, &t);
        rc |= gemm(m, att, B, Q, (const void *)(uintptr_t)lp[L_O], lp[L_O_CODE], H, NULL, wide,
                   xf, nthreads);
        lap(op_seconds, OP_O, &t);
        for (int64_t i = 0; i < B * H; i++) st(x, i, ld(x, i, bf16) + ld(wide, i, bf16), bf16);
        lap(op_seconds, OP_RESIDUAL, &t);
        for (int64_t r = 0; r < B; r++)
            rmsnorm(x + r * H * elem, (const void *)(uintptr_t)lp[L_LN2], H, m->eps, bf16,
                    h + r * H * elem);
        lap(op_seconds, OP_NORM, &t);
        rc |= gemm(m, h, B, H, (const void *)(uintptr_t)lp[L_GATE_UP], lp[L_GATE_UP_CODE], 2 * I,
                   NULL, wide, xf, nthreads);
        lap(op_seconds, OP_GATE_UP, &t);
        act_args ac = {wide, act, I, bf16};
        pd_parallel_for(B, nthreads, act_item, &ac);
        lap(op_seconds, OP_ACT, &t);
        rc |= gemm(m, act, B, I, (const void *)(uintptr_t)lp[L_DOWN], lp[L_DOWN_CODE], H, NULL,
                   wide, xf, nthreads);
        lap(op_seconds, OP_DOWN, &t);
        for (int64_t i = 0; i < B * H; i++) st(x, i, ld(x, i, bf16) + ld(wide, i, bf16), bf16);
        lap(op_seconds, OP_RESIDUAL, &t);
    }
    if (rc == 0 && head) {
        for (int64_t r = 0; r < B; r++)
            rmsnorm(x + r * H * elem, m->final_norm, H, m->eps, bf16, h + r * H * elem);
        lap(op_seconds, OP_NORM, &t);
        /* bf16: the LM head's bf16 outputs (the torch model's rounding), widened into the
         * fp32 logits; fp32: written in place */
        void *lm_out = bf16 ? (void *)(arena + nwt * elem) : logits;
        rc = gemm(m, h, B, H, m->lm_head, m->lm_head_code, m->vocab, NULL, lm_out, xf, nthreads);
        if (bf16)
            for (int64_t i = 0; i < B * m->vocab; i++) ((float *)logits)[i] = ld(lm_out, i, 1);
        lap(op_seconds, OP_LM_HEAD, &t);
    }
    free(arena);
    return rc == 0 ? 0 : -1;
}
