/* Linear layers on GGUF weights kept in their block formats: y = x @ W.T (+ bias) where W stays as
 * the file's blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K), and the rows of
 * such a weight dequantized (the embedding table's gather, and tests).
 *
 * As in llama.cpp, activations are quantized to int8 first, per block of 32 values (one float
 * scale d each: x ~ d * q). A weight row is decoded, one row at a time into a small per-thread
 * scratch, to unsigned codes with a scale and a min per group of 16 values (w ~ scale * code - min);
 * every format above fits that form. The product of a group is then an integer dot product of
 * unsigned codes and signed activations, exactly what AVX-512 VNNI's vpdpbusd computes (64 pairs an
 * instruction); AVX2 widens to 16 bits and uses vpmaddwd; other CPUs run the plain loop.
 *
 *   y = sum_g  scale_g * d_b(g) * sum_{i in g} code_i q_i   -   sum_g  min_g * d_b(g) * sum_{i in g} q_i
 *
 * The second sum only needs the activations' group sums, computed once per activation row.
 * Weight rows are shared among the threads; each decoded tile of TILE rows meets every activation
 * row while it is in L1, so a prefill decodes each weight once.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_num_threads(void) { return 1; }
static inline int omp_get_thread_num(void) { return 0; }
#endif

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define GROUP 16 /* values per weight scale/min */
#define ABLOCK 32 /* values per activation scale */
#define KBLOCK 256 /* values per K-quant block, and per activation scale for their fused kernels */
#define TILE 4 /* weight rows decoded together */

/* ggml's type numbers (GGMLQuantizationType) */
enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14 };
/* A type's rows interleaved 16 to a group (gguf_to_x16): its type number plus X16. Only the AVX-512 VNNI
 * build reads them (FUSED_KERNELS). */
#define X16 0x100
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
#define FUSED_KERNELS 1
#else
#define FUSED_KERNELS 0
#endif

static inline float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant) { /* subnormal: value mant * 2^-24 */
        float f = (float)mant * 5.9604644775390625e-8f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* ---- decoding one block to codes, scale and min per group of 16 -------------------------------- */

/* 32 codes from 16 bytes of nibbles: the low nibbles first, then the high ones (Q4_0, Q4_1, Q5_x). */
static inline void nibbles(const uint8_t *qs, uint8_t *c) {
#if defined(__AVX2__)
    const __m128i packed = _mm_loadu_si128((const __m128i *)qs), low_nibble = _mm_set1_epi8(0xf);
    const __m128i low = _mm_and_si128(packed, low_nibble), high = _mm_and_si128(_mm_srli_epi16(packed, 4), low_nibble);
    _mm256_storeu_si256((__m256i *)c, _mm256_set_m128i(high, low));
#else
    for (int j = 0; j < 16; j++) { c[j] = qs[j] & 0xf; c[j + 16] = qs[j] >> 4; }
#endif
}

static inline void decode_q4_0(const uint8_t *b, uint8_t *c, float *s, float *m) {
    const float d = half_to_float(b);
    nibbles(b + 2, c);
    s[0] = s[1] = d;
    m[0] = m[1] = 8.f * d;
}

static inline void decode_q4_1(const uint8_t *b, uint8_t *c, float *s, float *m) {
    const float d = half_to_float(b), min = half_to_float(b + 2);
    nibbles(b + 4, c);
    s[0] = s[1] = d;
    m[0] = m[1] = -min;
}

/* Bit j of the 32 bits at qh4 is the fifth bit of code j. */
static inline void five_bits(const uint8_t *qh4, const uint8_t *qs, uint8_t *c) {
    uint32_t qh;
    memcpy(&qh, qh4, 4);
    nibbles(qs, c);
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    const __m256i fifth = _mm256_maskz_mov_epi8((__mmask32)qh, _mm256_set1_epi8(16));
    _mm256_storeu_si256((__m256i *)c, _mm256_or_si256(_mm256_loadu_si256((const __m256i *)c), fifth));
#else
    for (int j = 0; j < 32; j++) c[j] |= ((qh >> j) & 1) << 4;
#endif
}

static inline void decode_q5_0(const uint8_t *b, uint8_t *c, float *s, float *m) {
    const float d = half_to_float(b);
    five_bits(b + 2, b + 6, c);
    s[0] = s[1] = d;
    m[0] = m[1] = 16.f * d;
}

static inline void decode_q5_1(const uint8_t *b, uint8_t *c, float *s, float *m) {
    const float d = half_to_float(b), min = half_to_float(b + 2);
    five_bits(b + 4, b + 8, c);
    s[0] = s[1] = d;
    m[0] = m[1] = -min;
}

static inline void decode_q8_0(const uint8_t *b, uint8_t *c, float *s, float *m) {
    const float d = half_to_float(b);
    for (int j = 0; j < 32; j++) c[j] = b[2 + j] ^ 0x80; /* int8 + 128 */
    s[0] = s[1] = d;
    m[0] = m[1] = 128.f * d;
}

/* ---- rows interleaved: 16 to a group --------------------------------------------------------------
 *
 * The fused kernels share a block's float work (scales, mins, the conversion to float) across 16 rows,
 * and each activation value is read once per 16 rows, not once per row. Rows go in groups of 16 (the last
 * group holds the rest, r rows). A group holds, block after block, its r rows' blocks field by field (in
 * k16_layout's order): a 2-byte field (d, dmin, a 32-value type's min) as r halves side by side, a longer
 * one (scales, fifth bits, codes) in quads of 4 bytes, quad j of every row (lane l of a vector: row l)
 * before quad j + 1. The same bytes as the file's, so the same size; one vpdpbusd against a broadcast quad
 * of the activation advances 16 rows' dot products (the fused kernels below). */
#define K16_ROWS 16
#define K16_MAX_FIELDS 14

typedef struct {
    int count, offset[K16_MAX_FIELDS], bytes[K16_MAX_FIELDS]; /* in the group's order; offset in the file's block */
} k16_fields;

static int k16_layout(int type, k16_fields *f) {
    switch (type) {
    case Q4_0: *f = (k16_fields){2, {0, 2}, {2, 16}}; return 0; /* d, nibbles */
    case Q4_1: *f = (k16_fields){3, {0, 2, 4}, {2, 2, 16}}; return 0; /* d, min, nibbles */
    case Q5_0: *f = (k16_fields){3, {0, 2, 6}, {2, 4, 16}}; return 0; /* d, fifth bits, nibbles */
    case Q5_1: *f = (k16_fields){4, {0, 2, 4, 8}, {2, 2, 4, 16}}; return 0; /* d, min, fifth bits, nibbles */
    case Q8_0: *f = (k16_fields){2, {0, 2}, {2, 32}}; return 0; /* d, codes */
    case Q4_K: *f = (k16_fields){4, {0, 2, 4, 16}, {2, 2, 12, 128}}; return 0; /* d, dmin, scales and mins, nibbles */
    case Q5_K: *f = (k16_fields){5, {0, 2, 4, 16, 48}, {2, 2, 12, 32, 128}}; return 0; /* ..., fifth bits, nibbles */
    case Q6_K: /* d, scales, then per 32 values of each half the kernel's 12 code quads, in its order */
        *f = (k16_fields){14,
                          {208, 192, 0, 32, 128, 16, 48, 144, 64, 96, 160, 80, 112, 176},
                          {2, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16}};
        return 0;
    default: return -1;
    }
}

/* Whether a type number is interleaved by rows (gguf_to_x16). */
static int is_k16(int type) {
    k16_fields fields;
    return (type & X16) && k16_layout(type & ~X16, &fields) == 0;
}

/* The rows in the group that starts at row `first`: 16, or the rest. */
static inline int k16_group_rows(int64_t rows, int64_t first) {
    return rows - first < K16_ROWS ? (int)(rows - first) : K16_ROWS;
}

/* One file block of row `lane` into a group's block of r rows at `at` (to_k16), or back. */
static void k16_block(const k16_fields *f, uint8_t *at, int r, int lane, uint8_t *block, int to_k16) {
    for (int i = 0; i < f->count; at += f->bytes[i] * r, i++) {
        const int width = f->bytes[i] == 2 ? 2 : 4;
        int j = 0;
#if defined(__AVX512F__)
        /* back to the file's order (the dequantized path's rows), up to 16 quads a gather: quad q at 4 q r */
        const __m512i quad_at = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                   _mm512_set1_epi32(r));
        for (; !to_k16 && width == 4 && f->bytes[i] - j >= 8; j += 64) {
            const int quads = f->bytes[i] - j >= 64 ? 16 : (f->bytes[i] - j) / 4;
            const __mmask16 lanes = (__mmask16)((1u << quads) - 1);
            const __m512i gathered = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), lanes, quad_at, at + j * r + 4 * lane, 4);
            _mm512_mask_storeu_epi32(block + f->offset[i] + j, lanes, gathered);
        }
#endif
        for (; j < f->bytes[i]; j += width) {
            uint8_t *slot = at + j * r + width * lane, *field = block + f->offset[i] + j;
            if (width == 2) memcpy(to_k16 ? slot : field, to_k16 ? field : slot, 2); /* sizes the compiler inlines */
            else memcpy(to_k16 ? slot : field, to_k16 ? field : slot, 4);
        }
    }
}

static inline void decode_q2_k(const uint8_t *b, uint8_t *c, float *s, float *m) {
    const uint8_t *scales = b, *qs = b + 16;
    const float d = half_to_float(b + 80), dmin = half_to_float(b + 82);
    for (int half = 0; half < 2; half++)
        for (int shift = 0; shift < 4; shift++)
            for (int l = 0; l < 32; l++) c[half * 128 + shift * 32 + l] = (qs[half * 32 + l] >> (2 * shift)) & 3;
    for (int g = 0; g < 16; g++) { s[g] = d * (float)(scales[g] & 0xf); m[g] = dmin * (float)(scales[g] >> 4); }
}

static inline void decode_q3_k(const uint8_t *b, uint8_t *c, float *s, float *m) {
    const uint8_t *hmask = b, *qs = b + 32, *sc = b + 96;
    const float d = half_to_float(b + 108);
    for (int half = 0; half < 2; half++)
        for (int shift = 0; shift < 4; shift++)
            for (int l = 0; l < 32; l++) c[half * 128 + shift * 32 + l] = (qs[half * 32 + l] >> (2 * shift)) & 3;
    for (int bit = 0; bit < 8; bit++)
        for (int l = 0; l < 32; l++) c[bit * 32 + l] |= ((hmask[l] >> bit) & 1) << 2; /* value = code - 4 */
    for (int g = 0; g < 16; g++) {
        const int low = g < 8 ? sc[g] & 0xf : sc[g - 8] >> 4;
        const int high = (sc[8 + g % 4] >> (2 * (g / 4))) & 3;
        s[g] = d * (float)((low | (high << 4)) - 32);
        m[g] = 4.f * s[g];
    }
}

/* Q4_K / Q5_K: eight 6-bit scales and mins for sub-blocks of 32 values, packed in 12 bytes. */
static inline void k_scale_min(const uint8_t *q, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4);
        *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

static inline void k_groups(const uint8_t *b, float *s, float *m) {
    const float d = half_to_float(b), dmin = half_to_float(b + 2);
    for (int j = 0; j < 8; j++) {
        int sc, mn;
        k_scale_min(b + 4, j, &sc, &mn);
        s[2 * j] = s[2 * j + 1] = d * (float)sc;
        m[2 * j] = m[2 * j + 1] = dmin * (float)mn;
    }
}

static inline void decode_q4_k(const uint8_t *b, uint8_t *c, float *s, float *m) {
    const uint8_t *qs = b + 16;
    for (int chunk = 0; chunk < 4; chunk++)
        for (int l = 0; l < 32; l++) {
            c[chunk * 64 + l] = qs[chunk * 32 + l] & 0xf;
            c[chunk * 64 + 32 + l] = qs[chunk * 32 + l] >> 4;
        }
    k_groups(b, s, m);
}

static inline void decode_q5_k(const uint8_t *b, uint8_t *c, float *s, float *m) {
    const uint8_t *qh = b + 16, *qs = b + 48;
    for (int chunk = 0; chunk < 4; chunk++)
        for (int l = 0; l < 32; l++) {
            const int lo = chunk * 64 + l, hi = lo + 32;
            c[lo] = (qs[chunk * 32 + l] & 0xf) | (((qh[l] >> (2 * chunk)) & 1) << 4);
            c[hi] = (qs[chunk * 32 + l] >> 4) | (((qh[l] >> (2 * chunk + 1)) & 1) << 4);
        }
    k_groups(b, s, m);
}

static inline void decode_q6_k(const uint8_t *b, uint8_t *c, float *s, float *m) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *scales = (const int8_t *)(b + 192);
    const float d = half_to_float(b + 208);
    for (int half = 0; half < 2; half++) { /* value = code - 32 */
        const uint8_t *low = ql + half * 64, *high = qh + half * 32;
        uint8_t *out = c + half * 128;
        for (int l = 0; l < 32; l++) {
            out[l] = (low[l] & 0xf) | ((high[l] & 3) << 4);
            out[l + 32] = (low[l + 32] & 0xf) | (((high[l] >> 2) & 3) << 4);
            out[l + 64] = (low[l] >> 4) | (((high[l] >> 4) & 3) << 4);
            out[l + 96] = (low[l + 32] >> 4) | ((high[l] >> 6) << 4);
        }
    }
    for (int g = 0; g < 16; g++) { s[g] = d * (float)scales[g]; m[g] = 32.f * s[g]; }
}

typedef struct {
    int type, block_values, block_bytes;
} format;

static int find_format(int type, format *f) {
    if (type & X16) {
        if (!FUSED_KERNELS || !is_k16(type)) return -1;
        find_format(type & ~X16, f);
        f->type = type;
        return 0;
    }
    switch (type) {
    case Q4_0: *f = (format){type, 32, 18}; return 0;
    case Q4_1: *f = (format){type, 32, 20}; return 0;
    case Q5_0: *f = (format){type, 32, 22}; return 0;
    case Q5_1: *f = (format){type, 32, 24}; return 0;
    case Q8_0: *f = (format){type, 32, 34}; return 0;
    case Q2_K: *f = (format){type, 256, 84}; return 0;
    case Q3_K: *f = (format){type, 256, 110}; return 0;
    case Q4_K: *f = (format){type, 256, 144}; return 0;
    case Q5_K: *f = (format){type, 256, 176}; return 0;
    case Q6_K: *f = (format){type, 256, 210}; return 0;
    default: return -1;
    }
}

/* Every block of a row through one format's decoder, called directly so it is inlined: an indirect
 * call per 32-value block cost more than the decoding. */
#define DECODE_BLOCKS(decode)                                                                            \
    for (int64_t b = 0; b < blocks; b++)                                                                 \
        decode(row + b * f->block_bytes, codes + b * f->block_values, scale + b * groups, min + b * groups); \
    break

/* One weight row of k values in the file's order. */
static inline void decode_row(const format *f, const uint8_t *row, int64_t k, uint8_t *codes, float *scale,
                              float *min) {
    const int64_t blocks = k / f->block_values;
    const int groups = f->block_values / GROUP;
    switch (f->type) {
    case Q4_0: DECODE_BLOCKS(decode_q4_0);
    case Q4_1: DECODE_BLOCKS(decode_q4_1);
    case Q5_0: DECODE_BLOCKS(decode_q5_0);
    case Q5_1: DECODE_BLOCKS(decode_q5_1);
    case Q8_0: DECODE_BLOCKS(decode_q8_0);
    case Q2_K: DECODE_BLOCKS(decode_q2_k);
    case Q3_K: DECODE_BLOCKS(decode_q3_k);
    case Q4_K: DECODE_BLOCKS(decode_q4_k);
    case Q5_K: DECODE_BLOCKS(decode_q5_k);
    case Q6_K: DECODE_BLOCKS(decode_q6_k);
    }
}

/* Row n of an interleaved weight (rows x row_bytes): each block copied back to the file's layout, then
 * decoded as the file's. */
static void decode_k16_row(const format *f, const uint8_t *w, int64_t row_bytes, int64_t rows, int64_t n, int64_t k,
                           uint8_t *codes, float *scale, float *min) {
    const format file = {f->type & ~X16, f->block_values, f->block_bytes};
    k16_fields fields;
    k16_layout(file.type, &fields); /* find_format admitted the type */
    const int64_t first = n / K16_ROWS * K16_ROWS, count = k / f->block_values;
    const int r = k16_group_rows(rows, first), groups = f->block_values / GROUP;
    enum { CHUNK = 16 };
    uint8_t blocks[CHUNK * 256]; /* the largest block is Q6_K's 210 bytes */
    for (int64_t b0 = 0; b0 < count; b0 += CHUNK) { /* CHUNK blocks a decode_row call */
        const int64_t chunk = count - b0 < CHUNK ? count - b0 : CHUNK;
        for (int64_t b = 0; b < chunk; b++) { /* only read: to_k16 = 0 */
            uint8_t *at = (uint8_t *)w + first * row_bytes + (b0 + b) * r * f->block_bytes;
            k16_block(&fields, at, r, (int)(n - first), blocks + b * f->block_bytes, 0);
        }
        decode_row(&file, blocks, chunk * f->block_values, codes + b0 * f->block_values, scale + b0 * groups,
                   min + b0 * groups);
    }
}

/* Row n of a weight (rows x row_bytes) of k values: codes [k], scale and min [k / 16]. */
static void decode_weight_row(const format *f, const uint8_t *w, int64_t row_bytes, int64_t rows, int64_t n, int64_t k,
                              uint8_t *codes, float *scale, float *min) {
    if (is_k16(f->type)) decode_k16_row(f, w, row_bytes, rows, n, k, codes, scale, min);
    else decode_row(f, w + n * row_bytes, k, codes, scale, min);
}

/* ---- activations to int8 ----------------------------------------------------------------------- */

/* Per block of 32: d = max|x| / 127, q = round(x / d); gsum[g] = d * sum of q over group g (16). */
#if defined(__AVX512F__)
static inline __m512 load16(const void *x, int64_t i, int is_bf16) {
    if (!is_bf16) return _mm512_loadu_ps((const float *)x + i);
    const __m256i bits = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

/* The loop below, 16 values a vector: the same roundings (to nearest even), so the same codes. */
static void quantize_activation_row(const void *x, int is_bf16, int64_t k, int8_t *q, float *d, float *gsum) {
    for (int64_t b = 0; b < k / ABLOCK; b++) {
        const __m512 low = load16(x, b * ABLOCK, is_bf16), high = load16(x, b * ABLOCK + 16, is_bf16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(low), _mm512_abs_ps(high)));
        const float scale = amax / 127.f, inverse = scale > 0.f ? 1.f / scale : 0.f;
        const __m512i low_codes = _mm512_cvtps_epi32(_mm512_mul_ps(low, _mm512_set1_ps(inverse)));
        const __m512i high_codes = _mm512_cvtps_epi32(_mm512_mul_ps(high, _mm512_set1_ps(inverse)));
        _mm_storeu_si128((__m128i *)(q + b * ABLOCK), _mm512_cvtepi32_epi8(low_codes));
        _mm_storeu_si128((__m128i *)(q + b * ABLOCK + 16), _mm512_cvtepi32_epi8(high_codes));
        d[b] = scale;
        gsum[2 * b] = scale * (float)_mm512_reduce_add_epi32(low_codes);
        gsum[2 * b + 1] = scale * (float)_mm512_reduce_add_epi32(high_codes);
    }
}
#else
static void quantize_activation_row(const void *x, int is_bf16, int64_t k, int8_t *q, float *d, float *gsum) {
    for (int64_t b = 0; b < k / ABLOCK; b++) {
        float v[ABLOCK], amax = 0.f;
        for (int i = 0; i < ABLOCK; i++) {
            v[i] = load_float(x, b * ABLOCK + i, is_bf16);
            amax = fmaxf(amax, fabsf(v[i]));
        }
        const float scale = amax / 127.f, inverse = scale > 0.f ? 1.f / scale : 0.f;
        int sums[2] = {0, 0};
        for (int i = 0; i < ABLOCK; i++) {
            const int value = (int)lrintf(v[i] * inverse);
            q[b * ABLOCK + i] = (int8_t)value;
            sums[i / GROUP] += value;
        }
        d[b] = scale;
        gsum[2 * b] = scale * (float)sums[0];
        gsum[2 * b + 1] = scale * (float)sums[1];
    }
}
#endif

/* ---- the dot product of a decoded row with a quantized activation row -------------------------- */

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
/* 64 values (4 groups) an iteration: vpdpbusd leaves lane l the sum of 4 products of group l / 4. */
static inline float codes_dot_simd(const uint8_t *codes, const float *scale, const int8_t *q, const float *d,
                                   int64_t k) {
    const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m512i pairs = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += 64) {
        const __m512i dots = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_loadu_si512(codes + i),
                                                 _mm512_loadu_si512(q + i));
        const __m128 four_scales = _mm_loadu_ps(scale + i / 16);
        const __m128 two_blocks = _mm_castpd_ps(_mm_load_sd((const double *)(d + i / 32)));
        const __m512 group_scale = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(four_scales));
        const __m512 block_scale = _mm512_permutexvar_ps(pairs, _mm512_castps128_ps512(two_blocks));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_mul_ps(group_scale, block_scale), acc);
    }
    return _mm512_reduce_add_ps(acc);
}
#define CODES_STEP 64
#elif defined(__AVX2__)
/* 16 values (1 group) an iteration, widened to 16 bits: vpmaddubsw would saturate on Q8_0's codes. */
static inline float codes_dot_simd(const uint8_t *codes, const float *scale, const int8_t *q, const float *d,
                                   int64_t k) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 16) {
        const __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(codes + i)));
        const __m256i a = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + i)));
        const __m256 dots = _mm256_cvtepi32_ps(_mm256_madd_epi16(c, a));
        acc = _mm256_fmadd_ps(dots, _mm256_set1_ps(scale[i / 16] * d[i / 32]), acc);
    }
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
}
#define CODES_STEP 16
#else
static inline float codes_dot_simd(const uint8_t *codes, const float *scale, const int8_t *q, const float *d,
                                   int64_t k) {
    (void)codes, (void)scale, (void)q, (void)d, (void)k;
    return 0.f;
}
#define CODES_STEP 0
#endif

/* Groups [from, to) one at a time: the portable build, and what is left past the vector loop. */
static inline float codes_dot_groups(const uint8_t *codes, const float *scale, const int8_t *q, const float *d,
                                     int64_t from, int64_t to) {
    float total = 0.f;
    for (int64_t g = from; g < to; g++) {
        int32_t sum = 0;
        for (int i = 0; i < GROUP; i++) sum += (int32_t)codes[g * GROUP + i] * (int32_t)q[g * GROUP + i];
        total += scale[g] * d[g / 2] * (float)sum;
    }
    return total;
}

static inline float codes_dot(const uint8_t *codes, const float *scale, const int8_t *q, const float *d, int64_t k) {
    const int64_t whole = CODES_STEP ? k / (CODES_STEP ? CODES_STEP : 1) * CODES_STEP : 0;
    const float head = whole ? codes_dot_simd(codes, scale, q, d, whole) : 0.f;
    return whole == k ? head : head + codes_dot_groups(codes, scale, q, d, whole / GROUP, k / GROUP);
}

#ifndef ROW_BLOCK
#define ROW_BLOCK 4 /* activation rows that share each load of a weight row's codes */
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
/* codes_dot of one decoded weight row against ROW_BLOCK activation rows (q, d: row strides k and
 * k / 32): each 64 codes and their group scales are loaded once for all the rows. */
static inline void codes_dot_rows(const uint8_t *codes, const float *scale, const int8_t *q, const float *d,
                                  int64_t k, float *out) {
    const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m512i pairs = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const int64_t whole = k / 64 * 64, blocks = k / ABLOCK;
    __m512 acc[ROW_BLOCK];
    for (int j = 0; j < ROW_BLOCK; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < whole; i += 64) {
        const __m512i c = _mm512_loadu_si512(codes + i);
        const __m512 group_scale = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(scale + i / 16)));
        for (int j = 0; j < ROW_BLOCK; j++) {
            const __m512i dots = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c, _mm512_loadu_si512(q + j * k + i));
            const __m128 two_blocks = _mm_castpd_ps(_mm_load_sd((const double *)(d + j * blocks + i / 32)));
            const __m512 block_scale = _mm512_permutexvar_ps(pairs, _mm512_castps128_ps512(two_blocks));
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_mul_ps(group_scale, block_scale), acc[j]);
        }
    }
    for (int j = 0; j < ROW_BLOCK; j++) {
        const int8_t *row = q + j * k;
        const float tail =
            whole == k ? 0.f : codes_dot_groups(codes, scale, row, d + j * blocks, whole / GROUP, k / GROUP);
        out[j] = _mm512_reduce_add_ps(acc[j]) + tail;
    }
}
#else
static inline void codes_dot_rows(const uint8_t *codes, const float *scale, const int8_t *q, const float *d,
                                  int64_t k, float *out) {
    for (int j = 0; j < ROW_BLOCK; j++) out[j] = codes_dot(codes, scale, q + j * k, d + j * (k / ABLOCK), k);
}
#endif

static inline float min_dot(const float *min, const float *gsum, int64_t groups) {
    float total = 0.f;
    for (int64_t g = 0; g < groups; g++) total += min[g] * gsum[g];
    return total;
}

/* ---- the fused path (AVX-512 VNNI): codes made in registers, 16 rows a vector ----------------------
 *
 * The common types skip the decoded scratch row. Their rows are interleaved at load, 16 to a group
 * (gguf_to_x16), so lane l of every vector is row l: one vpdpbusd meets 16 rows' quads of unsigned codes
 * with one broadcast quad of the int8 activation, and a block's float work comes once per 16 rows. Up to
 * FUSED_ROWS activation rows share each vector of codes.
 *
 * The 32-value types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) take the activation per block of 32, as llama.cpp's
 * Q8_0 / Q8_1 do: a block's 8 vpdpbusd sum it in integers, Q4_0, Q5_0 and Q8_0 subtract their offset (8,
 * 16, 128: Q8_0's codes are its int8 + 128) where the vpdpbusd starts, Q4_1 and Q5_1 meet their mins
 * against the activation's block sums (d * sum of q), and one conversion and multiply-add per activation
 * row finish 16 rows (k16_small).
 *
 * The K-quants (Q4_K, Q5_K, Q6_K) take the activation per block of 256 (one d a block, llama.cpp's Q8_K):
 * a sub-block's sums meet the 16 rows' integer scales in one vpmulld, and per block and activation row one
 * conversion and multiply-add (two for the mins) finish 16 rows (k16_q4_k, k16_q6_k).
 *
 * In the file's order every type runs the decoded path. A row's arithmetic is the same whatever rows run
 * beside it, so a row's output does not depend on the batch (speculative verification relies on it). */
#if FUSED_KERNELS
#define FUSED_ROWS 8 /* activation rows that share each vector of codes */
/* How far ahead of its reads a group's first pass asks for the weight's bytes, into L2: the hardware's own
 * prefetchers leave a one-row decode waiting on memory (docs/kernels.md, GGUF linear layers). */
#define PREFETCH_BYTES 4096

typedef struct {
    const int8_t *q;           /* in the values' order */
    const float *d;            /* per block of 32 (32-value types) or of 256 (K-quants) */
    const int32_t *offset_sum; /* 32-value types, per block: -offset * its sum of q (Q4_0, Q5_0, Q8_0) */
    const float *block_sum;    /* 32-value types, per block: d * its sum of q, the mins' partner (Q4_1, Q5_1) */
    const int16_t *pair_sums;  /* K-quants: quantize_k16_activation_row's sums */
} lanes;

#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE __m512i low_nibbles(__m512i v) { return _mm512_and_si512(v, _mm512_set1_epi8(0xf)); }

/* GFNI's vgf2p8affineqb moves and masks bits within each byte in one instruction: output bit i of a byte
 * is the parity of the byte AND byte 7 - i of the matrix. */
#if defined(__GFNI__)
ALWAYS_INLINE __m512i byte_bits(__m512i v, uint64_t matrix) {
    return _mm512_gf2p8affine_epi64_epi8(v, _mm512_set1_epi64((long long)matrix), 0);
}
#endif

/* Every byte's high nibble as its low one. */
ALWAYS_INLINE __m512i high_nibbles(__m512i v) {
#if defined(__GFNI__)
    return byte_bits(v, 0x1020408000000000ull); /* bits 0-3 <- 4-7 */
#else
    return low_nibbles(_mm512_srli_epi16(v, 4));
#endif
}

/* Bits 2p and 2p + 1 of every byte at bits 4 and 5, the others zero (Q6_K's high bits of quarter p). */
ALWAYS_INLINE __m512i high_bit_pair(__m512i h, int p) {
#if defined(__GFNI__)
    return byte_bits(h, (1ull << (2 * p)) << 24 | (1ull << (2 * p + 1)) << 16); /* bits 4, 5 <- 2p, 2p + 1 */
#else
    const __m512i at_4 = p == 0 ? _mm512_slli_epi16(h, 4) : p == 1 ? _mm512_slli_epi16(h, 2) : p == 2 ? h : _mm512_srli_epi16(h, 2);
    return _mm512_and_si512(at_4, _mm512_set1_epi8(0x30));
#endif
}

/* (low nibble of v) | bits, in one vpternlogd. */
ALWAYS_INLINE __m512i low_nibbles_with(__m512i v, __m512i bits) {
    return _mm512_ternarylogic_epi32(v, bits, _mm512_set1_epi8(0xf), 0xec); /* (v & 0xf) | bits */
}

/* What every thread of one fused_linear call shares. */
typedef struct {
    const lanes *a;
    int64_t m, k, row_bytes, ldy, rows;
    const uint8_t *w;
    const void *bias;
    void *y;
    int is_bf16;
} fused_job;

/* ---- the kernels: 16 weight rows a vector ---- */

/* x ~ d * q per block of 256 (d = max|x| / 127, q rounded to nearest even), q in the values' order, and per `span`
 * values (32: Q4_K, Q5_K; 16: Q6_K) the sum of q, as 16 bits, each four spans in the order 0, 2, 1, 3:
 * the pairs that the kernels' vpdpwssd meet with a lane's pairs of mins or scales. */
static void quantize_k16_activation_row(const void *x, int is_bf16, int64_t k, int span, int8_t *q, float *d,
                                        int16_t *sums) {
    static const int pair_order[4] = {0, 2, 1, 3};
    for (int64_t b = 0; b < k / KBLOCK; b++) {
        __m512 amax = _mm512_setzero_ps();
        for (int i = 0; i < KBLOCK; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load16(x, b * KBLOCK + i, is_bf16)));
        const float scale = _mm512_reduce_max_ps(amax) / 127.f, inverse = scale > 0.f ? 1.f / scale : 0.f;
        d[b] = scale;
        int16_t *block_sums = sums + b * (KBLOCK / span);
        memset(block_sums, 0, sizeof(int16_t) * (size_t)(KBLOCK / span));
        for (int i = 0; i < KBLOCK; i += 16) {
            const __m512i codes = _mm512_cvtps_epi32(_mm512_mul_ps(load16(x, b * KBLOCK + i, is_bf16), _mm512_set1_ps(inverse)));
            _mm_storeu_si128((__m128i *)(q + b * KBLOCK + i), _mm512_cvtepi32_epi8(codes));
            const int at = i / span;
            block_sums[at / 4 * 4 + pair_order[at % 4]] += (int16_t)_mm512_reduce_add_epi32(codes);
        }
    }
}

ALWAYS_INLINE __m512i load_quad(const int8_t *q) {
    int32_t quad;
    memcpy(&quad, q, 4);
    return _mm512_set1_epi32(quad);
}

/* Byte `byte` of every 32-bit lane, unsigned or sign-extended. */
ALWAYS_INLINE __m512i lane_byte(__m512i v, int byte, int is_signed) {
    if (is_signed) return _mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * byte), 24);
    return byte == 3 ? _mm512_srli_epi32(v, 24) : _mm512_and_si512(_mm512_srli_epi32(v, 8 * byte), _mm512_set1_epi32(0xff));
}

/* start + the sum over `count` quads of one sub-block's codes (c[i]: lane l row l's quad i) and the
 * activation's quads at q, in two chains of vpdpbusd. */
ALWAYS_INLINE __m512i quads_dot(const __m512i *c, int count, const int8_t *q, __m512i start) {
    __m512i even = start, odd = _mm512_setzero_si512();
    for (int i = 0; i < count; i += 2) {
        even = _mm512_dpbusd_epi32(even, c[i], load_quad(q + 4 * i));
        odd = _mm512_dpbusd_epi32(odd, c[i + 1], load_quad(q + 4 * i + 4));
    }
    return _mm512_add_epi32(even, odd);
}

/* One block of 16 (r) rows of Q4_K / Q5_K (fifth_bits) against `rows` activation rows, into their
 * accumulators (lane l: row l). Per sub-block s of 32: 8 code vectors (low nibbles of quads 8 (s / 2) ..
 * + 7 for even s, high for odd, plus bit s of the fifth-bit quads), 8 vpdpbusd a row, one multiply by
 * the lanes' scales; per block the mins meet the activation's sums in 4 vpdpwssd. */
/* A Q4_K / Q5_K block of 16 (r) rows: its byte mask and quad stride, d and dmin (lane l: row l), the packed
 * 6-bit scales and mins (byte j of a lane of scales[h]: sub-block 4h + j's), and where its codes are. */
typedef struct {
    __mmask64 bytes;
    int stride;
    __m512 d, dmin;
    __m512i scales[2], mins[2];
    const uint8_t *qh, *qs;
} q4_k_block;

ALWAYS_INLINE q4_k_block q4_k_open(const uint8_t *at, int r, int fifth_bits) {
    q4_k_block k;
    k.stride = 4 * r;
    k.bytes = r == K16_ROWS ? ~0ull : (1ull << k.stride) - 1;
    const __mmask16 halves = (__mmask16)((1u << r) - 1);
    k.d = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(halves, at));
    k.dmin = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(halves, at + 2 * r));
    const uint8_t *packed = at + 4 * r;
    k.qh = packed + 3 * k.stride;
    k.qs = k.qh + (fifth_bits ? 8 * k.stride : 0);
    const __m512i v0 = _mm512_maskz_loadu_epi8(k.bytes, packed), v1 = _mm512_maskz_loadu_epi8(k.bytes, packed + k.stride);
    const __m512i v2 = _mm512_maskz_loadu_epi8(k.bytes, packed + 2 * k.stride);
    const __m512i six = _mm512_set1_epi8(63), nibble = _mm512_set1_epi8(15), top = _mm512_set1_epi8(0x30);
    /* k_scale_min for 16 rows */
    k.scales[0] = _mm512_and_si512(v0, six);
    k.scales[1] = _mm512_or_si512(_mm512_and_si512(v2, nibble), _mm512_and_si512(_mm512_srli_epi16(v0, 2), top));
    k.mins[0] = _mm512_and_si512(v1, six);
    k.mins[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v2, 4), nibble), _mm512_and_si512(_mm512_srli_epi16(v1, 2), top));
    return k;
}

/* Sub-block s's 8 code vectors: low nibbles of quads 8 (s / 2) .. + 7 for even s, high for odd, plus bit s
 * of the fifth-bit quads (Q5_K). c[i]: values 32 s + 4 i .. + 3. */
ALWAYS_INLINE void q4_k_codes(const q4_k_block *k, int s, int fifth_bits, __m512i *c) {
    for (int i = 0; i < 8; i++) {
        const __m512i quad_bytes = _mm512_maskz_loadu_epi8(k->bytes, k->qs + k->stride * (8 * (s / 2) + i));
        c[i] = s % 2 ? high_nibbles(quad_bytes) : low_nibbles(quad_bytes);
        if (fifth_bits) {
            const __m512i h = _mm512_maskz_loadu_epi8(k->bytes, k->qh + k->stride * i);
            const __m512i bit = s <= 4 ? _mm512_slli_epi16(h, 4 - s) : _mm512_srli_epi16(h, s - 4);
            c[i] = _mm512_or_si512(c[i], _mm512_and_si512(bit, _mm512_set1_epi8(16)));
        }
    }
}

ALWAYS_INLINE void k16_q4_k(const uint8_t *at, int r, int64_t b, const lanes *a, int rows, __m512 *acc, int fifth_bits) {
    const q4_k_block k = q4_k_open(at, r, fifth_bits);
    __m512i sums[FUSED_ROWS];
    for (int j = 0; j < rows; j++) sums[j] = _mm512_setzero_si512();
    for (int s = 0; s < 8; s++) {
        __m512i c[8];
        q4_k_codes(&k, s, fifth_bits, c);
        const __m512i scale = lane_byte(k.scales[s / 4], s % 4, 0);
        for (int j = 0; j < rows; j++)
            sums[j] = _mm512_add_epi32(sums[j], _mm512_mullo_epi32(quads_dot(c, 8, a[j].q + b * KBLOCK + 32 * s, _mm512_setzero_si512()), scale));
    }
    /* 16-bit pairs of mins (s, s + 2) against the activation's sums in the same pairs */
    const __m512i low_bytes = _mm512_set1_epi32(0x00ff00ff);
    const __m512i min_pairs[4] = {_mm512_and_si512(k.mins[0], low_bytes), _mm512_srli_epi16(k.mins[0], 8),
                                  _mm512_and_si512(k.mins[1], low_bytes), _mm512_srli_epi16(k.mins[1], 8)};
    for (int j = 0; j < rows; j++) {
        const int16_t *pair_sums = a[j].pair_sums + b * 8;
        __m512i m = _mm512_setzero_si512();
        for (int p = 0; p < 4; p++) m = _mm512_dpwssd_epi32(m, min_pairs[p], load_quad((const int8_t *)(pair_sums + 2 * p)));
        const __m512 activation_d = _mm512_set1_ps(a[j].d[b]);
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[j]), _mm512_mul_ps(k.d, activation_d), acc[j]);
        acc[j] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(m), _mm512_mul_ps(k.dmin, activation_d), acc[j]);
    }
}

/* One block of 16 (r) rows of Q6_K. Each quarter of the block (half, part) is 12 quad vectors, as
 * k16_layout orders them: low-nibble quads of ql bytes 64 half + 16 part .., of ql bytes 64 half + 32 + 16
 * part .., and high-bit quads of qh bytes 32 half + 16 part ..; they make 16 code vectors, 4 for each of the
 * quarter's 4 sub-blocks of 16 (values 128 half + 32 p + 16 part), and a sub-block's sums meet its int8
 * scales in one multiply. The offset (code - 32) meets the activation's sums per 16 in 8 vpdpwssd a block. */
typedef struct {
    __mmask64 bytes;
    int stride;
    __m512 d;
    __m512i scales[4]; /* byte j of a lane of scales[t]: sub-block 4t + j's int8 scale */
    const uint8_t *packed;
} q6_k_block;

ALWAYS_INLINE q6_k_block q6_k_open(const uint8_t *at, int r) {
    q6_k_block k;
    k.stride = 4 * r;
    k.bytes = r == K16_ROWS ? ~0ull : (1ull << k.stride) - 1;
    k.packed = at + 2 * r;
    k.d = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16((__mmask16)((1u << r) - 1), at));
    for (int t = 0; t < 4; t++) k.scales[t] = _mm512_maskz_loadu_epi8(k.bytes, k.packed + k.stride * t);
    return k;
}

/* Quarter (half, part)'s 16 code vectors, c[p][i]: values 128 half + 32 p + 16 part + 4 i .. + 3, whose
 * sub-block is 8 half + 2 p + part; a value is its sub-block's scale * (code - 32). */
ALWAYS_INLINE void q6_k_codes(const q6_k_block *k, int half, int part, __m512i c[4][4]) {
    const uint8_t *quads = k->packed + (4 + 12 * (2 * half + part)) * k->stride;
    for (int i = 0; i < 4; i++) {
        const __m512i low = _mm512_maskz_loadu_epi8(k->bytes, quads + k->stride * i);
        const __m512i high = _mm512_maskz_loadu_epi8(k->bytes, quads + k->stride * (4 + i));
        const __m512i h = _mm512_maskz_loadu_epi8(k->bytes, quads + k->stride * (8 + i));
        c[0][i] = low_nibbles_with(low, high_bit_pair(h, 0));
        c[1][i] = low_nibbles_with(high, high_bit_pair(h, 1));
        c[2][i] = _mm512_or_si512(high_nibbles(low), high_bit_pair(h, 2));
        c[3][i] = _mm512_or_si512(high_nibbles(high), high_bit_pair(h, 3));
    }
}

ALWAYS_INLINE void k16_q6_k(const uint8_t *at, int r, int64_t b, const lanes *a, int rows, __m512 *acc) {
    const q6_k_block k = q6_k_open(at, r);
    __m512i sums[FUSED_ROWS];
    for (int j = 0; j < rows; j++) sums[j] = _mm512_setzero_si512();
    for (int half = 0; half < 2; half++)
        for (int part = 0; part < 2; part++) { /* the first or second sub-block of 16 of each 32 */
            __m512i c[4][4];
            q6_k_codes(&k, half, part, c);
            __m512i scale[4];
            for (int p = 0; p < 4; p++) {
                const int s = 8 * half + 2 * p + part;
                scale[p] = lane_byte(k.scales[s / 4], s % 4, 1);
            }
            for (int j = 0; j < rows; j++) {
                const int8_t *q = a[j].q + b * KBLOCK + 128 * half + 16 * part;
                for (int p = 0; p < 4; p++)
                    sums[j] = _mm512_add_epi32(sums[j], _mm512_mullo_epi32(quads_dot(c[p], 4, q + 32 * p, _mm512_setzero_si512()), scale[p]));
            }
        }
    /* 16-bit pairs of scales (s, s + 2) against the activation's sums per 16 in the same pairs */
    __m512i scale_pairs[8];
    for (int t = 0; t < 4; t++) {
        scale_pairs[2 * t] = _mm512_srai_epi16(_mm512_slli_epi16(k.scales[t], 8), 8);
        scale_pairs[2 * t + 1] = _mm512_srai_epi16(k.scales[t], 8);
    }
    for (int j = 0; j < rows; j++) {
        const int16_t *pair_sums = a[j].pair_sums + b * 16;
        __m512i offset = _mm512_setzero_si512();
        for (int p = 0; p < 8; p++) offset = _mm512_dpwssd_epi32(offset, scale_pairs[p], load_quad((const int8_t *)(pair_sums + 2 * p)));
        const __m512i total = _mm512_sub_epi32(sums[j], _mm512_slli_epi32(offset, 5));
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(k.d, _mm512_set1_ps(a[j].d[b])), acc[j]);
    }
}

/* What a 32-value type's code is above its value (w = d * (code - offset)): Q8_0's codes are its int8 + 128;
 * 0 for the types with a min. */
static int code_offset(int type) { return type == Q4_0 ? 8 : type == Q5_0 ? 16 : type == Q8_0 ? 128 : 0; }

static int is_k_quant(int type) { return type == Q4_K || type == Q5_K || type == Q6_K; }

/* Per block of 32 of an activation row (quantize_activation_row's q and d): -offset * the sum of q, and d *
 * the sum of q. */
static void activation_block_sums(const int8_t *q, const float *d, int64_t k, int offset, int32_t *offset_sum,
                                  float *block_sum) {
    for (int64_t b = 0; b < k / ABLOCK; b++) {
        int sum = 0;
        for (int i = 0; i < ABLOCK; i++) sum += q[b * ABLOCK + i];
        offset_sum[b] = -offset * sum;
        block_sum[b] = d[b] * (float)sum;
    }
}

/* Where the fifth bits of code vector i (codes 4i .. 4i + 3) are set: byte t of lane l tests bit 4i + t of row
 * l's 32 fifth bits (the lane's byte i / 2, copied to its 4 bytes). */
ALWAYS_INLINE __mmask64 fifth_bit_mask(__m512i h, int i) {
    const __m512i lane_bytes = _mm512_broadcast_i32x4(_mm_set_epi32(0x0c0c0c0c, 0x08080808, 0x04040404, 0));
    const __m512i byte = _mm512_shuffle_epi8(h, _mm512_add_epi8(lane_bytes, _mm512_set1_epi8((char)(i / 2))));
    return _mm512_test_epi8_mask(byte, _mm512_set1_epi32(i % 2 ? (int)0x80402010 : 0x08040201));
}

/* A 32-value block of 16 (r) rows: d and min (zero without one) per lane, and its 8 code vectors (c[i]:
 * codes 4i .. 4i + 3 of each row: low nibbles of nibble quad i for i < 4, high ones of quad i - 4; Q8_0's
 * code quads, its int8 + 128). A value is d * (code - code_offset) + min. */
ALWAYS_INLINE void small_codes(int type, const uint8_t *at, int r, __m512 *d, __m512 *mins, __m512i *c) {
    const int has_min = type == Q4_1 || type == Q5_1, fifth_bits = type == Q5_0 || type == Q5_1, stride = 4 * r;
    const __mmask64 bytes = r == K16_ROWS ? ~0ull : (1ull << stride) - 1;
    const __mmask16 halves = (__mmask16)((1u << r) - 1);
    *d = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(halves, at));
    *mins = has_min ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(halves, at + 2 * r)) : _mm512_setzero_ps();
    const uint8_t *qh = at + (has_min ? 4 : 2) * r, *qs = qh + (fifth_bits ? stride : 0);
    if (type == Q8_0) {
        for (int i = 0; i < 8; i++)
            c[i] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(bytes, qs + stride * i), _mm512_set1_epi8((char)0x80));
    } else {
        for (int i = 0; i < 4; i++) {
            const __m512i nibble_bytes = _mm512_maskz_loadu_epi8(bytes, qs + stride * i);
            c[i] = low_nibbles(nibble_bytes);
            c[i + 4] = high_nibbles(nibble_bytes);
        }
    }
    if (fifth_bits) {
        const __m512i h = _mm512_maskz_loadu_epi8(bytes, qh);
        for (int i = 0; i < 8; i++) c[i] = _mm512_mask_add_epi8(c[i], fifth_bit_mask(h, i), c[i], _mm512_set1_epi8(16));
    }
}

/* One block of 16 (r) rows of a 32-value type against `rows` activation rows, into their accumulators (lane
 * l: row l): 8 vpdpbusd a row starting from the offset's share, one conversion and multiply-add (one more
 * for the mins). */
ALWAYS_INLINE void k16_small(int type, const uint8_t *at, int r, int64_t b, const lanes *a, int rows, __m512 *acc) {
    const int has_min = type == Q4_1 || type == Q5_1;
    __m512 d, mins;
    __m512i c[8];
    small_codes(type, at, r, &d, &mins, c);
    for (int j = 0; j < rows; j++) {
        const __m512i start = has_min ? _mm512_setzero_si512() : _mm512_set1_epi32(a[j].offset_sum[b]);
        const __m512i dots = quads_dot(c, 8, a[j].q + b * ABLOCK, start);
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_mul_ps(d, _mm512_set1_ps(a[j].d[b])), acc[j]);
        if (has_min) acc[j] = _mm512_fmadd_ps(mins, _mm512_set1_ps(a[j].block_sum[b]), acc[j]);
    }
}

/* A group of r interleaved rows against `rows` activation rows, into out[j * 16 + l] (the group's row l). */
ALWAYS_INLINE void k16_group(int type, const fused_job *job, const uint8_t *group, int r, const lanes *a, int rows,
                             float *out, int prefetch) {
    const int64_t blocks = job->k / (is_k_quant(type) ? KBLOCK : ABLOCK), block_bytes = job->row_bytes / blocks;
    __m512 acc[FUSED_ROWS];
    for (int j = 0; j < rows; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++, group += r * block_bytes) {
        if (prefetch) /* a block's worth of lines PREFETCH_BYTES on (a prefetch never faults past the end) */
            for (int64_t line = 0; line < r * block_bytes; line += 64)
                _mm_prefetch((const char *)(group + PREFETCH_BYTES + line), _MM_HINT_T1);
        if (type == Q6_K) k16_q6_k(group, r, b, a, rows, acc);
        else if (is_k_quant(type)) k16_q4_k(group, r, b, a, rows, acc, type == Q5_K);
        else k16_small(type, group, r, b, a, rows, acc);
    }
    for (int j = 0; j < rows; j++) _mm512_storeu_ps(out + 16 * j, acc[j]);
}

/* Groups [first, last) of an interleaved weight against every activation row, FUSED_ROWS at a time (a
 * last group of fewer than 16 rows one activation row at a time: its copy of k16_group is not made for
 * every count). */
ALWAYS_INLINE void k16_range(int type, const fused_job *job, int64_t first, int64_t last) {
    for (int64_t g = first; g < last; g++) {
        const int64_t row0 = g * K16_ROWS;
        const int r = k16_group_rows(job->rows, row0);
        const uint8_t *group = job->w + row0 * job->row_bytes;
        for (int64_t start = 0; start < job->m; start += FUSED_ROWS) {
            const lanes *a = job->a + start;
            const int count = job->m - start < FUSED_ROWS ? (int)(job->m - start) : FUSED_ROWS;
            float out[FUSED_ROWS * K16_ROWS];
            const int first = start == 0; /* later passes find the group in cache */
            if (r < K16_ROWS) {
                for (int j = 0; j < count; j++) k16_group(type, job, group, r, a + j, 1, out + K16_ROWS * j, first && j == 0);
            } else {
                switch (count) {
                case 1: k16_group(type, job, group, K16_ROWS, a, 1, out, first); break;
                case 2: k16_group(type, job, group, K16_ROWS, a, 2, out, first); break;
                case 3: k16_group(type, job, group, K16_ROWS, a, 3, out, first); break;
                case 4: k16_group(type, job, group, K16_ROWS, a, 4, out, first); break;
                case 5: k16_group(type, job, group, K16_ROWS, a, 5, out, first); break;
                case 6: k16_group(type, job, group, K16_ROWS, a, 6, out, first); break;
                case 7: k16_group(type, job, group, K16_ROWS, a, 7, out, first); break;
                default: k16_group(type, job, group, K16_ROWS, a, FUSED_ROWS, out, first); break;
                }
            }
            for (int j = 0; j < count; j++)
                for (int l = 0; l < r; l++) {
                    const float bias = job->bias ? load_float(job->bias, row0 + l, job->is_bf16) : 0.f;
                    store_float(job->y, (start + j) * job->ldy + row0 + l, out[K16_ROWS * j + l] + bias, job->is_bf16);
                }
        }
    }
}

/* Groups of 16 rows [first, last) of one fused_linear call, each type's kernel its own copy. */
static void fused_rows(int type, const fused_job *job, int64_t first, int64_t last) {
    switch (type) {
    case Q4_0 | X16: k16_range(Q4_0, job, first, last); break;
    case Q4_1 | X16: k16_range(Q4_1, job, first, last); break;
    case Q5_0 | X16: k16_range(Q5_0, job, first, last); break;
    case Q5_1 | X16: k16_range(Q5_1, job, first, last); break;
    case Q8_0 | X16: k16_range(Q8_0, job, first, last); break;
    case Q4_K | X16: k16_range(Q4_K, job, first, last); break;
    case Q5_K | X16: k16_range(Q5_K, job, first, last); break;
    case Q6_K | X16: k16_range(Q6_K, job, first, last); break;
    }
}

static int fused_supported(int type, int64_t k) {
    format f;
    return is_k16(type) && find_format(type, &f) == 0 && k % f.block_values == 0;
}

/* gguf_linear for fused_supported types. */
static int fused_linear(const void *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *w, int64_t row_bytes,
                        int64_t rows, int type, const void *bias, void *y, int64_t ldy, int is_bf16, int num_threads) {
    const int file_type = type & ~X16, k_quant = is_k_quant(file_type);
    const int64_t blocks = k / ABLOCK;
    /* Each activation row's scratch in one allocation: the K-quants' d per 256, pair sums and q; or the
     * 32-value types' d, per-16 sums (quantize_activation_row's), block sums, offset sums and q. */
    const size_t row_size = k_quant ? sizeof(float) * (size_t)(k / KBLOCK) + sizeof(int16_t) * (size_t)(k / GROUP) + (size_t)k
                                    : sizeof(float) * (size_t)(2 * blocks + k / GROUP) + sizeof(int32_t) * (size_t)blocks + (size_t)k;
    char *scratch = malloc(row_size * (size_t)m);
    lanes *a = malloc(sizeof(lanes) * (size_t)m);
    int status = 0;
    if (!scratch || !a) {
        status = -2;
        goto done;
    }
    const int quantize_threads = m >= 4 ? num_threads : 1;
#pragma omp parallel for num_threads(quantize_threads) schedule(static)
    for (int64_t r = 0; r < m; r++) {
        const void *x_row = (const char *)x + r * ldx * (is_bf16 ? 2 : 4);
        char *region = scratch + (size_t)r * row_size;
        if (k_quant) {
            float *d = (float *)region;
            int16_t *pair_sums = (int16_t *)(d + k / KBLOCK);
            int8_t *q = (int8_t *)(pair_sums + k / GROUP);
            quantize_k16_activation_row(x_row, is_bf16, k, file_type == Q6_K ? 16 : 32, q, d, pair_sums);
            a[r] = (lanes){q, d, NULL, NULL, pair_sums};
        } else {
            float *d = (float *)region, *group_sums = d + blocks, *block_sum = group_sums + k / GROUP;
            int32_t *offset_sum = (int32_t *)(block_sum + blocks);
            int8_t *q = (int8_t *)(offset_sum + blocks);
            quantize_activation_row(x_row, is_bf16, k, q, d, group_sums);
            activation_block_sums(q, d, k, code_offset(file_type), offset_sum, block_sum);
            a[r] = (lanes){q, d, offset_sum, block_sum, NULL};
        }
    }
    const fused_job job = {a, m, k, row_bytes, ldy, rows, w, bias, y, is_bf16};
    const int64_t units = (rows + K16_ROWS - 1) / K16_ROWS; /* groups of 16 rows: what fused_rows takes */
    const int threads = units < num_threads ? (int)units : num_threads;
#pragma omp parallel num_threads(threads)
    {
        const int64_t share = (units + omp_get_num_threads() - 1) / omp_get_num_threads();
        const int64_t first = share * omp_get_thread_num(), last = first + share < units ? first + share : units;
        if (first < last) fused_rows(type, &job, first, last);
    }
done:
    free(scratch);
    free(a);
    return status;
}

/* ---- AMX tiles: 16 x 16 outputs an instruction ---------------------------------------------------
 *
 * Where the CPU has AMX (Sapphire Rapids on), a batch of activation rows runs on its bfloat16 tiles: each
 * group of 16 interleaved weight rows is dequantized once, in registers from the same code vectors the
 * integer kernels make, to bfloat16 in the tiles' pair layout (a tile row holds, per weight row l, the pair
 * of values 2j, 2j + 1 of a 32-value slice at lane l), into a per-thread buffer that stays in L2; then
 * every 16 activation rows (bfloat16, zero-padded) meet it 32 values at a time in one tdpbf16ps, which
 * sums in float32. Nothing of the weight outlives its group. Every output's sum runs in the same order
 * whatever the batch, so a row's result does not depend on the rows beside it (as the integer kernels'). */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define AMX_KERNELS 1
#include <sys/syscall.h>
#include <unistd.h>

#define TILE_VALUES 32 /* bfloat16 values of a row per tile: 64 bytes */
#define TILE_PAIR_ROWS 16 /* a weight tile's rows: one per pair of the 32 values */
#define TILE_BATCH 4 /* activation tiles (16 rows each) that share each weight tile */
#define TILE_CHUNK_BYTES (1024 * 1024) /* dequantized weight a thread holds at once (tile_groups) */

/* Linux hands a process AMX's tile state only once asked (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA). */
static int amx_permitted(void) {
    static int permitted = -1;
    if (permitted < 0) permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return permitted;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} tile_config;

/* Every tile 16 rows of 64 bytes; per thread (tile configuration is thread state). */
static void configure_tiles(void) {
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) config.rows[t] = 16, config.bytes_per_row[t] = 64;
    _tile_loadconfig(&config);
}

/* A lane's scale as the 4 bytes of a quad see it: byte j masked in place is its code * 256^j, so it is
 * multiplied by scale / 256^j (exact: powers of two). */
typedef struct {
    __m512 byte[4];
} byte_scales;

ALWAYS_INLINE byte_scales scales_per_byte(__m512 scale) {
    byte_scales s;
    for (int j = 0; j < 4; j++) s.byte[j] = _mm512_mul_ps(scale, _mm512_set1_ps(1.f / (float)(1u << (8 * j))));
    return s;
}

/* Values of quad vector c (lane l: row l's 4 codes) as scale * code - min, bfloat16, into the two pair rows
 * at out (64 values: row 0 lane l holds values 0 and 1 of the quad, row 1 values 2 and 3). */
ALWAYS_INLINE void quad_to_pairs(__m512i c, const byte_scales *scale, __m512 min, uint16_t *out) {
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                                21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512 values[4];
    for (int j = 0; j < 4; j++) {
        const __m512i in_place = _mm512_and_si512(c, _mm512_set1_epi32((int)(0xffu << (8 * j))));
        values[j] = _mm512_fmsub_ps(_mm512_cvtepu32_ps(in_place), scale->byte[j], min);
    }
    for (int pair = 0; pair < 2; pair++) {
        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(values[2 * pair + 1], values[2 * pair]); /* first's 16, then second's */
        _mm512_storeu_si512(out + 32 * pair, _mm512_permutexvar_epi16(interleave, both));
    }
}

/* Block b of a group of r rows as pair rows: value v of the block lands in pair row (KBLOCK b + v) / 2. */
ALWAYS_INLINE void block_to_pairs(int type, const uint8_t *at, int r, uint16_t *pairs) {
    if (type == Q6_K) {
        const q6_k_block k = q6_k_open(at, r);
        for (int half = 0; half < 2; half++)
            for (int part = 0; part < 2; part++) {
                __m512i c[4][4];
                q6_k_codes(&k, half, part, c);
                for (int p = 0; p < 4; p++) {
                    const int s = 8 * half + 2 * p + part;
                    const __m512 scale = _mm512_mul_ps(k.d, _mm512_cvtepi32_ps(lane_byte(k.scales[s / 4], s % 4, 1)));
                    const __m512 min = _mm512_mul_ps(scale, _mm512_set1_ps(32.f));
                    const byte_scales bytes = scales_per_byte(scale);
                    for (int i = 0; i < 4; i++) quad_to_pairs(c[p][i], &bytes, min, pairs + 32 * (128 * half + 32 * p + 16 * part + 4 * i) / 2);
                }
            }
    } else if (is_k_quant(type)) {
        const int fifth_bits = type == Q5_K;
        const q4_k_block k = q4_k_open(at, r, fifth_bits);
        for (int s = 0; s < 8; s++) {
            __m512i c[8];
            q4_k_codes(&k, s, fifth_bits, c);
            const __m512 scale = _mm512_mul_ps(k.d, _mm512_cvtepi32_ps(lane_byte(k.scales[s / 4], s % 4, 0)));
            const __m512 min = _mm512_mul_ps(k.dmin, _mm512_cvtepi32_ps(lane_byte(k.mins[s / 4], s % 4, 0)));
            const byte_scales bytes = scales_per_byte(scale);
            for (int i = 0; i < 8; i++) quad_to_pairs(c[i], &bytes, min, pairs + 32 * (32 * s + 4 * i) / 2);
        }
    } else {
        __m512 d, mins;
        __m512i c[8];
        small_codes(type, at, r, &d, &mins, c);
        const __m512 min = _mm512_fmsub_ps(d, _mm512_set1_ps((float)code_offset(type)), mins); /* d offset - min */
        const byte_scales bytes = scales_per_byte(d);
        for (int i = 0; i < 8; i++) quad_to_pairs(c[i], &bytes, min, pairs + 32 * (4 * i) / 2);
    }
}

/* A group of r interleaved rows, every block, as pair rows (k / 2 of them, 64 bytes each). */
ALWAYS_INLINE void group_to_pairs(int type, const uint8_t *group, int r, int64_t k, int64_t row_bytes, uint16_t *pairs) {
    const int64_t values = is_k_quant(type) ? KBLOCK : ABLOCK, blocks = k / values, block_bytes = row_bytes / blocks;
    for (int64_t b = 0; b < blocks; b++) block_to_pairs(type, group + b * r * block_bytes, r, pairs + 16 * values * b);
}

/* Groups dequantized together: their pair rows (32 bytes per input value a group) fill up to
 * TILE_CHUNK_BYTES, half of a Sapphire Rapids core's L2. */
static int64_t tile_groups(int64_t k) { return k >= TILE_CHUNK_BYTES / 32 ? 1 : TILE_CHUNK_BYTES / (32 * k); }

/* What every thread of one tile_linear call shares. */
typedef struct {
    const uint16_t *x; /* bfloat16 activations, m_tiles x 16 rows of k, zero past m */
    int64_t m, m_tiles, k, row_bytes, rows, ldy;
    const uint8_t *w;
    const void *bias;
    void *y;
    int is_bf16;
} tile_job;

/* Activation tiles [first, first + count) (count <= TILE_BATCH) against one group's pair rows, into y. */
static void tile_products(const tile_job *job, const uint16_t *pairs, int64_t row0, int r, int64_t first, int count) {
    const int64_t stride = 2 * job->k;
    const uint16_t *x = job->x + first * 16 * job->k;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t v = 0; v < job->k; v += TILE_VALUES) {
        _tile_loadd(4, pairs + 16 * v, 64);
        _tile_loadd(5, x + v, stride);
        _tile_dpbf16ps(0, 5, 4);
        if (count > 1) {
            _tile_loadd(6, x + 16 * job->k + v, stride);
            _tile_dpbf16ps(1, 6, 4);
        }
        if (count > 2) {
            _tile_loadd(7, x + 32 * job->k + v, stride);
            _tile_dpbf16ps(2, 7, 4);
        }
        if (count > 3) {
            _tile_loadd(5, x + 48 * job->k + v, stride);
            _tile_dpbf16ps(3, 5, 4);
        }
    }
    float out[TILE_BATCH][16 * 16];
    _tile_stored(0, out[0], 64);
    if (count > 1) _tile_stored(1, out[1], 64);
    if (count > 2) _tile_stored(2, out[2], 64);
    if (count > 3) _tile_stored(3, out[3], 64);
    const __mmask16 columns = (__mmask16)((1u << r) - 1); /* the group's rows: an output row's r columns */
    __m512 bias = _mm512_setzero_ps();
    if (job->bias && job->is_bf16) {
        const __m256i halves = _mm256_maskz_loadu_epi16(columns, (const uint16_t *)job->bias + row0);
        bias = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16)); /* bfloat16 -> float32 */
    } else if (job->bias) {
        bias = _mm512_maskz_loadu_ps(columns, (const float *)job->bias + row0);
    }
    for (int t = 0; t < count; t++)
        for (int i = 0; i < 16 && (first + t) * 16 + i < job->m; i++) {
            const int64_t at = ((first + t) * 16 + i) * job->ldy + row0;
            const __m512 sums = _mm512_add_ps(_mm512_loadu_ps(out[t] + 16 * i), bias);
            if (job->is_bf16) _mm256_mask_storeu_epi16((uint16_t *)job->y + at, columns, (__m256i)_mm512_cvtneps_pbh(sums));
            else _mm512_mask_storeu_ps((float *)job->y + at, columns, sums);
        }
}

/* A group of r interleaved rows, dequantized to pair rows (each type's dequantization its own copy). */
static void group_pairs(int type, const tile_job *job, int64_t row0, int r, uint16_t *pairs) {
    const uint8_t *group = job->w + row0 * job->row_bytes;
    switch (type) {
    case Q4_0: group_to_pairs(Q4_0, group, r, job->k, job->row_bytes, pairs); break;
    case Q4_1: group_to_pairs(Q4_1, group, r, job->k, job->row_bytes, pairs); break;
    case Q5_0: group_to_pairs(Q5_0, group, r, job->k, job->row_bytes, pairs); break;
    case Q5_1: group_to_pairs(Q5_1, group, r, job->k, job->row_bytes, pairs); break;
    case Q8_0: group_to_pairs(Q8_0, group, r, job->k, job->row_bytes, pairs); break;
    case Q4_K: group_to_pairs(Q4_K, group, r, job->k, job->row_bytes, pairs); break;
    case Q5_K: group_to_pairs(Q5_K, group, r, job->k, job->row_bytes, pairs); break;
    case Q6_K: group_to_pairs(Q6_K, group, r, job->k, job->row_bytes, pairs); break;
    }
}

/* Groups [first, last) of one tile_linear call, tile_groups(k) at a time: a chunk of groups is dequantized
 * once, then every batch of activation tiles meets each of its groups while the batch is still in cache
 * (one group at a time made every group reread all the activations). */
static void tile_rows(int type, const tile_job *job, int64_t first, int64_t last, uint16_t *pairs) {
    const int64_t chunk = tile_groups(job->k), group_pairs_size = 16 * job->k;
    for (int64_t g0 = first; g0 < last; g0 += chunk) {
        const int64_t g1 = g0 + chunk < last ? g0 + chunk : last;
        for (int64_t g = g0; g < g1; g++)
            group_pairs(type, job, g * K16_ROWS, k16_group_rows(job->rows, g * K16_ROWS), pairs + (g - g0) * group_pairs_size);
        for (int64_t t = 0; t < job->m_tiles; t += TILE_BATCH) {
            const int count = job->m_tiles - t < TILE_BATCH ? (int)(job->m_tiles - t) : TILE_BATCH;
            for (int64_t g = g0; g < g1; g++)
                tile_products(job, pairs + (g - g0) * group_pairs_size, g * K16_ROWS, k16_group_rows(job->rows, g * K16_ROWS), t, count);
        }
    }
}

static int tile_supported(int type, int64_t k) { return fused_supported(type, k) && k % TILE_VALUES == 0 && amx_permitted(); }

/* gguf_tile_linear for tile_supported types. */
static int tile_linear(const void *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *w, int64_t row_bytes,
                       int64_t rows, int type, const void *bias, void *y, int64_t ldy, int is_bf16, int num_threads) {
    const int64_t m_tiles = (m + 15) / 16;
    uint16_t *activations = aligned_alloc(64, sizeof(uint16_t) * (size_t)(m_tiles * 16 * k));
    if (!activations) return -2;
    const int convert_threads = m >= 4 ? num_threads : 1;
#pragma omp parallel for num_threads(convert_threads) schedule(static)
    for (int64_t row = 0; row < m_tiles * 16; row++) {
        uint16_t *to = activations + row * k;
        if (row >= m) memset(to, 0, sizeof(uint16_t) * (size_t)k);
        else if (is_bf16) memcpy(to, (const uint16_t *)x + row * ldx, sizeof(uint16_t) * (size_t)k);
        else
            for (int64_t v = 0; v < k; v += 16)
                _mm256_storeu_si256((__m256i *)(to + v), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps((const float *)x + row * ldx + v)));
    }
    const tile_job job = {activations, m, m_tiles, k, row_bytes, rows, ldy, w, bias, y, is_bf16};
    const int64_t units = (rows + K16_ROWS - 1) / K16_ROWS;
    const int threads = units < num_threads ? (int)units : num_threads;
    int status = 0;
#pragma omp parallel num_threads(threads)
    {
        uint16_t *pairs = aligned_alloc(64, sizeof(uint16_t) * (size_t)(16 * k * tile_groups(k)));
        if (!pairs) {
#pragma omp atomic write
            status = -2;
        } else {
            configure_tiles();
            const int64_t share = (units + omp_get_num_threads() - 1) / omp_get_num_threads();
            const int64_t first = share * omp_get_thread_num(), last = first + share < units ? first + share : units;
            if (first < last) tile_rows(type & ~X16, &job, first, last, pairs);
            _tile_release();
        }
        free(pairs);
    }
    free(activations);
    return status;
}
#endif
#else
static int fused_supported(int type, int64_t k) {
    (void)type, (void)k;
    return 0;
}
static int fused_linear(const void *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *w, int64_t row_bytes,
                        int64_t rows, int type, const void *bias, void *y, int64_t ldy, int is_bf16, int num_threads) {
    (void)x, (void)ldx, (void)m, (void)k, (void)w, (void)row_bytes, (void)rows, (void)type, (void)bias, (void)y;
    (void)ldy, (void)is_bf16, (void)num_threads;
    return -1;
}
#endif

#ifndef AMX_KERNELS /* no AMX, or no fused kernels: gguf_tiles says no */
static int tile_supported(int type, int64_t k) {
    (void)type, (void)k;
    return 0;
}
static int tile_linear(const void *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *w, int64_t row_bytes,
                       int64_t rows, int type, const void *bias, void *y, int64_t ldy, int is_bf16, int num_threads) {
    (void)x, (void)ldx, (void)m, (void)k, (void)w, (void)row_bytes, (void)rows, (void)type, (void)bias, (void)y;
    (void)ldy, (void)is_bf16, (void)num_threads;
    return -1;
}
#endif

/* ---- entry points ---------------------------------------------------------------------------- */

int gguf_supported(int type) {
    format f;
    return find_format(type, &f) == 0;
}

/* 1 when gguf_linear makes the type's codes in registers for rows of k values (the fused path). */
int gguf_fused(int type, int64_t k) { return fused_supported(type, k); }

/* 1 when gguf_tile_linear runs this (interleaved) type on AMX tiles for rows of k values. */
int gguf_tiles(int type, int64_t k) { return tile_supported(type, k); }

/* gguf_linear on AMX's bfloat16 tiles (the weight dequantized a group of 16 rows at a time, in registers);
 * -1 where gguf_tiles says no. */
int gguf_tile_linear(const void *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *w, int64_t row_bytes, int64_t rows,
                     int type, const void *bias, void *y, int64_t ldy, int is_bf16, int num_threads) {
    if (!tile_supported(type, k)) return -1;
    return tile_linear(x, ldx, m, k, w, row_bytes, rows, type, bias, y, ldy, is_bf16, num_threads);
}

/* 1 when a type has a fused kernel once interleaved (gguf_to_x16). */
int gguf_x16(int type) { return fused_supported(type | X16, KBLOCK); }

/* A weight's rows (rows x blocks blocks) interleaved 16 to a group (to_k16), or back; out may be w. */
static int k16_rows(const k16_fields *f, int block_bytes, const uint8_t *w, uint8_t *out, int64_t rows, int64_t blocks,
                    int to_k16) {
    const int64_t row_bytes = blocks * block_bytes;
    int status = 0;
#pragma omp parallel
    {
        uint8_t *copy = malloc((size_t)(K16_ROWS * row_bytes)); /* the group's rows, so that out may be w */
#pragma omp for schedule(static)
        for (int64_t first = 0; first < rows; first += K16_ROWS) {
            if (!copy) {
#pragma omp atomic write
                status = -2;
                continue;
            }
            const int r = k16_group_rows(rows, first);
            uint8_t *group = out + first * row_bytes;
            memcpy(copy, w + first * row_bytes, (size_t)(r * row_bytes));
            for (int64_t b = 0; b < blocks; b++)
                for (int lane = 0; lane < r; lane++) {
                    uint8_t *interleaved = (to_k16 ? group : copy) + b * r * block_bytes;
                    uint8_t *file = (to_k16 ? copy : group) + lane * row_bytes + b * block_bytes;
                    k16_block(f, interleaved, r, lane, file, to_k16);
                }
        }
        free(copy);
    }
    return status;
}

/* out = w (rows x row_bytes) interleaved for the fused kernels, rows 16 to a group; or (to_x16 = 0) back to
 * the file's order. The same size; out may be w. Returns 0, -1 for another type or k, -2 out of memory. */
int gguf_to_x16(int type, const uint8_t *w, uint8_t *out, int64_t rows, int64_t k, int to_x16) {
    k16_fields fields;
    format f;
    if (k16_layout(type, &fields) || find_format(type, &f) || k % f.block_values) return -1;
    return k16_rows(&fields, f.block_bytes, w, out, rows, k / f.block_values, to_x16);
}

/* y[m, n] (row stride ldy, float32 or bfloat16 like x) = x[m, :k] . W[n, :k] (+ bias[n]) for n < rows.
 * w: rows x row_bytes of type `type`; k a multiple of the type's block (and of 64). Returns 0, -1 for
 * an unknown type or k, -2 when out of memory. */
int gguf_linear(const void *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *w, int64_t row_bytes, int64_t rows,
                int type, const void *bias, void *y, int64_t ldy, int is_bf16, int num_threads) {
    format f;
    if (find_format(type, &f) || k % f.block_values || k % ABLOCK) return -1;
    if (fused_supported(type, k)) return fused_linear(x, ldx, m, k, w, row_bytes, rows, type, bias, y, ldy, is_bf16, num_threads);
    const int64_t groups = k / GROUP, blocks = k / ABLOCK;
    int8_t *q = malloc((size_t)(m * k));
    float *d = malloc(sizeof(float) * (size_t)(m * blocks)), *gsum = malloc(sizeof(float) * (size_t)(m * groups));
    int status = 0;
    if (!q || !d || !gsum) {
        status = -2;
        goto done;
    }
    const int quantize_threads = m >= 4 ? num_threads : 1;
#pragma omp parallel for num_threads(quantize_threads) schedule(static)
    for (int64_t r = 0; r < m; r++)
        quantize_activation_row((const char *)x + r * ldx * (is_bf16 ? 2 : 4), is_bf16, k, q + r * k, d + r * blocks,
                                gsum + r * groups);
    const int64_t tiles = (rows + TILE - 1) / TILE;
    const int threads = tiles < num_threads ? (int)tiles : num_threads;
#pragma omp parallel num_threads(threads)
    {
        uint8_t *codes = malloc((size_t)(TILE * k));
        float *scale = malloc(sizeof(float) * (size_t)(TILE * groups));
        float *min = malloc(sizeof(float) * (size_t)(TILE * groups));
        if (!codes || !scale || !min) {
#pragma omp atomic write
            status = -2;
        } else {
#pragma omp for schedule(static)
            for (int64_t tile = 0; tile < tiles; tile++) {
                const int64_t first = tile * TILE, count = rows - first < TILE ? rows - first : TILE;
                for (int64_t t = 0; t < count; t++)
                    decode_weight_row(&f, w, row_bytes, rows, first + t, k, codes + t * k, scale + t * groups, min + t * groups);
                int64_t r = 0;
                for (; ROW_BLOCK > 1 && r + ROW_BLOCK <= m; r += ROW_BLOCK) {
                    for (int64_t t = 0; t < count; t++) {
                        float dots[ROW_BLOCK];
                        codes_dot_rows(codes + t * k, scale + t * groups, q + r * k, d + r * blocks, k, dots);
                        for (int j = 0; j < ROW_BLOCK; j++) {
                            float value = dots[j] - min_dot(min + t * groups, gsum + (r + j) * groups, groups);
                            if (bias) value += load_float(bias, first + t, is_bf16);
                            store_float(y, (r + j) * ldy + first + t, value, is_bf16);
                        }
                    }
                }
                for (; r < m; r++) {
                    for (int64_t t = 0; t < count; t++) {
                        float value = codes_dot(codes + t * k, scale + t * groups, q + r * k, d + r * blocks, k) -
                                      min_dot(min + t * groups, gsum + r * groups, groups);
                        if (bias) value += load_float(bias, first + t, is_bf16);
                        store_float(y, r * ldy + first + t, value, is_bf16);
                    }
                }
            }
        }
        free(codes);
        free(scale);
        free(min);
    }
done:
    free(q);
    free(d);
    free(gsum);
    return status;
}

/* A decoded row's values, scale * code - min, as float32 or bfloat16. scale * code is exact in float32
 * for every format (an f16 scale times a code of at most 8 bits), so the fused multiply-subtract of the
 * vector loop gives the gguf package's values bit for bit. */
static inline void store_values(const uint8_t *codes, const float *scale, const float *min, int64_t k, void *out,
                                int is_bf16) {
    int64_t g = 0;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    for (; g < k / GROUP; g++) {
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(codes + g * GROUP));
        const __m512 c = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
        const __m512 v = _mm512_fmsub_ps(_mm512_set1_ps(scale[g]), c, _mm512_set1_ps(min[g]));
        if (is_bf16) _mm256_storeu_si256((__m256i *)((uint16_t *)out + g * GROUP), (__m256i)_mm512_cvtneps_pbh(v));
        else _mm512_storeu_ps((float *)out + g * GROUP, v);
    }
#endif
    for (int64_t j = g * GROUP; j < k; j++)
        store_float(out, j, scale[j / GROUP] * (float)codes[j] - min[j / GROUP], is_bf16);
}

/* out[i, :k] = row ids[i] of w (rows x row_bytes) dequantized (float32 or bfloat16): the embedding
 * table's gather. Returns 0, -1 for an unknown type or k, -2 out of memory, -3 for an id past the rows. */
int gguf_dequantize_rows(const uint8_t *w, int64_t row_bytes, int64_t rows, int type, const int64_t *ids,
                         int64_t count, int64_t k, void *out, int is_bf16, int num_threads) {
    format f;
    if (find_format(type, &f) || k % f.block_values) return -1;
    for (int64_t i = 0; i < count; i++)
        if (ids[i] < 0 || ids[i] >= rows) return -3;
    const int64_t groups = k / GROUP;
    const int threads = count >= 8 ? num_threads : 1;
    int status = 0;
#pragma omp parallel num_threads(threads)
    {
        uint8_t *codes = malloc((size_t)k);
        float *scale = malloc(sizeof(float) * (size_t)groups), *min = malloc(sizeof(float) * (size_t)groups);
        if (!codes || !scale || !min) {
#pragma omp atomic write
            status = -2;
        } else {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < count; i++) {
                decode_weight_row(&f, w, row_bytes, rows, ids[i], k, codes, scale, min);
                store_values(codes, scale, min, k, (char *)out + i * k * (is_bf16 ? 2 : 4), is_bf16);
            }
        }
        free(codes);
        free(scale);
        free(min);
    }
    return status;
}
