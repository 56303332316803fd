/* bfloat16 <-> float32, bit for bit as torch converts. */
#ifndef TESSERA_BF16_H
#define TESSERA_BF16_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint32_t nearest_even = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const uint32_t quiet_nan = (bits >> 16) | 0x40u;
    /* a select, not a branch, so that loops over it vectorise */
    return (uint16_t)((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : nearest_even);
}

/* The value a float32 result has once stored as bfloat16 and read back. */
static inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

/* Element i of a float32 or bfloat16 array, as float32; and the store back (rounded for bfloat16). */
static inline __attribute__((always_inline)) float load_float(const void *base, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_float(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

static inline __attribute__((always_inline)) void store_float(void *base, int64_t i, float x, int is_bf16) {
    if (is_bf16) ((uint16_t *)base)[i] = float_to_bf16(x);
    else ((float *)base)[i] = x;
}

#endif
