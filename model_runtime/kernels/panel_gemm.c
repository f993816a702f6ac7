/* Panel GEMM for AVX2/FMA CPUs, bf16 or fp32 weights: y = x @ W^T + bias, computed in fp32
 * (bf16: x and y in bf16, y rounded once). Two entry points, pdserve_linear_bf16 and
 * pdserve_linear_f32, compiled from panel_gemm_body.h with the dtype's loads and stores.
 *
 * Built and loaded by model_runtime/kernels/panel_gemm.py (which states the contract and holds
 * the plain torch reference). Runs in the engine thread of a worker process; with nthreads > 1
 * it splits the columns over the OpenMP runtime torch itself uses (same libgomp.so.1 soname).
 *
 * Weight layout ("panels", made once at load by pack_weight):
 *
 *     W [N, K], N padded with zero rows to a multiple of GROUP = 64
 *     fp32: wp[p][k][c] = W[16p + c][k]                                       c < 16
 *     bf16: wp[p][k][2i] = W[16p + i][k], wp[p][k][2i + 1] = W[16p + 8 + i][k]    i < 8
 *
 * so one k step of a panel is the panel's 16 output columns (bf16: interleaved for
 * widen_panel), read as one contiguous stream per panel. A micro-kernel keeps MR rows x (16 * NP)
 * columns of fp32 accumulators in registers (MR * 2 * NP ymm, at most 12 of 16), widens each
 * bf16 weight vector to fp32 once per k (shift left by 16: bf16 is the top half of an fp32) and
 * FMAs it with MR broadcast activations. A group of 4 panels stays in L2 while every row block
 * passes over it, so each weight byte leaves memory once per call (bf16: half the bytes of
 * fp32, and no fp32 copy of the whole weight is ever written). With MANY_ROWS rows or more
 * (prefill, large decode batches) the rows run over KC-deep slices of the group, which bf16
 * widens once into a small fp32 buffer instead of once per row block (group_many_rows).
 * A batch-1 step is a stream of GEMVs: the prefetch runs PREFETCH bytes ahead in each panel,
 * since the first row block of a group reads the weight from memory at the pace of its FMAs,
 * which the hardware prefetcher alone does not keep ahead of.
 */
#ifndef PDSERVE_PANEL_GEMM_C
#define PDSERVE_PANEL_GEMM_C

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PANEL 16    /* output columns per panel */
#define GROUP 64    /* columns per unit of parallel work (4 panels) */
#define MR_MAX 6    /* rows per micro-kernel call */
#define M_CHUNK 96  /* rows per parallel chunk (x chunk of 96 x K fp32 stays in L2) */
#define PREFETCH 1024
#define KC 256
#define MANY_ROWS 24

/* One k step of a panel: 16 bf16 stored interleaved (uint16 2i = column i, 2i + 1 = column
 * 8 + i, see pack_weight), so each 32-bit lane holds two columns' bf16 bits: shifting left by
 * 16 gives column i as fp32, masking the low half gives column 8 + i. One load, one shift and
 * one AND for 16 values: on Zen 1 a 256-bit vector shift runs on one pipe only, and widening
 * with a zero-extend plus a shift per 8 values made that pipe, not memory, the limit of a
 * batch-1 GEMV (~12 GB/s of bf16 against ~20 GB/s for a float32 stream). */
static inline void widen_panel(const uint16_t *src, __m256 *cols0_7, __m256 *cols8_15) {
    __m256i v = _mm256_loadu_si256((const __m256i *)src);
    *cols0_7 = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    *cols8_15 = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
}

/* fp32 -> bf16, round to nearest even (as torch's .to(torch.bfloat16)); NaN stays a quiet NaN. */
static inline void store_bf16x8(uint16_t *dst, __m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    r = _mm256_srli_epi32(r, 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    __m256i qnan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    r = _mm256_blendv_epi8(r, qnan, nan);
    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128((__m128i *)dst, packed);
}

static inline uint16_t bf16_scalar(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Many rows: for bf16 the widening would be repeated for every row block, so each KC-deep slice
 * of the group's 4 panels is widened once into an fp32 copy (64 KB, stays in L2) and the row
 * blocks run this micro-kernel over it (panel stride ps), accumulating across slices in
 * acc[rows][GROUP]; fp32 panels are used in place, sliced the same way. Measured on the Zen 1
 * host (one thread, `small` shapes, bf16): 0.83-0.89x the time of widening in registers at 32
 * and 128 rows, 1.0-1.2x at 8-16 rows, hence MANY_ROWS. */
static inline __attribute__((always_inline)) void micro_sliced(
    const int MR, const int NP, const float *xp, const float *wf, int64_t ps, int64_t kc,
    float *tile, int first) {
    __m256 acc[MR_MAX][8];
    for (int m = 0; m < MR; m++)
        for (int j = 0; j < 2 * NP; j++)
            acc[m][j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(tile + m * GROUP + 8 * j);
    for (int64_t k = 0; k < kc; k++)
        for (int p = 0; p < NP; p++) {
            const float *w = wf + p * ps + k * PANEL;
            __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
            for (int m = 0; m < MR; m++) {
                __m256 b = _mm256_broadcast_ss(xp + k * MR + m);
                acc[m][2 * p] = _mm256_fmadd_ps(b, w0, acc[m][2 * p]);
                acc[m][2 * p + 1] = _mm256_fmadd_ps(b, w1, acc[m][2 * p + 1]);
            }
        }
    for (int m = 0; m < MR; m++)
        for (int j = 0; j < 2 * NP; j++) _mm256_storeu_ps(tile + m * GROUP + 8 * j, acc[m][j]);
}

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline void load_f32_panel(const float *src, __m256 *cols0_7, __m256 *cols8_15) {
    *cols0_7 = _mm256_loadu_ps(src);
    *cols8_15 = _mm256_loadu_ps(src + 8);
}

static inline float same_f32(float f) { return f; }

#ifdef __AVX512F__
/* One k step of a bf16 panel as 16 fp32 lanes in stored order (lane 2i = column i, lane
 * 2i + 1 = column 8 + i); unpermute_bf16 puts lanes back in column order. */
static inline __m512 widen_panel512(const uint16_t *src) {
    __m256i v = _mm256_loadu_si256((const __m256i *)src);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

static inline __m512 unpermute_bf16(__m512 v) {
    const __m512i idx = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    return _mm512_permutexvar_ps(idx, v);
}

static inline __m512 same_order(__m512 v) { return v; }
#endif

/* bf16 weights, activations and outputs */
#define WT uint16_t
#define FN(name) name##_bf16
#define WEIGHT_IS_F32 0
#define LOAD_PANEL widen_panel
#define TO_F32 bf16_to_f32
#define FROM_F32 bf16_scalar
#define STORE8 store_bf16x8
#define LOAD_PANEL512 widen_panel512
#define UNPERMUTE512 unpermute_bf16
#include "panel_gemm_body.h"
#undef WT
#undef FN
#undef WEIGHT_IS_F32
#undef LOAD_PANEL
#undef TO_F32
#undef FROM_F32
#undef STORE8
#undef LOAD_PANEL512
#undef UNPERMUTE512

/* fp32 weights, activations and outputs */
#define WT float
#define FN(name) name##_f32
#define WEIGHT_IS_F32 1
#define LOAD_PANEL load_f32_panel
#define TO_F32 same_f32
#define FROM_F32 same_f32
#define STORE8 _mm256_storeu_ps
#define LOAD_PANEL512 _mm512_loadu_ps
#define UNPERMUTE512 same_order
#include "panel_gemm_body.h"

#endif
