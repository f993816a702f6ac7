/* GEMM over weights kept quantized in ggml's 32-value blocks (Q8_0, Q4_0, Q4_1), dequantized
 * in registers: y = x @ W^T (+ bias), x and y bf16 or fp32, sums in fp32. Also the two other
 * reads of such a weight: all of it dequantized (transposed, for prefill GEMMs) and single rows
 * dequantized (an embedding gather).
 *
 * Built and loaded by model_runtime/kernels/qgemm.py (which states the contract); the plain
 * reference is model_runtime/quant.py's torch dequantize-then-matmul. Included by
 * decode_step.c too, where the fused decode step runs its GEMMs over packed weights with these
 * kernels on pool.h's threads.
 *
 * Weight layout ("quant panels", made once at load by model_runtime/quant.py pack_blocks): W
 * [N, K], K a multiple of 32, N padded with zero blocks to a multiple of GROUP = 64 rows. Rows
 * go in panels of 16 and panels in groups of 4 (GROUP rows, one unit of parallel work); a
 * group is one stream of K / 32 blocks, and block b of a group holds, for k in [32b, 32b + 32),
 *
 *     qs of panel 0, 1, 2, 3, then d[4][16] fp16 (the rows' scales), then for Q4_1 m[4][16]
 *     fp16 (the rows' minimums), where one panel's qs are
 *     Q8_0: qs[8][16][4]  u8 = w + 128, qs[g][r][j] = row 16p + r, k = 32b + 4g + j
 *     Q4_0, Q4_1: qs[4][16][4]  byte = q(k = 32b + 8h + j) | q(k = 32b + 8h + 4 + j) << 4
 *                               (q the 4-bit code, 0..15)
 *
 * (a group's block is 2176, 1152 or 1280 bytes, a multiple of 64, so every code vector is
 * one aligned cache line),
 * so w = d * (q - z) with z = 128 (Q8_0), 8 (Q4_0); w = d * q + m (Q4_1): the same bytes per
 * block as the GGUF file (34, 18, 20 per row), read front to back by one stream per group (the
 * hardware prefetcher follows one sequential stream far better than four interleaved ones:
 * a batch-1 GEMV of Q4_1 read 1.3x faster so). A 64-byte vector of qs
 * holds 16 rows x 4 consecutive k of one row per 32-bit lane: the operand layout of
 * vpdpbusd, and for the float path 4 shifts give the 16 rows' values at one k.
 *
 * Two ways to multiply (per call, `int8`):
 *
 * - float (every build): each k's 16 weights become fp32 in registers and are multiplied with
 *   the fp32 activation; per block, acc += d * sum(q' x) (+ m * sum(x) for Q4_1), q' the signed
 *   code for Q8_0 / Q4_0. The same function as the reference up to fp32 summation order.
 * - int8 (the avx512 build, where the CPU has AVX-512 VNNI): each activation row is quantized
 *   per 32-value block to int8 with its own scale (dx = max|x| / 127, as ggml's Q8 blocks), and
 *   vpdpbusd multiplies 64 u8 weight codes by 64 int8 activations per instruction: per block,
 *   acc += d * dx * (sum(q xq) - z * sum(xq)) (+ m * sum(x) for Q4_1). As llama.cpp does;
 *   activations lose precision (~0.4 % of a block's largest value), so this path is judged by
 *   greedy agreement and perplexity, not by bits.
 */
#ifndef PDSERVE_QGEMM_C
#define PDSERVE_QGEMM_C

#include "panel_gemm.c"
#include "pool.h"

enum { QT_Q8_0 = 1, QT_Q4_0 = 2, QT_Q4_1 = 3 };
#define QB 32          /* values per quantization block */
#ifndef QPREFETCH
#define QPREFETCH 1024 /* bytes ahead in the stream (0: none, the hardware prefetcher alone) */
#endif
#define Q_CHUNK 32     /* activation rows per work item */

static inline int q_valid(int qt) { return qt == QT_Q8_0 || qt == QT_Q4_0 || qt == QT_Q4_1; }
static inline int64_t q_qs_bytes(int qt) { return qt == QT_Q8_0 ? 512 : 256; }
/* bytes of one panel's block: 16 rows' codes, scales and (Q4_1) minimums */
static inline int64_t q_block_bytes(int qt) {
    return q_qs_bytes(qt) + (qt == QT_Q4_1 ? 64 : 32);
}

/* bytes of one group's block (4 panels) */
static inline int64_t q_gblock_bytes(int qt) { return 4 * q_block_bytes(qt); }
/* In a group's block gb: panel p's codes, scales and (Q4_1) minimums. */
static inline const uint8_t *q_codes(const uint8_t *gb, int qt, int p) {
    return gb + p * q_qs_bytes(qt);
}
static inline const uint8_t *q_scales(const uint8_t *gb, int qt, int p) {
    return gb + 4 * q_qs_bytes(qt) + 32 * p;
}
static inline const uint8_t *q_mins(const uint8_t *gb, int qt, int p) {
    return gb + 4 * q_qs_bytes(qt) + 128 + 32 * p;
}
/* Block b of the group holding panel p, of the whole weight (K / 32 blocks a row). */
static inline const uint8_t *q_gblock(const uint8_t *w, int qt, int64_t K, int64_t p,
                                      int64_t b) {
    return w + ((p / 4) * (K / QB) + b) * q_gblock_bytes(qt);
}

static inline float half_to_f32(uint16_t h) { return _cvtsh_ss(h); }

/* Ask for the cache lines QPREFETCH bytes past a group's block of gbb bytes. */
static inline void q_prefetch(const uint8_t *gb, int64_t gbb) {
#if QPREFETCH > 0
    for (int64_t o = 0; o < gbb; o += 64) _mm_prefetch((const char *)gb + o + QPREFETCH, _MM_HINT_T0);
#else
    (void)gb;
    (void)gbb;
#endif
}

/* The activations of one call, prepared once (q_prepare) and shared by every column group. */
typedef struct {
    float *xf;     /* [M][K] fp32 */
    int8_t *xq;    /* [M][K] int8 codes (int8 path) */
    float *dx;     /* [M][nb] int8 scale per block */
    int32_t *isum; /* [M][nb] sum of a block's int8 codes */
    float *sumx;   /* [M][nb] sum of a block's fp32 values */
} q_acts;

/* Scratch bytes q_prepare needs for M rows of K. */
static int64_t q_scratch_bytes(int64_t M, int64_t K) {
    const int64_t nb = K / QB;
    return M * K * 4 + M * K + M * nb * 12 + 256;
}

/* Widen x to fp32, take each block's sum, and for the int8 path its scale and int8 codes
 * (round to nearest even of x / dx, as ggml's quantize_row_q8_0 rounds). */
static void q_prepare(const void *x, int bf16, int64_t M, int64_t K, int int8, char *scratch,
                      q_acts *a) {
    const int64_t nb = K / QB;
    uintptr_t p = ((uintptr_t)scratch + 63) & ~(uintptr_t)63;
    a->xf = (float *)p;
    a->dx = a->xf + M * K;
    a->sumx = a->dx + M * nb;
    a->isum = (int32_t *)(a->sumx + M * nb);
    a->xq = (int8_t *)(a->isum + M * nb);
    for (int64_t r = 0; r < M; r++) {
        float *xf = a->xf + r * K;
        if (bf16) {
            const uint16_t *src = (const uint16_t *)x + r * K;
            for (int64_t i = 0; i < K; i += 8) {
                __m128i raw = _mm_loadu_si128((const __m128i *)(src + i));
                _mm256_storeu_ps(xf + i,
                                 _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16)));
            }
        } else {
            memcpy(xf, (const float *)x + r * K, (size_t)K * 4);
        }
        for (int64_t b = 0; b < nb; b++) {
            const float *v = xf + b * QB;
            __m256 s = _mm256_setzero_ps(), mx = _mm256_setzero_ps();
            const __m256 sign = _mm256_set1_ps(-0.0f);
            __m256 v4[4];
            for (int i = 0; i < 4; i++) {
                v4[i] = _mm256_loadu_ps(v + 8 * i);
                s = _mm256_add_ps(s, v4[i]);
                mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v4[i]));
            }
            float ss[8], mm[8];
            _mm256_storeu_ps(ss, s);
            _mm256_storeu_ps(mm, mx);
            float sum = 0.0f, amax = 0.0f;
            for (int i = 0; i < 8; i++) {
                sum += ss[i];
                amax = mm[i] > amax ? mm[i] : amax;
            }
            a->sumx[r * nb + b] = sum;
            if (!int8) continue;
            const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            a->dx[r * nb + b] = d;
            const __m256 vid = _mm256_set1_ps(id);
            __m256i q[4];
            for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v4[i], vid));
            /* int32 x 32 -> int8 x 32 in order (packs work per 128-bit lane; the permute undoes
             * the lane interleave, as ggml's AVX2 quantize_row_q8_0) */
            __m256i q01 = _mm256_packs_epi32(q[0], q[1]), q23 = _mm256_packs_epi32(q[2], q[3]);
            __m256i q8 = _mm256_packs_epi16(q01, q23);
            q8 = _mm256_permutevar8x32_epi32(q8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)(a->xq + r * K + b * QB), q8);
            __m256i is = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            int32_t iv[8];
            _mm256_storeu_si256((__m256i *)iv, is);
            int32_t isum = 0;
            for (int i = 0; i < 8; i++) isum += iv[i];
            a->isum[r * nb + b] = isum;
        }
    }
}

/* ---- float path: each k's 16 weights widened to fp32 ------------------------------------- */

/* Byte j of each 32-bit lane of 8 rows as int32 (see q_byte512), and k-group g of rows
 * 8 * half .. 8 * half + 7 of one panel's block (see q_group512): the AVX2 forms, used by the
 * AVX2 GEMM and by the dequantization of every build. */
static inline __m256i q_byte256(__m256i w, const int j, const int is_signed) {
    if (is_signed) return _mm256_srai_epi32(_mm256_slli_epi32(w, 24 - 8 * j), 24);
    return _mm256_and_si256(_mm256_srli_epi32(w, 8 * j), _mm256_set1_epi32(0xff));
}

static inline __m256i q_group256(const uint8_t *qs, const int g, const int half, const int qt) {
    if (qt == QT_Q8_0)
        return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(qs + 64 * g + 32 * half)),
                                _mm256_set1_epi8((char)0x80));
    const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 64 * (g / 2) + 32 * half));
    const __m256i nib =
        _mm256_and_si256(g % 2 ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0f));
    return qt == QT_Q4_0 ? _mm256_sub_epi8(nib, _mm256_set1_epi8(8)) : nib;
}


#ifdef __AVX512F__
/* Byte j of each 32-bit lane as int32: signed (Q8_0 after the xor, Q4_0 after - 8) or not. */
static inline __m512i q_byte512(__m512i w, const int j, const int is_signed) {
    if (is_signed) return _mm512_srai_epi32(_mm512_slli_epi32(w, 24 - 8 * j), 24);
    return _mm512_and_si512(_mm512_srli_epi32(w, 8 * j), _mm512_set1_epi32(0xff));
}

/* The codes of k-group g (4 k) of one panel's block as 16 lanes x 4 bytes: Q8_0 made signed
 * (xor 0x80), Q4_0 made signed (- 8), Q4_1 left as 0..15. */
static inline __m512i q_group512(const uint8_t *qs, const int g, const int qt) {
    if (qt == QT_Q8_0)
        return _mm512_xor_si512(_mm512_loadu_si512(qs + 64 * g), _mm512_set1_epi8((char)0x80));
    const __m512i v = _mm512_loadu_si512(qs + 64 * (g / 2));
    const __m512i nib = _mm512_and_si512(g % 2 ? _mm512_srli_epi16(v, 4) : v, _mm512_set1_epi8(0x0f));
    return qt == QT_Q4_0 ? _mm512_sub_epi8(nib, _mm512_set1_epi8(8)) : nib;
}

/* MR activation rows (from row m0) x NP panels starting at wp (pstride bytes apart), over all
 * of K; fp32 results to tile[m][16p + r]. MR, NP and qt are constants at each call site. */
static inline __attribute__((always_inline)) void q_micro_f32(const int MR, const int NP,
                                                              const int qt, const q_acts *a,
                                                              int64_t m0, int64_t K,
                                                              const uint8_t *wg, int p0,
                                                              float *tile) {
    const int64_t nb = K / QB, gbb = q_gblock_bytes(qt);
    const int sgn = qt != QT_Q4_1;
    __m512 acc[6][4];
    for (int m = 0; m < MR; m++)
        for (int p = 0; p < NP; p++) acc[m][p] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512 bacc[6][4];
        for (int m = 0; m < MR; m++)
            for (int p = 0; p < NP; p++) bacc[m][p] = _mm512_setzero_ps();
        const uint8_t *gb = wg + b * gbb;
        q_prefetch(gb, gbb);
        for (int g = 0; g < 8; g++) {
            __m512i w[4];
            for (int p = 0; p < NP; p++) w[p] = q_group512(q_codes(gb, qt, p0 + p), g, qt);
            for (int j = 0; j < 4; j++) {
                __m512 wf[4];
                for (int p = 0; p < NP; p++) wf[p] = _mm512_cvtepi32_ps(q_byte512(w[p], j, sgn));
                for (int m = 0; m < MR; m++) {
                    const __m512 xb = _mm512_set1_ps(a->xf[(m0 + m) * K + b * QB + 4 * g + j]);
                    for (int p = 0; p < NP; p++) bacc[m][p] = _mm512_fmadd_ps(wf[p], xb, bacc[m][p]);
                }
            }
        }
        for (int p = 0; p < NP; p++) {
            const __m512 d =
                _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)q_scales(gb, qt, p0 + p)));
            for (int m = 0; m < MR; m++) acc[m][p] = _mm512_fmadd_ps(bacc[m][p], d, acc[m][p]);
            if (qt == QT_Q4_1) {
                const __m512 mn =
                    _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)q_mins(gb, qt, p0 + p)));
                for (int m = 0; m < MR; m++)
                    acc[m][p] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a->sumx[(m0 + m) * nb + b]),
                                                acc[m][p]);
            }
        }
    }
    for (int m = 0; m < MR; m++)
        for (int p = 0; p < NP; p++) _mm512_storeu_ps(tile + m * GROUP + 16 * p, acc[m][p]);
}

/* ---- int8 path: vpdpbusd on u8 weight codes x int8 activation codes ---------------------- */

#define Q_VNNI __attribute__((target("avx512vnni")))

static inline __attribute__((always_inline)) Q_VNNI void q_micro_vnni(
    const int MR, const int NP, const int qt, const q_acts *a, int64_t m0, int64_t K,
    const uint8_t *wg, int p0, float *tile) {
    const int64_t nb = K / QB, gbb = q_gblock_bytes(qt);
    const int32_t z = qt == QT_Q8_0 ? 128 : 8;
    const __m512i low4 = _mm512_set1_epi8(0x0f), high4 = _mm512_set1_epi8((char)0xf0);
    __m512 acc[4][4];
    for (int m = 0; m < MR; m++)
        for (int p = 0; p < NP; p++) acc[m][p] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        /* ia: the block's integer dots; for 4-bit codes ia sums the low nibbles and ih the
         * high nibbles left in place (16 x the code: an AND instead of a shift and an AND),
         * combined as 16 * ia + ih = 16 x the dot, the 16 undone in the scale */
        __m512i ia[4][4], ih[4][4];
        for (int m = 0; m < MR; m++)
            for (int p = 0; p < NP; p++) ia[m][p] = ih[m][p] = _mm512_setzero_si512();
        const uint8_t *gb = wg + b * gbb;
        q_prefetch(gb, gbb);
        if (MR == 1) {
            /* one row: its 8 broadcasts stay in registers and each panel's codes are read
             * front to back, so the block is read in address order (a read jumping between
             * the panels' codes streamed from memory at about half the speed) */
            const int8_t *xq = a->xq + m0 * K + b * QB;
            __m512i xb[8];
            for (int g = 0; g < 8; g++) {
                int32_t x4;
                memcpy(&x4, xq + 4 * g, 4);
                xb[g] = _mm512_set1_epi32(x4);
            }
            for (int p = 0; p < NP; p++) {
                const uint8_t *c = q_codes(gb, qt, p0 + p);
                if (qt == QT_Q8_0) { /* two chains (ia, ih), summed below */
                    for (int g = 0; g < 8; g += 2) {
                        ia[0][p] =
                            _mm512_dpbusd_epi32(ia[0][p], _mm512_load_si512(c + 64 * g), xb[g]);
                        ih[0][p] = _mm512_dpbusd_epi32(
                            ih[0][p], _mm512_load_si512(c + 64 * g + 64), xb[g + 1]);
                    }
                } else {
                    for (int h = 0; h < 4; h++) { /* xb[2h]: k-group 2h (low), 2h + 1 (high) */
                        const __m512i v = _mm512_load_si512(c + 64 * h);
                        const __m512i lo = _mm512_and_si512(v, low4);
                        const __m512i hi = _mm512_and_si512(v, high4);
                        ia[0][p] = _mm512_dpbusd_epi32(ia[0][p], lo, xb[2 * h]);
                        ih[0][p] = _mm512_dpbusd_epi32(ih[0][p], hi, xb[2 * h + 1]);
                    }
                }
            }
        } else if (qt == QT_Q8_0) {
            for (int g = 0; g < 8; g++) {
                __m512i w[4];
                for (int p = 0; p < NP; p++)
                    w[p] = _mm512_load_si512(q_codes(gb, qt, p0 + p) + 64 * g);
                for (int m = 0; m < MR; m++) {
                    int32_t x4;
                    memcpy(&x4, a->xq + (m0 + m) * K + b * QB + 4 * g, 4);
                    const __m512i xb = _mm512_set1_epi32(x4);
                    for (int p = 0; p < NP; p++) ia[m][p] = _mm512_dpbusd_epi32(ia[m][p], w[p], xb);
                }
            }
        } else {
            for (int h = 0; h < 4; h++) {
                __m512i lo[4], hi[4];
                for (int p = 0; p < NP; p++) {
                    const __m512i v = _mm512_load_si512(q_codes(gb, qt, p0 + p) + 64 * h);
                    lo[p] = _mm512_and_si512(v, low4);
                    hi[p] = _mm512_and_si512(v, high4);
                }
                for (int m = 0; m < MR; m++) {
                    int32_t x0, x1;
                    memcpy(&x0, a->xq + (m0 + m) * K + b * QB + 8 * h, 4);
                    memcpy(&x1, a->xq + (m0 + m) * K + b * QB + 8 * h + 4, 4);
                    const __m512i xb0 = _mm512_set1_epi32(x0), xb1 = _mm512_set1_epi32(x1);
                    for (int p = 0; p < NP; p++) {
                        ia[m][p] = _mm512_dpbusd_epi32(ia[m][p], lo[p], xb0);
                        ih[m][p] = _mm512_dpbusd_epi32(ih[m][p], hi[p], xb1);
                    }
                }
            }
        }
        for (int p = 0; p < NP; p++) {
            const __m512 d =
                _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)q_scales(gb, qt, p0 + p)));
            const __m512 mn =
                qt == QT_Q4_1
                    ? _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)q_mins(gb, qt, p0 + p)))
                    : _mm512_setzero_ps();
            for (int m = 0; m < MR; m++) {
                const int64_t ib = (m0 + m) * nb + b;
                const int32_t unit = qt == QT_Q8_0 ? 1 : 16; /* the dot's multiple (above) */
                __m512i dot = ia[m][p];
                if (qt != QT_Q8_0) dot = _mm512_add_epi32(_mm512_slli_epi32(dot, 4), ih[m][p]);
                else if (MR == 1) dot = _mm512_add_epi32(dot, ih[m][p]);
                if (qt != QT_Q4_1)
                    dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(unit * z * a->isum[ib]));
                const __m512 s = _mm512_mul_ps(d, _mm512_set1_ps(a->dx[ib] / (float)unit));
                acc[m][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc[m][p]);
                if (qt == QT_Q4_1)
                    acc[m][p] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a->sumx[ib]), acc[m][p]);
            }
        }
    }
    for (int m = 0; m < MR; m++)
        for (int p = 0; p < NP; p++) _mm512_storeu_ps(tile + m * GROUP + 16 * p, acc[m][p]);
}

/* One column group (4 panels) for rows [m0, m1) on the int8 path: MR x NP within registers. */
#define Q_VNNI_GROUP(QT, NAME)                                                                  \
    static Q_VNNI void NAME(const q_acts *a, int64_t K, const uint8_t *wg,                    \
                            int64_t m0, int64_t m1, float *tile) {                             \
        for (int64_t m = m0; m < m1;) {                                                        \
            const int64_t left = m1 - m;                                                       \
            float *t = tile + (m - m0) * GROUP;                                                \
            if (left == 1) {                                                                   \
                q_micro_vnni(1, 4, QT, a, m, K, wg, 0, t);                                    \
                m += 1;                                                                        \
            } else if (left <= 3) {                                                            \
                q_micro_vnni(2, 2, QT, a, m, K, wg, 0, t);                                    \
                q_micro_vnni(2, 2, QT, a, m, K, wg, 2, t + 32);                      \
                m += 2;                                                                        \
            } else {                                                                           \
                for (int p = 0; p < 4; p++) q_micro_vnni(4, 1, QT, a, m, K, wg, p, t + 16 * p); \
                m += 4;                                                                        \
            }                                                                                  \
        }                                                                                      \
    }
Q_VNNI_GROUP(QT_Q8_0, q_group_vnni_q8_0)
Q_VNNI_GROUP(QT_Q4_0, q_group_vnni_q4_0)
Q_VNNI_GROUP(QT_Q4_1, q_group_vnni_q4_1)

#define Q_F32_GROUP(QT, NAME)                                                                   \
    static void NAME(const q_acts *a, int64_t K, const uint8_t *wg, int64_t m0, int64_t m1,    \
                     float *tile) {                                                            \
        for (int64_t m = m0; m < m1;) {                                                        \
            const int64_t left = m1 - m;                                                       \
            float *t = tile + (m - m0) * GROUP;                                                \
            if (left == 1) {                                                                   \
                q_micro_f32(1, 4, QT, a, m, K, wg, 0, t);                                     \
                m += 1;                                                                        \
            } else if (left <= 3) {                                                            \
                q_micro_f32(2, 2, QT, a, m, K, wg, 0, t);                                     \
                q_micro_f32(2, 2, QT, a, m, K, wg, 2, t + 32);                       \
                m += 2;                                                                        \
            } else {                                                                           \
                for (int p = 0; p < 4; p++) q_micro_f32(4, 1, QT, a, m, K, wg, p, t + 16 * p); \
                m += 4;                                                                        \
            }                                                                                  \
        }                                                                                      \
    }

#else /* AVX2: the float path on 8-row halves of each panel */

/* MR rows x one panel (two 8-row halves); NP is 1 here (16 ymm registers). */
static inline __attribute__((always_inline)) void q_micro_f32(const int MR, const int NP,
                                                              const int qt, const q_acts *a,
                                                              int64_t m0, int64_t K,
                                                              const uint8_t *wg, int p0,
                                                              float *tile) {
    (void)NP;
    const int64_t nb = K / QB, gbb = q_gblock_bytes(qt);
    const int sgn = qt != QT_Q4_1;
    __m256 acc[2][2];
    for (int m = 0; m < MR; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *gb = wg + b * gbb, *blk = q_codes(gb, qt, p0);
        if (p0 == 0) q_prefetch(gb, gbb);
        __m256 bacc[2][2];
        for (int m = 0; m < MR; m++) bacc[m][0] = bacc[m][1] = _mm256_setzero_ps();
        for (int g = 0; g < 8; g++) {
            const __m256i w0 = q_group256(blk, g, 0, qt), w1 = q_group256(blk, g, 1, qt);
            for (int j = 0; j < 4; j++) {
                const __m256 f0 = _mm256_cvtepi32_ps(q_byte256(w0, j, sgn));
                const __m256 f1 = _mm256_cvtepi32_ps(q_byte256(w1, j, sgn));
                for (int m = 0; m < MR; m++) {
                    const __m256 xb = _mm256_set1_ps(a->xf[(m0 + m) * K + b * QB + 4 * g + j]);
                    bacc[m][0] = _mm256_fmadd_ps(f0, xb, bacc[m][0]);
                    bacc[m][1] = _mm256_fmadd_ps(f1, xb, bacc[m][1]);
                }
            }
        }
        for (int h = 0; h < 2; h++) {
            const __m256 d =
                _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(q_scales(gb, qt, p0) + 16 * h)));
            for (int m = 0; m < MR; m++) acc[m][h] = _mm256_fmadd_ps(bacc[m][h], d, acc[m][h]);
            if (qt == QT_Q4_1) {
                const __m256 mn =
                    _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(q_mins(gb, qt, p0) + 16 * h)));
                for (int m = 0; m < MR; m++)
                    acc[m][h] = _mm256_fmadd_ps(mn, _mm256_set1_ps(a->sumx[(m0 + m) * nb + b]),
                                                acc[m][h]);
            }
        }
    }
    for (int m = 0; m < MR; m++) {
        _mm256_storeu_ps(tile + m * GROUP, acc[m][0]);
        _mm256_storeu_ps(tile + m * GROUP + 8, acc[m][1]);
    }
}

#define Q_F32_GROUP(QT, NAME)                                                                   \
    static void NAME(const q_acts *a, int64_t K, const uint8_t *wg, int64_t m0, int64_t m1,    \
                     float *tile) {                                                            \
        for (int64_t m = m0; m < m1;) {                                                        \
            const int mr = m1 - m >= 2 ? 2 : 1;                                                \
            for (int p = 0; p < 4; p++) {                                                      \
                if (mr == 2)                                                                   \
                    q_micro_f32(2, 1, QT, a, m, K, wg, p, tile + (m - m0) * GROUP + 16 * p);   \
                else                                                                           \
                    q_micro_f32(1, 1, QT, a, m, K, wg, p, tile + (m - m0) * GROUP + 16 * p);   \
            }                                                                                  \
            m += mr;                                                                           \
        }                                                                                      \
    }
#endif

Q_F32_GROUP(QT_Q8_0, q_group_f32_q8_0)
Q_F32_GROUP(QT_Q4_0, q_group_f32_q4_0)
Q_F32_GROUP(QT_Q4_1, q_group_f32_q4_1)

typedef void (*q_group_fn)(const q_acts *, int64_t, const uint8_t *, int64_t, int64_t, float *);

/* Whether this build and CPU run the int8 path. */
static int q_has_vnni(void) {
#ifdef __AVX512F__
    return __builtin_cpu_supports("avx512vnni");
#else
    return 0;
#endif
}

static q_group_fn q_group_for(int qt, int int8) {
#ifdef __AVX512F__
    if (int8) return qt == QT_Q8_0 ? q_group_vnni_q8_0 : qt == QT_Q4_0 ? q_group_vnni_q4_0 : q_group_vnni_q4_1;
#else
    (void)int8;
#endif
    return qt == QT_Q8_0 ? q_group_f32_q8_0 : qt == QT_Q4_0 ? q_group_f32_q4_0 : q_group_f32_q4_1;
}

/* One call's work: item i = row chunk i / groups, column group i % groups. */
typedef struct {
    const q_acts *a;
    int64_t M, K, N, groups;
    const uint8_t *w;
    int qt, bf16;
    q_group_fn fn;
    const void *bias;
    void *y;
} q_gemm_args;

static void q_gemm_item(void *ctx, int64_t i) {
    const q_gemm_args *g = ctx;
    float tile[Q_CHUNK * GROUP] __attribute__((aligned(64)));
    const int64_t c = i / g->groups, grp = i % g->groups;
    const int64_t m0 = c * Q_CHUNK, m1 = m0 + Q_CHUNK < g->M ? m0 + Q_CHUNK : g->M;
    const int64_t gs = (g->K / QB) * q_gblock_bytes(g->qt); /* bytes per group */
    g->fn(g->a, g->K, g->w + grp * gs, m0, m1, tile);
    const int64_t n0 = grp * GROUP, ncols = g->N - n0 < GROUP ? g->N - n0 : GROUP;
    for (int64_t r = m0; r < m1; r++) {
        float *t = tile + (r - m0) * GROUP;
        if (g->bias != NULL)
            for (int64_t c2 = 0; c2 < ncols; c2++)
                t[c2] += g->bf16 ? bf16_to_f32(((const uint16_t *)g->bias)[n0 + c2])
                                 : ((const float *)g->bias)[n0 + c2];
        if (g->bf16) {
            uint16_t *out = (uint16_t *)g->y + r * g->N + n0;
            int64_t c2 = 0;
            for (; c2 + 8 <= ncols; c2 += 8) store_bf16x8(out + c2, _mm256_loadu_ps(t + c2));
            for (; c2 < ncols; c2++) out[c2] = bf16_scalar(t[c2]);
        } else {
            memcpy((float *)g->y + r * g->N + n0, t, (size_t)ncols * 4);
        }
    }
}

/* y[M, N] = x[M, K] @ W^T (+ bias), x / bias / y bf16 (bf16 = 1) or fp32, W quant panels of
 * type qt; scratch: q_scratch_bytes(M, K) bytes. int8: use the int8 path (needs
 * q_has_vnni(); otherwise the float path runs). Threads: pool.h's, nthreads of them. Returns
 * 0, or -1 for arguments out of range (nothing written). */
static int q_gemm(const void *x, int bf16, int64_t M, int64_t K, const uint8_t *w, int qt,
                  int64_t N, const void *bias, void *y, void *scratch, int nthreads, int int8) {
    if (M < 0 || K <= 0 || K % QB || N <= 0 || nthreads < 1 || !q_valid(qt)) return -1;
    if (M == 0) return 0;
    int8 = int8 && q_has_vnni();
    q_acts a;
    q_prepare(x, bf16, M, K, int8, scratch, &a);
    q_gemm_args g = {&a, M, K, N, (N + GROUP - 1) / GROUP, w, qt, bf16, q_group_for(qt, int8),
                     bias, y};
    pd_parallel_for(g.groups * ((M + Q_CHUNK - 1) / Q_CHUNK), nthreads, q_gemm_item, &g);
    return 0;
}

int pdserve_qlinear(const void *x, int bf16, int64_t M, int64_t K, const uint8_t *w, int qt,
                    int64_t N, const void *bias, void *y, void *scratch, int nthreads, int int8) {
    return q_gemm(x, bf16, M, K, w, qt, N, bias, y, scratch, nthreads, int8);
}

int64_t pdserve_qlinear_scratch_bytes(int64_t M, int64_t K) { return q_scratch_bytes(M, K); }

/* 1 where the int8 path runs here (this build and CPU), else 0. */
int pdserve_qlinear_has_int8(void) { return q_has_vnni(); }

/* ---- dequantization ---------------------------------------------------------------------- */

/* One value of the weight (row 16p + r), as ggml / gguf-py dequantize it: d * (q - z), or
 * d * q + m (Q4_1), rounded after each operation (no FMA: the gguf package's numpy). */
static __attribute__((optimize("fp-contract=off"))) float q_value(const uint8_t *w, int qt,
                                                                  int64_t K, int64_t p,
                                                                  int64_t r, int64_t k) {
    const uint8_t *gb = q_gblock(w, qt, K, p, k / QB), *blk = q_codes(gb, qt, (int)(p % 4));
    const int64_t kk = k % QB;
    const float d = half_to_f32(((const uint16_t *)q_scales(gb, qt, (int)(p % 4)))[r]);
    if (qt == QT_Q8_0) {
        const int q = blk[(kk / 4) * 64 + r * 4 + kk % 4];
        return d * (float)(q - 128);
    }
    const int h = (int)(kk / 8), hi = (int)(kk % 8) / 4, j = (int)(kk % 4);
    const int q = (blk[h * 64 + r * 4 + j] >> (4 * hi)) & 0x0f;
    if (qt == QT_Q4_0) return d * (float)(q - 8);
    return d * (float)q + half_to_f32(((const uint16_t *)q_mins(gb, qt, (int)(p % 4)))[r]);
}

/* out[i][k] = W[rows[i]][k] for i < n (rows ids < N), in bf16 or fp32: an embedding gather.
 * Returns 0, or -1 for an id out of range (rows before it are written). */
static int q_rows(const uint8_t *w, int qt, int64_t N, int64_t K, const int64_t *rows, int64_t n,
                  void *out, int bf16) {
    for (int64_t i = 0; i < n; i++) {
        if (rows[i] < 0 || rows[i] >= N) return -1;
        for (int64_t k = 0; k < K; k++) {
            const float v = q_value(w, qt, K, rows[i] / 16, rows[i] % 16, k);
            if (bf16)
                ((uint16_t *)out)[i * K + k] = bf16_scalar(v);
            else
                ((float *)out)[i * K + k] = v;
        }
    }
    return 0;
}

int pdserve_qrows(const uint8_t *w, int qt, int64_t N, int64_t K, const int64_t *rows, int64_t n,
                  void *out, int bf16) {
    if (!q_valid(qt) || K <= 0 || K % QB || N <= 0 || n < 0) return -1;
    return q_rows(w, qt, N, K, rows, n, out, bf16);
}

/* Dequantize every row into out = W^T, [K][ld] (ld >= N: out[k][n] = W[n][k], columns from N on
 * untouched), bf16 or fp32, one panel per pool item: prefill GEMMs multiply by it. */
typedef struct {
    const uint8_t *w;
    int qt, bf16;
    int64_t N, K, ld;
    void *out;
} q_dequant_args;

static __attribute__((optimize("fp-contract=off"))) void q_dequant_item(void *ctx, int64_t p) {
    const q_dequant_args *a = ctx;
    const int qt = a->qt, sgn = qt != QT_Q4_1;
    const int64_t nb = a->K / QB;
    const int64_t ncols = a->N - 16 * p < 16 ? a->N - 16 * p : 16;
    float vals[16] __attribute__((aligned(32)));
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *gb = q_gblock(a->w, qt, a->K, p, b), *blk = q_codes(gb, qt, (int)(p % 4));
        __m256 d[2], m[2];
        for (int h = 0; h < 2; h++) {
            d[h] = _mm256_cvtph_ps(
                _mm_loadu_si128((const __m128i *)(q_scales(gb, qt, (int)(p % 4)) + 16 * h)));
            m[h] = qt == QT_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128(
                                       (const __m128i *)(q_mins(gb, qt, (int)(p % 4)) + 16 * h)))
                                 : _mm256_setzero_ps();
        }
        for (int g = 0; g < 8; g++) {
            const __m256i w0 = q_group256(blk, g, 0, qt), w1 = q_group256(blk, g, 1, qt);
            for (int j = 0; j < 4; j++) {
                const int64_t k = b * QB + 4 * g + j;
                /* d * q, then + m for Q4_1: two roundings, as gguf-py's numpy computes them */
                __m256 v0 = _mm256_mul_ps(d[0], _mm256_cvtepi32_ps(q_byte256(w0, j, sgn)));
                __m256 v1 = _mm256_mul_ps(d[1], _mm256_cvtepi32_ps(q_byte256(w1, j, sgn)));
                if (qt == QT_Q4_1) {
                    v0 = _mm256_add_ps(v0, m[0]);
                    v1 = _mm256_add_ps(v1, m[1]);
                }
                if (a->bf16) {
                    uint16_t *o = (uint16_t *)a->out + k * a->ld + 16 * p;
                    if (ncols == 16) {
                        store_bf16x8(o, v0);
                        store_bf16x8(o + 8, v1);
                        continue;
                    }
                    _mm256_store_ps(vals, v0);
                    _mm256_store_ps(vals + 8, v1);
                    for (int64_t r = 0; r < ncols; r++) o[r] = bf16_scalar(vals[r]);
                } else {
                    float *o = (float *)a->out + k * a->ld + 16 * p;
                    if (ncols == 16) {
                        _mm256_storeu_ps(o, v0);
                        _mm256_storeu_ps(o + 8, v1);
                        continue;
                    }
                    _mm256_store_ps(vals, v0);
                    _mm256_store_ps(vals + 8, v1);
                    memcpy(o, vals, (size_t)ncols * 4);
                }
            }
        }
    }
}

int pdserve_qdequant_t(const uint8_t *w, int qt, int64_t N, int64_t K, void *out, int64_t ld,
                       int bf16, int nthreads) {
    if (!q_valid(qt) || K <= 0 || K % QB || N <= 0 || ld < N || nthreads < 1) return -1;
    q_dequant_args a = {w, qt, bf16, N, K, ld, out};
    pd_parallel_for((N + 15) / 16, nthreads, q_dequant_item, &a);
    return 0;
}

#endif
