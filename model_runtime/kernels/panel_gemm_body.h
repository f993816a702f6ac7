/* The body of panel_gemm.c, compiled once per weight dtype. Included by panel_gemm.c only, with
 * these defined: WT (weight and activation element type), FN(name) (the name with the dtype's
 * suffix), WEIGHT_IS_F32 (0 or 1), LOAD_PANEL(src, &cols0_7, &cols8_15) (one k step of a panel
 * as two fp32 vectors), TO_F32(v) / FROM_F32(f) (one element), STORE8(dst, v) (8 floats out). */

/* MR rows of packed x (xp[k][MR] fp32: the MR rows' k-th values side by side) times NP panels
 * starting at wp; fp32 results to tile[MR][GROUP] from column 0. MR and NP are compile-time
 * constants at every call site (always_inline), so the accumulators live in registers. */
static inline __attribute__((always_inline)) void FN(micro)(
    const int MR, const int NP, const float *xp, const WT *wp, int64_t K, float *tile) {
    __m256 acc[MR_MAX][8];
    for (int m = 0; m < MR; m++)
        for (int j = 0; j < 2 * NP; j++) acc[m][j] = _mm256_setzero_ps();
    const int64_t panel_stride = K * PANEL;
    for (int64_t k = 0; k < K; k++) {
        for (int p = 0; p < NP; p++) {
            const WT *w = wp + p * panel_stride + k * PANEL;
            _mm_prefetch((const char *)w + PREFETCH, _MM_HINT_T0);
            __m256 w0, w1;
            LOAD_PANEL(w, &w0, &w1);
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

#ifdef __AVX512F__
/* The AVX-512 micro-kernel (built where the CPU has AVX-512F/BW/VL/DQ, see build.py): MR rows
 * x all 4 panels of a group, one zmm of 16 columns per panel, MR * 4 <= 24 accumulators of
 * the 32 zmm registers. LOAD_PANEL512 gives one k step of a panel as 16 fp32 lanes in the
 * panel's stored column order; UNPERMUTE512 puts them back in column order at the end. */
static inline __attribute__((always_inline)) void FN(micro512)(
    const int MR, const float *xp, const WT *wp, int64_t K, float *tile) {
    __m512 acc[MR_MAX][4];
    for (int m = 0; m < MR; m++)
        for (int p = 0; p < 4; p++) acc[m][p] = _mm512_setzero_ps();
    const int64_t panel_stride = K * PANEL;
    for (int64_t k = 0; k < K; k++) {
        for (int p = 0; p < 4; p++) {
            const WT *w = wp + p * panel_stride + k * PANEL;
            _mm_prefetch((const char *)w + PREFETCH, _MM_HINT_T0);
            const __m512 wv = LOAD_PANEL512(w);
            for (int m = 0; m < MR; m++)
                acc[m][p] = _mm512_fmadd_ps(_mm512_set1_ps(xp[k * MR + m]), wv, acc[m][p]);
        }
    }
    for (int m = 0; m < MR; m++)
        for (int p = 0; p < 4; p++)
            _mm512_storeu_ps(tile + m * GROUP + PANEL * p, UNPERMUTE512(acc[m][p]));
}
#endif

/* rows x GROUP fp32 results in tile (row stride GROUP) + bias -> y[r * N + n0 + c] for the
 * columns below N (rounded to bf16 for bf16 outputs). */
static void FN(epilogue)(float *tile, int64_t rows, int64_t N, int64_t n0, const WT *bias,
                         WT *y) {
    const int64_t ncols = N - n0 < GROUP ? N - n0 : GROUP;
    for (int64_t r = 0; r < rows; r++) {
        float *t = tile + r * GROUP;
        if (bias != NULL)
            for (int64_t c = 0; c < ncols; c++) t[c] += TO_F32(bias[n0 + c]);
        WT *out = y + r * N + n0;
        int64_t c = 0;
        for (; c + 8 <= ncols; c += 8) STORE8(out + c, _mm256_loadu_ps(t + c));
        for (; c < ncols; c++) out[c] = FROM_F32(t[c]);
    }
}

static void FN(group_many_rows)(const float *xf, int64_t K, const WT *wp, int64_t N,
                                int64_t n0, const WT *bias, WT *y, int64_t m0, int64_t m1) {
    static __thread float acc[M_CHUNK * GROUP] __attribute__((aligned(32)));
    const WT *wg = wp + (n0 / PANEL) * K * PANEL;
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = K - k0 < KC ? K - k0 : KC;
#if WEIGHT_IS_F32
        const float *wf = wg + k0 * PANEL; /* the panels themselves */
        const int64_t ps = K * PANEL;
#else
        static __thread float wf[4 * KC * PANEL] __attribute__((aligned(32)));
        const int64_t ps = KC * PANEL;
        for (int p = 0; p < 4; p++)
            for (int64_t k = 0; k < kc; k++) {
                __m256 w0, w1;
                LOAD_PANEL(wg + p * K * PANEL + (k0 + k) * PANEL, &w0, &w1);
                _mm256_storeu_ps(wf + (p * KC + k) * PANEL, w0);
                _mm256_storeu_ps(wf + (p * KC + k) * PANEL + 8, w1);
            }
#endif
        for (int64_t m = m0; m < m1; m += MR_MAX) {
            const int mr = (int)(m1 - m < MR_MAX ? m1 - m : MR_MAX);
            const float *xm = xf + m * K + k0 * mr; /* row block, packed [k][mr] */
            float *t = acc + (m - m0) * GROUP;
            const int f = k0 == 0;
            switch (mr) { /* as in group_rows: NP panels per call, MR * 2 * NP <= 12 */
                case 1: micro_sliced(1, 4, xm, wf, ps, kc, t, f); break;
                case 2:
                    micro_sliced(2, 2, xm, wf, ps, kc, t, f);
                    micro_sliced(2, 2, xm, wf + 2 * ps, ps, kc, t + 32, f);
                    break;
                case 3:
                    micro_sliced(3, 2, xm, wf, ps, kc, t, f);
                    micro_sliced(3, 2, xm, wf + 2 * ps, ps, kc, t + 32, f);
                    break;
                case 4:
                    for (int p = 0; p < 4; p++)
                        micro_sliced(4, 1, xm, wf + p * ps, ps, kc, t + 16 * p, f);
                    break;
                case 5:
                    for (int p = 0; p < 4; p++)
                        micro_sliced(5, 1, xm, wf + p * ps, ps, kc, t + 16 * p, f);
                    break;
                default:
                    for (int p = 0; p < 4; p++)
                        micro_sliced(6, 1, xm, wf + p * ps, ps, kc, t + 16 * p, f);
                    break;
            }
        }
    }
    FN(epilogue)(acc, m1 - m0, N, n0, bias, y + m0 * N);
}

/* One GROUP of columns [n0, n0 + 64) for rows [m0, m1) (at most one row block: the weight
 * is widened in registers as it streams by), then the epilogue. */
static void FN(group_rows)(const float *xf, int64_t K, const WT *wp, int64_t N, int64_t n0,
                           const WT *bias, WT *y, int64_t m0, int64_t m1) {
    float tile[MR_MAX * GROUP] __attribute__((aligned(32)));
    const WT *wg = wp + (n0 / PANEL) * K * PANEL;
    for (int64_t m = m0; m < m1; m += MR_MAX) {
        int mr = (int)(m1 - m < MR_MAX ? m1 - m : MR_MAX);
        const float *xm = xf + m * K; /* row block m / MR_MAX, packed as [k][mr] */
#ifdef __AVX512F__
        switch (mr) {
            case 1: FN(micro512)(1, xm, wg, K, tile); break;
            case 2: FN(micro512)(2, xm, wg, K, tile); break;
            case 3: FN(micro512)(3, xm, wg, K, tile); break;
            case 4: FN(micro512)(4, xm, wg, K, tile); break;
            case 5: FN(micro512)(5, xm, wg, K, tile); break;
            default: FN(micro512)(6, xm, wg, K, tile); break;
        }
        FN(epilogue)(tile, mr, N, n0, bias, y + m * N);
        continue;
#endif
        const int64_t ps = K * PANEL;
        switch (mr) { /* NP panels per call so that MR * 2 * NP <= 12 accumulators */
            case 1: FN(micro)(1, 4, xm, wg, K, tile); break;
            case 2:
                FN(micro)(2, 2, xm, wg, K, tile);
                FN(micro)(2, 2, xm, wg + 2 * ps, K, tile + 32);
                break;
            case 3:
                FN(micro)(3, 2, xm, wg, K, tile);
                FN(micro)(3, 2, xm, wg + 2 * ps, K, tile + 32);
                break;
            case 4:
                for (int p = 0; p < 4; p++) FN(micro)(4, 1, xm, wg + p * ps, K, tile + 16 * p);
                break;
            case 5:
                for (int p = 0; p < 4; p++) FN(micro)(5, 1, xm, wg + p * ps, K, tile + 16 * p);
                break;
            default:
                for (int p = 0; p < 4; p++) FN(micro)(6, 1, xm, wg + p * ps, K, tile + 16 * p);
                break;
        }
        FN(epilogue)(tile, mr, N, n0, bias, y + m * N);
    }
}

static void FN(group)(const float *xf, int64_t K, const WT *wp, int64_t N, int64_t n0,
                      const WT *bias, WT *y, int64_t m0, int64_t m1) {
    if (m1 - m0 >= MANY_ROWS)
        FN(group_many_rows)(xf, K, wp, N, n0, bias, y, m0, m1);
    else
        FN(group_rows)(xf, K, wp, N, n0, bias, y, m0, m1);
}

/* Widen x [M, K] to fp32 and pack each block of MR_MAX rows as [k][mr] (mr = the block's rows),
 * so a micro-kernel's broadcasts read one contiguous stream. Block b starts at b*MR_MAX*K. */
static void FN(pack_x)(const WT *x, int64_t M, int64_t K, float *xf) {
    for (int64_t m0 = 0; m0 < M; m0 += MR_MAX) {
        int64_t mr = M - m0 < MR_MAX ? M - m0 : MR_MAX;
        float *dst = xf + m0 * K;
        for (int64_t r = 0; r < mr; r++)
            for (int64_t k = 0; k < K; k++) dst[k * mr + r] = TO_F32(x[(m0 + r) * K + k]);
    }
}

/* One GEMM call's work items: item i is row chunk i / groups, column group i % groups. */
typedef struct {
    const float *xf;
    int64_t M, K, N, groups;
    const WT *wp, *bias;
    WT *y;
} FN(gemm_args);

static int64_t FN(gemm_items)(const FN(gemm_args) *a) {
    return a->groups * ((a->M + M_CHUNK - 1) / M_CHUNK);
}

static void FN(gemm_item)(void *ctx, int64_t i) {
    const FN(gemm_args) *a = ctx;
    const int64_t c = i / a->groups, g = i % a->groups;
    const int64_t m1 = (c + 1) * M_CHUNK < a->M ? (c + 1) * M_CHUNK : a->M;
    FN(group)(a->xf, a->K, a->wp, a->N, g * GROUP, a->bias, a->y, c * M_CHUNK, m1);
}

/* y[M, N] = x[M, K] @ W^T + bias, all of the weight's dtype, row-major; W packed as above
 * with N_pad = ceil(N / 64) * 64 columns. xf is caller scratch for M * K floats. Returns 0,
 * or -1 if an argument is out of range (nothing written). */
int FN(pdserve_linear)(const WT *x, int64_t M, int64_t K, const WT *wp, int64_t N,
                       const WT *bias, WT *y, float *xf, int nthreads) {
    if (M < 0 || K <= 0 || N <= 0 || nthreads < 1) return -1;
    FN(pack_x)(x, M, K, xf);
    const FN(gemm_args) a = {xf, M, K, N, (N + GROUP - 1) / GROUP, wp, bias, y};
    const int64_t work = FN(gemm_items)(&a);
    if (nthreads == 1 || work == 1) {
        for (int64_t i = 0; i < work; i++) FN(gemm_item)((void *)&a, i);
        return 0;
    }
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t i = 0; i < work; i++) FN(gemm_item)((void *)&a, i);
    return 0;
}
