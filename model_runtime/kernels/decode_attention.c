/* Paged decode attention on CPU (one query token per sequence), over a float32, bfloat16 or
 * int8 cache.
 *
 * Built and loaded by model_runtime/kernels/decode_attention.py, which states the contract;
 * the plain torch reference is model_runtime/attention/torch_ref.paged_decode_attention.
 * Runs in the engine thread of a worker process (OpenMP threads when nthreads > 1).
 *
 * Cache layout (one layer, KVCache.layer): K and V views share one tensor,
 *
 *     k[block * block_stride + (t * KVH + h) * D + d]      t < bs (token in block), h < KVH
 *     v = the same offsets from v_base
 *
 * so one block of one of K/V is bs * KVH * D contiguous elements. For each sequence the kernel
 * walks its blocks in order, reads each K and V block once, contiguously, in place (no gather
 * copy, no padding, no mask), and keeps an online softmax per query head in fp32:
 *
 *     s = q . k * scale;  m' = max(m, s);  l = l * e^(m - m') + sum e^(s - m');
 *     acc = acc * e^(m - m') + sum e^(s - m') v;            out = acc / l
 *
 * The next block's first lines are prefetched while the current one is used: block ids come
 * from a table, so the hardware prefetcher cannot see where the next block starts.
 *
 * An int8 cache (model_runtime/kv_cache.py draws the block) keeps the same value offsets in
 * bytes, and one float16 scale per token per KV head at ks / vs [block * scale_stride + t * KVH
 * + h]. Values are widened to fp32 in registers; a score is (q . k_int8) * k_scale, a V row's
 * weight p * v_scale, so each scale is applied once per token and head, never per element.
 * q and out are then in the model's dtype (io_bf16), not the cache's.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_quant.h"
#include "vec_exp.h"

#define MAX_HEADS 256
#define MAX_GROUP 16
#define MAX_BLOCK 256

static inline __m256 load8(const void *base, int64_t off, int bf16) {
    if (bf16) {
        __m128i raw = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + off));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
    }
    return _mm256_loadu_ps((const float *)base + off);
}

enum { KV_F32 = 0, KV_BF16 = 1, KV_I8 = 2 };

/* One layer of the cache as the kernel reads it. */
typedef struct {
    const void *k, *v;         /* values, block_stride elements (bytes for int8) per block */
    const uint16_t *ks, *vs;   /* KV_I8: float16 scales, scale_stride per block; else NULL */
    int64_t block_stride, scale_stride;
    int kind;                  /* KV_F32, KV_BF16, KV_I8 */
} kv_src;

/* 8 cache values as fp32: kind is a compile-time constant where this is inlined. */
static inline __m256 load8_kv(const void *base, int64_t off, int kind) {
    if (kind == KV_I8) {
        const __m128i raw = _mm_loadl_epi64((const __m128i *)((const int8_t *)base + off));
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
    }
    return load8(base, off, kind == KV_BF16);
}

static inline float to_f32(const void *base, int64_t off, int bf16) {
    if (!bf16) return ((const float *)base)[off];
    uint32_t u = (uint32_t)((const uint16_t *)base)[off] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline void store_out(void *base, int64_t off, float f, int bf16) {
    if (!bf16) {
        ((float *)base)[off] = f;
        return;
    }
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        ((uint16_t *)base)[off] = (uint16_t)((u >> 16) | 0x40u);
        return;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    ((uint16_t *)base)[off] = (uint16_t)(u >> 16);
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static void prefetch_block(const char *p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
}

/* s[h * bs + t] = q_h . k_t for the n tokens of one block (scale folded into q; an int8
 * cache's K scale applied to each finished dot product). With G (the GQA group) and the cache
 * kind compile-time constants (always_inline + the dispatch below), the G running dot
 * products stay in registers and each K row is loaded once for the group. */
static inline __attribute__((always_inline)) void scores_g(
    const int64_t G, const int kind, const float *qf, const kv_src *c, int64_t blk, int64_t n,
    int64_t KVH, int64_t D, int64_t bs, float *s) {
    /* locals, not c->: stores into s could alias *c, and would force a reload per store */
    const void *kc = c->k;
    const uint16_t *ks = kind == KV_I8 ? c->ks + blk * c->scale_stride : NULL;
    const int64_t row = KVH * D, base = blk * c->block_stride;
    for (int64_t t = 0; t < n; t++)
        for (int64_t kh = 0; kh < KVH; kh++) {
            const int64_t koff = base + t * row + kh * D;
            __m256 dot[MAX_GROUP];
            for (int64_t g = 0; g < G; g++) dot[g] = _mm256_setzero_ps();
            for (int64_t d = 0; d < D; d += 8) {
                __m256 kv = load8_kv(kc, koff + d, kind);
                for (int64_t g = 0; g < G; g++)
                    dot[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + (kh * G + g) * D + d), kv, dot[g]);
            }
            if (kind == KV_I8) {
                const float kscale = kvq_f16_to_f32(ks[t * KVH + kh]);
                for (int64_t g = 0; g < G; g++) s[(kh * G + g) * bs + t] = hsum(dot[g]) * kscale;
            } else {
                for (int64_t g = 0; g < G; g++) s[(kh * G + g) * bs + t] = hsum(dot[g]);
            }
        }
}

/* acc_h += sum_t p_ht v_t for one block, a D-chunk at a time with the group's sums in
 * registers (each V row chunk loaded once for the group); on an int8 cache the caller has
 * multiplied p_ht by the token's V scale. */
static inline __attribute__((always_inline)) void values_g(
    const int64_t G, const int kind, const float *p, const kv_src *c, int64_t blk, int64_t n,
    int64_t KVH, int64_t D, int64_t bs, float *acc) {
    const void *vc = c->v; /* a local: stores into acc could alias *c */
    const int64_t row = KVH * D, base = blk * c->block_stride;
    for (int64_t kh = 0; kh < KVH; kh++)
        for (int64_t d = 0; d < D; d += 8) {
            __m256 a[MAX_GROUP];
            for (int64_t g = 0; g < G; g++) a[g] = _mm256_loadu_ps(acc + (kh * G + g) * D + d);
            for (int64_t t = 0; t < n; t++) {
                __m256 vv = load8_kv(vc, base + t * row + kh * D + d, kind);
                for (int64_t g = 0; g < G; g++)
                    a[g] = _mm256_fmadd_ps(_mm256_set1_ps(p[(kh * G + g) * bs + t]), vv, a[g]);
            }
            for (int64_t g = 0; g < G; g++) _mm256_storeu_ps(acc + (kh * G + g) * D + d, a[g]);
        }
}

#define DISPATCH_G(fn, G, K, ...)                       \
    switch (G) {                                        \
        case 1: fn(1, K, __VA_ARGS__); break;           \
        case 2: fn(2, K, __VA_ARGS__); break;           \
        case 3: fn(3, K, __VA_ARGS__); break;           \
        case 4: fn(4, K, __VA_ARGS__); break;           \
        case 8: fn(8, K, __VA_ARGS__); break;           \
        default: fn(G, K, __VA_ARGS__); break;          \
    }

#define DISPATCH_KIND(fn, G, kind, ...)                                  \
    switch (kind) {                                                      \
        case KV_F32: DISPATCH_G(fn, G, KV_F32, __VA_ARGS__) break;       \
        case KV_BF16: DISPATCH_G(fn, G, KV_BF16, __VA_ARGS__) break;     \
        default: DISPATCH_G(fn, G, KV_I8, __VA_ARGS__) break;            \
    }

static void block_scores(int64_t G, const float *qf, const kv_src *c, int64_t blk, int64_t n,
                         int64_t KVH, int64_t D, int64_t bs, float *s) {
    DISPATCH_KIND(scores_g, G, c->kind, qf, c, blk, n, KVH, D, bs, s)
}

static void block_values(int64_t G, const float *p, const kv_src *c, int64_t blk, int64_t n,
                         int64_t KVH, int64_t D, int64_t bs, float *acc) {
    DISPATCH_KIND(values_g, G, c->kind, p, c, blk, n, KVH, D, bs, acc)
}

/* One sequence, all heads; q and out in bfloat16 (io_bf16) or float32. Scratch: qf[H*D],
 * acc[H*D], s[H*bs]. */
static void one_sequence(const void *q, const kv_src *c, const int64_t *table, int64_t len,
                         int64_t H, int64_t KVH, int64_t D, int64_t bs, float scale, int io_bf16,
                         void *out, float *qf, float *acc, float *s) {
    const int64_t G = H / KVH, row = KVH * D;
    const int64_t elem = c->kind == KV_F32 ? 4 : c->kind == KV_BF16 ? 2 : 1;
    float m[MAX_HEADS], l[MAX_HEADS];
    for (int64_t i = 0; i < H * D; i++) qf[i] = to_f32(q, i, io_bf16) * scale;
    for (int64_t h = 0; h < H; h++) m[h] = -INFINITY, l[h] = 0.0f;
    memset(acc, 0, sizeof(float) * H * D);
    const int64_t nblocks = (len + bs - 1) / bs;
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t n = len - b * bs < bs ? len - b * bs : bs;
        if (b + 1 < nblocks) {
            const int64_t next = table[b + 1] * c->block_stride * elem;
            prefetch_block((const char *)c->k + next, bs * row * elem);
            prefetch_block((const char *)c->v + next, bs * row * elem);
            if (c->kind == KV_I8) {
                const int64_t nexts = table[b + 1] * c->scale_stride;
                prefetch_block((const char *)(c->ks + nexts), bs * KVH * 2);
                prefetch_block((const char *)(c->vs + nexts), bs * KVH * 2);
            }
        }
        block_scores(G, qf, c, table[b], n, KVH, D, bs, s);
        /* online softmax: rescale the running sums, turn scores into weights */
        for (int64_t h = 0; h < H; h++) {
            float *sh = s + h * bs;
            float mx = m[h];
            for (int64_t t = 0; t < n; t++) mx = sh[t] > mx ? sh[t] : mx;
            const float corr = expf(m[h] - mx);
            /* e^(s - mx), 8 scores at a time (exp8: within 1.2e-7 of expf); the tail of a
             * partial block is padded with scores that give 0 */
            const __m256 mxv = _mm256_set1_ps(mx);
            __m256 sumv = _mm256_setzero_ps();
            int64_t t = 0;
            for (; t + 8 <= n; t += 8) {
                const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sh + t), mxv));
                _mm256_storeu_ps(sh + t, e);
                sumv = _mm256_add_ps(sumv, e);
            }
            if (t < n) {
                float tail[8];
                for (int64_t j = 0; j < 8; j++) tail[j] = t + j < n ? sh[t + j] - mx : -100.0f;
                const __m256 e = exp8(_mm256_loadu_ps(tail));
                _mm256_storeu_ps(tail, e);
                for (int64_t j = 0; t + j < n; j++) sh[t + j] = tail[j];
                sumv = _mm256_add_ps(sumv, e);
            }
            const float sum = hsum(sumv);
            l[h] = l[h] * corr + sum;
            m[h] = mx;
            if (c->kind == KV_I8) { /* the weights of V rows carry their scales (not l) */
                const uint16_t *vs = c->vs + table[b] * c->scale_stride + h / G;
                for (int64_t tt = 0; tt < n; tt++) sh[tt] *= kvq_f16_to_f32(vs[tt * KVH]);
            }
            if (corr != 1.0f) {
                const __m256 c = _mm256_set1_ps(corr);
                for (int64_t d = 0; d < D; d += 8)
                    _mm256_storeu_ps(acc + h * D + d,
                                     _mm256_mul_ps(_mm256_loadu_ps(acc + h * D + d), c));
            }
        }
        block_values(G, s, c, table[b], n, KVH, D, bs, acc);
    }
    for (int64_t h = 0; h < H; h++) {
        const float inv = 1.0f / l[h];
        for (int64_t d = 0; d < D; d++) store_out(out, h * D + d, acc[h * D + d] * inv, io_bf16);
    }
}

/* out[B, H, D] = attention of q[B, H, D] over each sequence's first seq_lens[b] cached tokens.
 * tables: [B, table_stride] int64 block ids. kv_kind: KV_F32, KV_BF16 or KV_I8 (then k_scales
 * and v_scales are the float16 scale views, scale_stride apart per block; else NULL).
 * block_stride counts cache elements (bytes for int8). q and out: bfloat16 if io_bf16, else
 * float32. Returns 0, -1 for shapes the kernel does not take, -2 if out of memory (nothing
 * written either way: use the reference). */
int pdserve_decode_attention(const void *q, const void *k_cache, const void *v_cache,
                             const void *k_scales, const void *v_scales, int64_t block_stride,
                             int64_t scale_stride, const int64_t *tables, int64_t table_stride,
                             const int64_t *seq_lens, int64_t B, int64_t H, int64_t KVH,
                             int64_t D, int64_t bs, float scale, int io_bf16, int kv_kind,
                             void *out, int nthreads) {
    if (B < 0 || KVH <= 0 || H % KVH != 0 || H > MAX_HEADS || H / KVH > MAX_GROUP || D % 8 != 0 ||
        D <= 0 || bs <= 0 || bs > MAX_BLOCK || nthreads < 1 || kv_kind < KV_F32 ||
        kv_kind > KV_I8 || (kv_kind == KV_I8 && (k_scales == NULL || v_scales == NULL)))
        return -1;
    for (int64_t b = 0; b < B; b++)
        if (seq_lens[b] <= 0) return -1;
    const kv_src c = {k_cache, v_cache, k_scales, v_scales, block_stride, scale_stride, kv_kind};
    const int64_t elem = io_bf16 ? 2 : 4, scratch = 2 * H * D + H * bs;
    float *bufs = malloc(sizeof(float) * scratch * nthreads);
    if (bufs == NULL) return -2;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (nthreads > 1 && B > 1)
    for (int64_t b = 0; b < B; b++) {
        float *buf = bufs + scratch * omp_get_thread_num();
        one_sequence((const char *)q + b * H * D * elem, &c, tables + b * table_stride,
                     seq_lens[b], H, KVH, D, bs, scale, io_bf16, (char *)out + b * H * D * elem,
                     buf, buf + H * D, buf + 2 * H * D);
    }
    free(bufs);
    return 0;
}

/* q[rows, D] int8 and scales[rows] float16 bits of x[rows, D] float32, as kv_quant.quantize
 * (the decode step's K/V write uses the same row function; exported for its tests). */
void pdserve_kv_quantize(const float *x, int64_t rows, int64_t D, int8_t *q, uint16_t *scales) {
    for (int64_t r = 0; r < rows; r++) scales[r] = kvq_quantize_row(x + r * D, D, q + r * D);
}
