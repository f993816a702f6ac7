/* int8 KV cache rows: float16 scales and the quantization of one K or V head row, bit for bit
 * as model_runtime/kv_quant.py's `quantize` (the reference; its docstring states the rule):
 *
 *     scale = fp16(min(absmax(x) / 127, 65504));  q = clamp(rint(x / scale), -127, 127)
 *
 * every step IEEE float32 (a true division, rint in the default round-to-nearest-even mode),
 * so the fused decode step writes the bytes the torch path writes. Included by
 * decode_attention.c (scales are read there) and so by decode_step.c (rows are written there).
 */
#ifndef PDSERVE_KV_QUANT_H
#define PDSERVE_KV_QUANT_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#define KVQ_MAX 127.0f
#define KVQ_FP16_MAX 65504.0f

/* float16 bits -> float32 (exact; normal and subnormal, the only values a scale takes). The
 * magnitude's bits shifted into a float32's place are the value times 2^-112. */
static inline float kvq_f16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)(h & 0x7fffu) << 13;
    float f;
    memcpy(&f, &u, sizeof f);
    f *= 0x1p112f;
    return (h & 0x8000u) ? -f : f;
}

/* float32 -> float16 bits, round to nearest even, as torch's .to(float16) (F. Giesen's
 * float_to_half_fast3_rtne; +-inf and NaN for what overflows or is not a number). */
static inline uint16_t kvq_f32_to_f16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t sign = u & 0x80000000u;
    u ^= sign;
    uint16_t o;
    if (u >= 0x47800000u) { /* 65536 and up, inf, NaN */
        o = u > 0x7f800000u ? 0x7e00u : 0x7c00u;
    } else if (u < 0x38800000u) { /* a float16 subnormal or zero: let the FPU round */
        float g;
        memcpy(&g, &u, sizeof g);
        g += 0.5f;
        uint32_t v;
        memcpy(&v, &g, sizeof v);
        o = (uint16_t)(v - 0x3f000000u);
    } else {
        const uint32_t odd = (u >> 13) & 1u;
        u += 0xc8000fffu + odd; /* rebias the exponent (-112 << 23), round half to even */
        o = (uint16_t)(u >> 13);
    }
    return (uint16_t)(o | (sign >> 16));
}

/* q[D] and the float16 scale of one row x[D] (float32 values). */
static inline uint16_t kvq_quantize_row(const float *x, int64_t D, int8_t *q) {
    float amax = 0.0f;
    for (int64_t d = 0; d < D; d++) {
        const float a = fabsf(x[d]);
        amax = a > amax ? a : amax;
    }
    float scale = amax / KVQ_MAX;
    if (scale > KVQ_FP16_MAX) scale = KVQ_FP16_MAX;
    const uint16_t h = kvq_f32_to_f16(scale);
    const float s = kvq_f16_to_f32(h);
    for (int64_t d = 0; d < D; d++) {
        float r = s > 0.0f ? rintf(x[d] / s) : 0.0f;
        r = r > KVQ_MAX ? KVQ_MAX : (r < -KVQ_MAX ? -KVQ_MAX : r);
        q[d] = (int8_t)r;
    }
    return h;
}

#endif
