/* 16 floats as one vector, in GCC's generic vector extension: one zmm register on AVX-512, two ymm
 * or four xmm elsewhere, from the same source. With the helpers the kernels need and that gcc does
 * not vectorise by itself: a select, e^x, and bfloat16 <-> float32 for 16 values at once. */
#ifndef TESSERA_VEC_H
#define TESSERA_VEC_H
#include <stdint.h>
#include <string.h>

#define LANES 16

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t ivec __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef uint32_t uvec __attribute__((vector_size(LANES * sizeof(uint32_t))));
typedef uint16_t hvec __attribute__((vector_size(LANES * sizeof(uint16_t))));

static inline int min_int(int a, int b) { return a < b ? a : b; }

static inline __attribute__((always_inline)) vec splat(float x) { return (vec){0} + x; }

static inline __attribute__((always_inline)) vec pick(ivec mask, vec a, vec b) { /* mask lanes are all ones or zero */
    return (vec)(((ivec)a & mask) | ((ivec)b & ~mask));
}

/* e^r for |r| <= ln(2) / 2: Cephes' single-precision polynomial. */
static inline __attribute__((always_inline)) vec exp_reduced(vec r) {
    vec y = splat(1.9875691500e-4f);
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    return y * r * r + r + 1.0f;
}

/* e^x lane by lane (about 1 ulp) as 2^n * e^r, r = x - n ln(2); lanes below -87 give 0, lanes above
 * 88 give e^88. A loop of expf calls stayed scalar wherever gcc could not prove it vectorisable.
 * AVX-512 rounds n and scales by 2^n in one instruction each (vrndscaleps, vscalefps): the
 * bfloat16 SiLU spent most of its time in the integer tricks the generic version needs. */
static inline __attribute__((always_inline)) vec exp_vec(vec x) {
#if defined(__AVX512F__)
    const __mmask16 kept = _mm512_cmp_ps_mask((__m512)x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
    const __m512 v = _mm512_min_ps(_mm512_max_ps((__m512)x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), v));
    return (vec)_mm512_maskz_scalef_ps(kept, (__m512)exp_reduced((vec)r), n);
#else
    const ivec underflow = x < splat(-87.0f);
    x = pick(underflow, splat(-87.0f), x);
    x = pick(x > splat(88.0f), splat(88.0f), x);
    const vec scaled = x * 1.44269504088896341f + 0.5f;
    vec n = __builtin_convertvector(__builtin_convertvector(scaled, ivec), vec);
    n = pick(n > scaled, n - 1.0f, n); /* truncation -> floor */
    const vec r = x - n * 0.693359375f + n * 2.12194440e-4f;
    const ivec two_n = (__builtin_convertvector(n, ivec) + 127) << 23;
    return pick(underflow, splat(0.f), exp_reduced(r) * (vec)two_n);
#endif
}

/* 1 / x to about 1 ulp: vrcp14ps and one Newton step, a third of the time of a vector division. */
static inline __attribute__((always_inline)) vec reciprocal(vec x) {
#if defined(__AVX512F__)
    const vec r = (vec)_mm512_rcp14_ps((__m512)x);
    return r * (2.f - x * r);
#else
    return 1.f / x;
#endif
}

static inline __attribute__((always_inline)) vec from_bf16_vec(hvec x) {
    return (vec)(__builtin_convertvector(x, uvec) << 16);
}

/* 16 values at base + i: float32, or bfloat16 widened (bf16 is the top half of a float). */
static inline __attribute__((always_inline)) vec load_vec(const void *base, int64_t i, const int is_bf16) {
    vec out;
    if (is_bf16) {
        hvec raw;
        memcpy(&raw, (const uint16_t *)base + i, sizeof raw);
        return from_bf16_vec(raw);
    }
    memcpy(&out, (const float *)base + i, sizeof out);
    return out;
}

#if defined(__AVX512BF16__)
/* 16 floats to bfloat16 in one instruction (vcvtneps2bf16): round to nearest even and NaN kept
 * quiet, as bf16.h's float_to_bf16, except that subnormals (below 2^-126) become zero. The
 * bit operations below cost the bfloat16 SiLU twice the time of the float32 one. */
static inline __attribute__((always_inline)) hvec to_bf16_vec(vec x) { return (hvec)_mm512_cvtneps_pbh((__m512)x); }
#else
/* bf16.h's float_to_bf16 on 16 lanes: round to nearest even, NaN kept quiet. */
static inline __attribute__((always_inline)) hvec to_bf16_vec(vec x) {
    const uvec bits = (uvec)x;
    const uvec nearest_even = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const uvec quiet_nan = (bits >> 16) | 0x40u;
    const uvec is_nan = (uvec)((bits & 0x7fffffffu) > 0x7f800000u);
    return __builtin_convertvector((quiet_nan & is_nan) | (nearest_even & ~is_nan), hvec);
}
#endif

/* The value x has once stored as bfloat16 and read back. */
static inline __attribute__((always_inline)) vec round_bf16_vec(vec x) { return from_bf16_vec(to_bf16_vec(x)); }

static inline __attribute__((always_inline)) void store_vec(void *base, int64_t i, vec x, const int is_bf16) {
    if (is_bf16) {
        const hvec half = to_bf16_vec(x);
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
