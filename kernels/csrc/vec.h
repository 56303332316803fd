/* 16 floats as one vector, in GCC's generic vector extension: one zmm register on AVX-512, two ymm
 * or four xmm elsewhere, from the same source. With the helpers the kernels need and that gcc does
 * not vectorise by itself: a select, e^x, and bfloat16 <-> float32 for 16 values at once. */
#ifndef TESSERA_VEC_H
#define TESSERA_VEC_H
#include <stdint.h>
#include <string.h>

#define LANES 16

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t ivec __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef uint32_t uvec __attribute__((vector_size(LANES * sizeof(uint32_t))));
typedef uint16_t hvec __attribute__((vector_size(LANES * sizeof(uint16_t))));

static inline int min_int(int a, int b) { return a < b ? a : b; }

static inline __attribute__((always_inline)) vec splat(float x) { return (vec){0} + x; }

static inline __attribute__((always_inline)) vec pick(ivec mask, vec a, vec b) { /* mask lanes are all ones or zero */
    return (vec)(((ivec)a & mask) | ((ivec)b & ~mask));
}

/* e^x lane by lane, Cephes' single-precision polynomial (about 1 ulp); lanes below -87 give 0.
 * A loop of expf calls stayed scalar wherever gcc could not prove it vectorisable. */
static inline __attribute__((always_inline)) vec exp_vec(vec x) {
    const ivec underflow = x < splat(-87.0f);
    x = pick(underflow, splat(-87.0f), x);
    x = pick(x > splat(88.0f), splat(88.0f), x);
    const vec scaled = x * 1.44269504088896341f + 0.5f;
    vec n = __builtin_convertvector(__builtin_convertvector(scaled, ivec), vec);
    n = pick(n > scaled, n - 1.0f, n); /* truncation -> floor */
    const vec r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vec y = splat(1.9875691500e-4f);
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * r * r + r + 1.0f;
    const ivec two_n = (__builtin_convertvector(n, ivec) + 127) << 23;
    return pick(underflow, splat(0.f), y * (vec)two_n);
}

/* 16 values at base + i: float32, or bfloat16 widened (bf16 is the top half of a float). */
static inline __attribute__((always_inline)) vec load_vec(const void *base, int64_t i, const int is_bf16) {
    vec out;
    if (is_bf16) {
        hvec raw;
        memcpy(&raw, (const uint16_t *)base + i, sizeof raw);
        return (vec)(__builtin_convertvector(raw, uvec) << 16);
    }
    memcpy(&out, (const float *)base + i, sizeof out);
    return out;
}

/* bf16.h's float_to_bf16 on 16 lanes: round to nearest even, NaN kept quiet. */
static inline __attribute__((always_inline)) vec round_bf16_vec(vec x) {
    const uvec bits = (uvec)x;
    const uvec nearest_even = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
    const uvec quiet_nan = (bits | 0x400000u) & 0xffff0000u;
    const uvec is_nan = (uvec)((bits & 0x7fffffffu) > 0x7f800000u);
    return (vec)((quiet_nan & is_nan) | (nearest_even & ~is_nan));
}

static inline __attribute__((always_inline)) void store_vec(void *base, int64_t i, vec x, const int is_bf16) {
    if (is_bf16) {
        const hvec half = __builtin_convertvector((uvec)round_bf16_vec(x) >> 16, hvec);
        memcpy((uint16_t *)base + i, &half, sizeof half);
    } else {
        memcpy((float *)base + i, &x, sizeof x);
    }
}

/* RUN(is_bf16, head_dim) with both as constants for the common head sizes, so that every loop over
 * the head unrolls into registers (with a run-time size gcc spilled the accumulators to the
 * stack); other sizes run the same code with the size as a variable. */
#define DISPATCH_HEAD_SIZE(RUN, is_bf16, d) do {                                  \
        if (is_bf16) {                                                              \
            if ((d) == 64) RUN(1, 64); else if ((d) == 128) RUN(1, 128); else RUN(1, d); \
        } else {                                                                    \
            if ((d) == 64) RUN(0, 64); else if ((d) == 128) RUN(0, 128); else RUN(0, d); \
        }                                                                           \
    } while (0)

#endif
