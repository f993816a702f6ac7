/* Paged decode attention on CPU (one query token per sequence), float32 or bfloat16 cache.
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
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

/* s[h * bs + t] = q_h . k_t for the n tokens of one block (scale folded into q). With G (the
 * GQA group) a compile-time constant (always_inline + the dispatch below), the G running dot
 * products stay in registers and each K row is loaded once for the group. */
static inline __attribute__((always_inline)) void scores_g(
    const int64_t G, const float *qf, const void *kc, int64_t base, int64_t n, int64_t KVH,
    int64_t D, int64_t row, int64_t bs, int bf16, float *s) {
    for (int64_t t = 0; t < n; t++)
        for (int64_t kh = 0; kh < KVH; kh++) {
            const int64_t koff = base + t * row + kh * D;
            __m256 dot[MAX_GROUP];
            for (int64_t g = 0; g < G; g++) dot[g] = _mm256_setzero_ps();
            for (int64_t d = 0; d < D; d += 8) {
                __m256 kv = load8(kc, koff + d, bf16);
                for (int64_t g = 0; g < G; g++)
                    dot[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + (kh * G + g) * D + d), kv, dot[g]);
            }
            for (int64_t g = 0; g < G; g++) s[(kh * G + g) * bs + t] = hsum(dot[g]);
        }
}

/* acc_h += sum_t p_ht v_t for one block, a D-chunk at a time with the group's sums in
 * registers (each V row chunk loaded once for the group). */
static inline __attribute__((always_inline)) void values_g(
    const int64_t G, const float *p, const void *vc, int64_t base, int64_t n, int64_t KVH,
    int64_t D, int64_t row, int64_t bs, int bf16, float *acc) {
    for (int64_t kh = 0; kh < KVH; kh++)
        for (int64_t d = 0; d < D; d += 8) {
            __m256 a[MAX_GROUP];
            for (int64_t g = 0; g < G; g++) a[g] = _mm256_loadu_ps(acc + (kh * G + g) * D + d);
            for (int64_t t = 0; t < n; t++) {
                __m256 vv = load8(vc, base + t * row + kh * D + d, bf16);
                for (int64_t g = 0; g < G; g++)
                    a[g] = _mm256_fmadd_ps(_mm256_set1_ps(p[(kh * G + g) * bs + t]), vv, a[g]);
            }
            for (int64_t g = 0; g < G; g++) _mm256_storeu_ps(acc + (kh * G + g) * D + d, a[g]);
        }
}

#define DISPATCH_G(fn, G, ...)                          \
    switch (G) {                                        \
        case 1: fn(1, __VA_ARGS__); break;              \
        case 2: fn(2, __VA_ARGS__); break;              \
        case 3: fn(3, __VA_ARGS__); break;              \
        case 4: fn(4, __VA_ARGS__); break;              \
        case 8: fn(8, __VA_ARGS__); break;              \
        default: fn(G, __VA_ARGS__); break;             \
    }

static void block_scores(int64_t G, const float *qf, const void *kc, int64_t base, int64_t n,
                         int64_t KVH, int64_t D, int64_t row, int64_t bs, int bf16, float *s) {
    DISPATCH_G(scores_g, G, qf, kc, base, n, KVH, D, row, bs, bf16, s)
}

static void block_values(int64_t G, const float *p, const void *vc, int64_t base, int64_t n,
                         int64_t KVH, int64_t D, int64_t row, int64_t bs, int bf16, float *acc) {
    DISPATCH_G(values_g, G, p, vc, base, n, KVH, D, row, bs, bf16, acc)
}

/* One sequence, all heads. Scratch: qf[H*D], acc[H*D], s[H*bs]. */
static void one_sequence(const void *q, const void *kc, const void *vc, int64_t block_stride,
                         const int64_t *table, int64_t len, int64_t H, int64_t KVH, int64_t D,
                         int64_t bs, float scale, int bf16, void *out, float *qf, float *acc,
                         float *s) {
    const int64_t G = H / KVH, row = KVH * D, elem = bf16 ? 2 : 4;
    float m[MAX_HEADS], l[MAX_HEADS];
    for (int64_t i = 0; i < H * D; i++) qf[i] = to_f32(q, i, bf16) * scale;
    for (int64_t h = 0; h < H; h++) m[h] = -INFINITY, l[h] = 0.0f;
    memset(acc, 0, sizeof(float) * H * D);
    const int64_t nblocks = (len + bs - 1) / bs;
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t n = len - b * bs < bs ? len - b * bs : bs;
        const int64_t base = table[b] * block_stride;
        if (b + 1 < nblocks) {
            const int64_t next = table[b + 1] * block_stride * elem;
            prefetch_block((const char *)kc + next, bs * row * elem);
            prefetch_block((const char *)vc + next, bs * row * elem);
        }
        block_scores(G, qf, kc, base, n, KVH, D, row, bs, bf16, s);
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
            if (corr != 1.0f) {
                const __m256 c = _mm256_set1_ps(corr);
                for (int64_t d = 0; d < D; d += 8)
                    _mm256_storeu_ps(acc + h * D + d,
                                     _mm256_mul_ps(_mm256_loadu_ps(acc + h * D + d), c));
            }
        }
        block_values(G, s, vc, base, n, KVH, D, row, bs, bf16, acc);
    }
    for (int64_t h = 0; h < H; h++) {
        const float inv = 1.0f / l[h];
        for (int64_t d = 0; d < D; d++) store_out(out, h * D + d, acc[h * D + d] * inv, bf16);
    }
}

/* out[B, H, D] = attention of q[B, H, D] over each sequence's first seq_lens[b] cached tokens.
 * tables: [B, table_stride] int64 block ids. Element strides count cache elements. Returns 0,
 * -1 for shapes the kernel does not take, -2 if out of memory (nothing written either way:
 * use the reference). */
int pdserve_decode_attention(const void *q, const void *k_cache, const void *v_cache,
                             int64_t block_stride, const int64_t *tables, int64_t table_stride,
                             const int64_t *seq_lens, int64_t B, int64_t H, int64_t KVH,
                             int64_t D, int64_t bs, float scale, int bf16, void *out,
                             int nthreads) {
    if (B < 0 || KVH <= 0 || H % KVH != 0 || H > MAX_HEADS || H / KVH > MAX_GROUP || D % 8 != 0 ||
        D <= 0 || bs <= 0 || bs > MAX_BLOCK || nthreads < 1)
        return -1;
    for (int64_t b = 0; b < B; b++)
        if (seq_lens[b] <= 0) return -1;
    const int64_t elem = bf16 ? 2 : 4, scratch = 2 * H * D + H * bs;
    float *bufs = malloc(sizeof(float) * scratch * nthreads);
    if (bufs == NULL) return -2;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (nthreads > 1 && B > 1)
    for (int64_t b = 0; b < B; b++) {
        float *buf = bufs + scratch * omp_get_thread_num();
        one_sequence((const char *)q + b * H * D * elem, k_cache, v_cache, block_stride,
                     tables + b * table_stride, seq_lens[b], H, KVH, D, bs, scale, bf16,
                     (char *)out + b * H * D * elem, buf, buf + H * D, buf + 2 * H * D);
    }
    free(bufs);
    return 0;
}
