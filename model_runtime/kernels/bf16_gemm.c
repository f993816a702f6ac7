/* bf16-weight GEMM for AVX2/FMA CPUs: y = round_bf16(x @ W^T + bias), computed in fp32.
 *
 * Built and loaded by model_runtime/kernels/bf16_gemm.py (which states the contract and holds
 * the plain torch reference). Runs in the engine thread of a worker process; with nthreads > 1
 * it splits the columns over the OpenMP runtime torch itself uses (same libgomp.so.1 soname).
 *
 * Weight layout ("panels", made once at load by pack_weight):
 *
 *     W [N, K] bf16, N padded with zero rows to a multiple of GROUP = 64
 *     wp[p][k][2i] = W[16p + i][k], wp[p][k][2i + 1] = W[16p + 8 + i][k]    i < 8
 *
 * so one k step of a panel is 16 bf16 (32 bytes): the panel's 16 output columns, interleaved
 * for widen_panel, read as one contiguous stream per panel. A micro-kernel keeps MR rows x (16 * NP)
 * columns of fp32 accumulators in registers (MR * 2 * NP ymm, at most 12 of 16), widens each
 * bf16 weight vector to fp32 once per k (shift left by 16: bf16 is the top half of an fp32) and
 * FMAs it with MR broadcast activations. A group of 4 panels stays in L2 while every row block
 * passes over it, so each weight byte leaves memory once per call, at half the bytes of fp32,
 * and no fp32 copy of the whole weight is ever written. With MANY_ROWS rows or more (prefill,
 * large decode batches) the group is widened once per KC-deep slice into a small fp32 buffer
 * instead of once per row block (group_many_rows).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PANEL 16    /* output columns per panel */
#define GROUP 64    /* columns per unit of parallel work (4 panels) */
#define MR_MAX 6    /* rows per micro-kernel call */
#define M_CHUNK 96  /* rows per parallel chunk (x chunk of 96 x K fp32 stays in L2) */

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

/* MR rows of packed x (xp[k][MR] fp32: the MR rows' k-th values side by side) times NP panels
 * starting at wp; fp32 results to tile[MR][GROUP] from column 0. MR and NP are compile-time
 * constants at every call site (always_inline), so the accumulators live in registers. The
 * prefetch runs PREFETCH bytes ahead in each panel: the first row block of a group reads the
 * weight from memory at the pace of its FMAs, which the hardware prefetcher alone does not
 * keep ahead of (measured: a DRAM-resident weight ran ~30% slower than an L3-resident one). */
#define PREFETCH 1024
static inline __attribute__((always_inline)) void micro(
    const int MR, const int NP, const float *xp, const uint16_t *wp, int64_t K, float *tile) {
    __m256 acc[MR_MAX][8];
    for (int m = 0; m < MR; m++)
        for (int j = 0; j < 2 * NP; j++) acc[m][j] = _mm256_setzero_ps();
    const int64_t panel_stride = K * PANEL;
    for (int64_t k = 0; k < K; k++) {
        for (int p = 0; p < NP; p++) {
            const uint16_t *w = wp + p * panel_stride + k * PANEL;
            _mm_prefetch((const char *)w + PREFETCH, _MM_HINT_T0);
            __m256 w0, w1;
            widen_panel(w, &w0, &w1);
            for (int m = 0; m < MR; m++) {
                __m256 b = _mm256_broadcast_ss(xp + k * MR + m);
                acc[m][2 * p] = _mm256_fmadd_ps(b, w0, acc[m][2 * p]);
                acc[m][2 * p + 1] = _mm256_fmadd_ps(b, w1, acc[m][2 * p + 1]);
            }
        }
    }
    for (int m = 0; m < MR; m++)
        for (int j = 0; j < 2 * NP; j++) _mm256_storeu_ps(tile + m * GROUP + 8 * j, acc[m][j]);
}

/* rows x GROUP fp32 results in tile (row stride GROUP) + bias -> bf16 y[r * N + n0 + c] for the
 * columns below N. */
static void epilogue(float *tile, int64_t rows, int64_t N, int64_t n0, const uint16_t *bias,
                     uint16_t *y) {
    const int64_t ncols = N - n0 < GROUP ? N - n0 : GROUP;
    for (int64_t r = 0; r < rows; r++) {
        float *t = tile + r * GROUP;
        if (bias != NULL)
            for (int64_t c = 0; c < ncols; c++) {
                uint32_t u = (uint32_t)bias[n0 + c] << 16;
                float bf;
                memcpy(&bf, &u, sizeof bf);
                t[c] += bf;
            }
        uint16_t *out = y + r * N + n0;
        int64_t c = 0;
        for (; c + 8 <= ncols; c += 8) store_bf16x8(out + c, _mm256_loadu_ps(t + c));
        for (; c < ncols; c++) out[c] = bf16_scalar(t[c]);
    }
}

/* Many rows: the widening would be repeated for every row block, so each KC-deep slice of the
 * group's 4 panels is widened once into an fp32 copy (64 KB, stays in L2) and the row blocks run
 * an fp32 micro-kernel over it, accumulating across slices in acc[rows][GROUP]. Measured on the
 * Zen 1 host (one thread, `small` shapes): 0.83-0.89x the time of widening in registers at 32
 * and 128 rows, 1.0-1.2x at 8-16 rows, hence MANY_ROWS. */
#define KC 256
#define MANY_ROWS 24
static inline __attribute__((always_inline)) void micro_f32(const int MR, const int NP,
                                                            const float *xp, const float *wf,
                                                            int64_t kc, float *tile, int first) {
    __m256 acc[MR_MAX][8];
    for (int m = 0; m < MR; m++)
        for (int j = 0; j < 2 * NP; j++)
            acc[m][j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(tile + m * GROUP + 8 * j);
    for (int64_t k = 0; k < kc; k++)
        for (int p = 0; p < NP; p++) {
            const float *w = wf + p * KC * PANEL + k * PANEL;
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

static void group_many_rows(const float *xf, int64_t K, const uint16_t *wp, int64_t N,
                            int64_t n0, const uint16_t *bias, uint16_t *y, int64_t m0,
                            int64_t m1) {
    static __thread float wf[4 * KC * PANEL] __attribute__((aligned(32)));
    static __thread float acc[M_CHUNK * GROUP] __attribute__((aligned(32)));
    const uint16_t *wg = wp + (n0 / PANEL) * K * PANEL;
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = K - k0 < KC ? K - k0 : KC;
        for (int p = 0; p < 4; p++)
            for (int64_t k = 0; k < kc; k++) {
                __m256 w0, w1;
                widen_panel(wg + p * K * PANEL + (k0 + k) * PANEL, &w0, &w1);
                _mm256_storeu_ps(wf + (p * KC + k) * PANEL, w0);
                _mm256_storeu_ps(wf + (p * KC + k) * PANEL + 8, w1);
            }
        for (int64_t m = m0; m < m1; m += MR_MAX) {
            const int mr = (int)(m1 - m < MR_MAX ? m1 - m : MR_MAX);
            const float *xm = xf + m * K + k0 * mr; /* row block, packed [k][mr] */
            float *t = acc + (m - m0) * GROUP;
            const int f = k0 == 0;
            const int64_t ps = KC * PANEL;
            switch (mr) { /* as in group_rows: NP panels per call, MR * 2 * NP <= 12 */
                case 1: micro_f32(1, 4, xm, wf, kc, t, f); break;
                case 2:
                    micro_f32(2, 2, xm, wf, kc, t, f);
                    micro_f32(2, 2, xm, wf + 2 * ps, kc, t + 32, f);
                    break;
                case 3:
                    micro_f32(3, 2, xm, wf, kc, t, f);
                    micro_f32(3, 2, xm, wf + 2 * ps, kc, t + 32, f);
                    break;
                case 4:
                    for (int p = 0; p < 4; p++) micro_f32(4, 1, xm, wf + p * ps, kc, t + 16 * p, f);
                    break;
                case 5:
                    for (int p = 0; p < 4; p++) micro_f32(5, 1, xm, wf + p * ps, kc, t + 16 * p, f);
                    break;
                default:
                    for (int p = 0; p < 4; p++) micro_f32(6, 1, xm, wf + p * ps, kc, t + 16 * p, f);
                    break;
            }
        }
    }
    epilogue(acc, m1 - m0, N, n0, bias, y + m0 * N);
}

/* One GROUP of columns [n0, n0 + 64) for rows [m0, m1) (at most one row block: the weight
 * is widened in registers as it streams by), then the epilogue. */
static void group_rows(const float *xf, int64_t K, const uint16_t *wp, int64_t N, int64_t n0,
                       const uint16_t *bias, uint16_t *y, int64_t m0, int64_t m1) {
    float tile[MR_MAX * GROUP] __attribute__((aligned(32)));
    const uint16_t *wg = wp + (n0 / PANEL) * K * PANEL;
    for (int64_t m = m0; m < m1; m += MR_MAX) {
        int mr = (int)(m1 - m < MR_MAX ? m1 - m : MR_MAX);
        const float *xm = xf + m * K; /* row block m / MR_MAX, packed as [k][mr] */
        const int64_t ps = K * PANEL;
        switch (mr) { /* NP panels per call so that MR * 2 * NP <= 12 accumulators */
            case 1: micro(1, 4, xm, wg, K, tile); break;
            case 2:
                micro(2, 2, xm, wg, K, tile);
                micro(2, 2, xm, wg + 2 * ps, K, tile + 32);
                break;
            case 3:
                micro(3, 2, xm, wg, K, tile);
                micro(3, 2, xm, wg + 2 * ps, K, tile + 32);
                break;
            case 4:
                for (int p = 0; p < 4; p++) micro(4, 1, xm, wg + p * ps, K, tile + 16 * p);
                break;
            case 5:
                for (int p = 0; p < 4; p++) micro(5, 1, xm, wg + p * ps, K, tile + 16 * p);
                break;
            default:
                for (int p = 0; p < 4; p++) micro(6, 1, xm, wg + p * ps, K, tile + 16 * p);
                break;
        }
        epilogue(tile, mr, N, n0, bias, y + m * N);
    }
}

static void group(const float *xf, int64_t K, const uint16_t *wp, int64_t N, int64_t n0,
                  const uint16_t *bias, uint16_t *y, int64_t m0, int64_t m1) {
    if (m1 - m0 >= MANY_ROWS)
        group_many_rows(xf, K, wp, N, n0, bias, y, m0, m1);
    else
        group_rows(xf, K, wp, N, n0, bias, y, m0, m1);
}

/* y[M, N] (bf16, row-major) = x[M, K] (bf16, row-major) @ W^T + bias, W packed as above with
 * N_pad = ceil(N / 64) * 64 columns. xf is caller scratch for M * K floats. Returns 0, or -1
 * if an argument is out of range (nothing written). */
int pdserve_bf16_linear(const uint16_t *x, int64_t M, int64_t K, const uint16_t *wp, int64_t N,
                        const uint16_t *bias, uint16_t *y, float *xf, int nthreads) {
    if (M < 0 || K <= 0 || N <= 0 || nthreads < 1) return -1;
    /* Widen x to fp32 and pack each block of MR_MAX rows as [k][mr] (mr = the block's rows),
     * so a micro-kernel's broadcasts read one contiguous stream. Block b starts at b*MR_MAX*K. */
    for (int64_t m0 = 0; m0 < M; m0 += MR_MAX) {
        int64_t mr = M - m0 < MR_MAX ? M - m0 : MR_MAX;
        float *dst = xf + m0 * K;
        for (int64_t r = 0; r < mr; r++)
            for (int64_t k = 0; k < K; k++) {
                uint32_t u = (uint32_t)x[(m0 + r) * K + k] << 16;
                memcpy(dst + k * mr + r, &u, sizeof u);
            }
    }
    const int64_t groups = (N + GROUP - 1) / GROUP;
    const int64_t chunks = (M + M_CHUNK - 1) / M_CHUNK;
    const int64_t work = groups * chunks;
    if (nthreads == 1 || work == 1) {
        for (int64_t c = 0; c < chunks; c++) {
            int64_t m1 = (c + 1) * M_CHUNK < M ? (c + 1) * M_CHUNK : M;
            for (int64_t g = 0; g < groups; g++)
                group(xf, K, wp, N, g * GROUP, bias, y, c * M_CHUNK, m1);
        }
        return 0;
    }
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t i = 0; i < work; i++) {
        int64_t c = i / groups, g = i % groups;
        int64_t m1 = (c + 1) * M_CHUNK < M ? (c + 1) * M_CHUNK : M;
        group(xf, K, wp, N, g * GROUP, bias, y, c * M_CHUNK, m1);
    }
    return 0;
}
