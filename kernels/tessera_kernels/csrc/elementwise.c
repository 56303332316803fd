/* The elementwise steps between the GEMMs, each one pass over its rows: residual add + RMSNorm,
 * SiLU-and-multiply, rotary embedding and the K/V store into the paged caches. Meaning: kernels/tessera_kernels/torch_ref.py functions of the same
 * names. In torch each is a chain of operators (casts to float32, pow, mean, rsqrt, mul, cast
 * back) with a temporary tensor per step; in a prefill step of 2048 tokens those chains took a
 * third of the forward. bfloat16 results are rounded where the reference rounds,
 * so only the float32 summation order differs.
 *
 * Rows are shared among torch's OpenMP threads (see decode_attention.c); small batches stay on one.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "vec.h"

#define MIN_ROWS_PER_THREAD 8

static inline float rounded(float x, int is_bf16) { return is_bf16 ? round_bf16(x) : x; }

static inline int threads_for(int64_t rows, int num_threads) {
    const int64_t useful = rows / MIN_ROWS_PER_THREAD;
    return useful < 1 ? 1 : (useful < num_threads ? (int)useful : num_threads);
}

/* Each kernel's body is compiled twice, for float32 and for bfloat16 (is_bf16 a constant), so its
 * loops vectorise; with the dtype tested per element gcc left them scalar. */
#define INLINE static inline __attribute__((always_inline))
#define DISPATCH(body, ...) do { if (is_bf16) body(__VA_ARGS__, 1); else body(__VA_ARGS__, 0); } while (0)

/* Whole vectors first (vec.h's bfloat16 conversions), then the tail one value at a time. */
INLINE void add_rms_norm_row(const void *x, const void *residual, void *new_residual, const void *weight, void *out,
                             int64_t base, int hidden, float eps, const int is_bf16) {
    const void *summed = residual ? new_residual : x;
    const int whole = hidden / LANES * LANES;
    vec square_lanes = splat(0.f);
    for (int i = 0; i < whole; i += LANES) {
        vec v = load_vec(x, base + i, is_bf16);
        if (residual) {
            v += load_vec(residual, base + i, is_bf16);
            if (is_bf16) v = round_bf16_vec(v);
            store_vec(new_residual, base + i, v, is_bf16);
        }
        square_lanes += v * v;
    }
    float squares = 0.f;
    for (int k = 0; k < LANES; k++) squares += square_lanes[k];
    for (int i = whole; i < hidden; i++) {
        float v = load_float(x, base + i, is_bf16);
        if (residual) {
            v = rounded(v + load_float(residual, base + i, is_bf16), is_bf16);
            store_float(new_residual, base + i, v, is_bf16);
        }
        squares += v * v;
    }
    const float inv = 1.f / sqrtf(squares / hidden + eps);
    for (int i = 0; i < whole; i += LANES) {
        vec normed = load_vec(summed, base + i, is_bf16) * inv;
        if (is_bf16) normed = round_bf16_vec(normed);
        store_vec(out, base + i, load_vec(weight, i, is_bf16) * normed, is_bf16);
    }
    for (int i = whole; i < hidden; i++) {
        const float normed = rounded(load_float(summed, base + i, is_bf16) * inv, is_bf16);
        store_float(out, base + i, load_float(weight, i, is_bf16) * normed, is_bf16);
    }
}

INLINE void add_rms_norm_rows(const void *x, const void *residual, void *new_residual, const void *weight, void *out,
                              int64_t rows, int hidden, float eps, int num_threads, const int is_bf16) {
#pragma omp parallel for num_threads(threads_for(rows, num_threads)) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        add_rms_norm_row(x, residual, new_residual, weight, out, r * hidden, hidden, eps, is_bf16);
}

/* new_residual = x + residual; out = weight * rms_norm(new_residual). With residual NULL the sum is
 * x itself and new_residual is not written. x, residual, new_residual, out: [rows, hidden]
 * contiguous; weight [hidden]. */
void fused_add_rms_norm(const void *x, const void *residual, void *new_residual, const void *weight, void *out,
                        int64_t rows, int hidden, float eps, int is_bf16, int num_threads) {
    DISPATCH(add_rms_norm_rows, x, residual, new_residual, weight, out, rows, hidden, eps, num_threads);
}

INLINE float silu_times(float gate, float up, const int is_bf16) { /* the reference's roundings */
    return rounded(gate / (1.f + expf(-gate)), is_bf16) * up;
}

INLINE void silu_and_mul_rows(const void *x, void *out, int64_t rows, int inter, int num_threads, const int is_bf16) {
#pragma omp parallel for num_threads(threads_for(rows, num_threads)) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t in = r * 2 * inter, at = r * inter;
        int i = 0;
        for (; i + LANES <= inter; i += LANES) {
            const vec gate = load_vec(x, in + i, is_bf16), up = load_vec(x, in + inter + i, is_bf16);
            vec silu = gate * reciprocal(1.f + exp_vec(-gate));
            if (is_bf16) silu = round_bf16_vec(silu);
            store_vec(out, at + i, silu * up, is_bf16);
        }
        for (; i < inter; i++)
            store_float(out, at + i, silu_times(load_float(x, in + i, is_bf16), load_float(x, in + inter + i, is_bf16), is_bf16), is_bf16);
    }
}

/* out[r] = silu(x[r, :inter]) * x[r, inter:]; x [rows, 2 * inter], out [rows, inter], contiguous. */
void silu_and_mul(const void *x, void *out, int64_t rows, int inter, int is_bf16, int num_threads) {
    DISPATCH(silu_and_mul_rows, x, out, rows, inter, num_threads);
}

/* Neox rotary in place on heads of `head_dim` values: x is [rows, heads, head_dim] with rows
 * `row_stride` elements apart (q and k are views into the fused QKV output). cos_sin: float32
 * [max_position, head_dim], cos then sin. Whole vectors, then the tail: left to gcc, the loop rounded a
 * row differently by where it sat in the batch, and speculative verification needs each row's bits to
 * be a one-row step's. */
INLINE void rotate(void *x, int64_t row_stride, int heads, const int64_t *positions, const float *cos_sin,
                   int64_t rows, int head_dim, int num_threads, const int is_bf16) {
    const int half = head_dim / 2;
#pragma omp parallel for num_threads(threads_for(rows, num_threads)) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *cos = cos_sin + positions[r] * head_dim, *sin = cos + half;
        for (int h = 0; h < heads; h++) {
            const int64_t base = r * row_stride + (int64_t)h * head_dim;
            int i = 0;
            for (; i + LANES <= half; i += LANES) {
                const vec x1 = load_vec(x, base + i, is_bf16), x2 = load_vec(x, base + half + i, is_bf16);
                const vec c = load_vec(cos, i, 0), s = load_vec(sin, i, 0);
                store_vec(x, base + i, x1 * c - x2 * s, is_bf16);
                store_vec(x, base + half + i, x2 * c + x1 * s, is_bf16);
            }
            for (; i < half; i++) {
                const float x1 = load_float(x, base + i, is_bf16), x2 = load_float(x, base + half + i, is_bf16);
                store_float(x, base + i, x1 * cos[i] - x2 * sin[i], is_bf16);
                store_float(x, base + half + i, x2 * cos[i] + x1 * sin[i], is_bf16);
            }
        }
    }
}

void rotary_embedding(const int64_t *positions, void *q, int64_t q_row_stride, int q_heads, void *k,
                      int64_t k_row_stride, int k_heads, const float *cos_sin, int64_t rows, int head_dim,
                      int is_bf16, int num_threads) {
    DISPATCH(rotate, q, q_row_stride, q_heads, positions, cos_sin, rows, head_dim, num_threads);
    DISPATCH(rotate, k, k_row_stride, k_heads, positions, cos_sin, rows, head_dim, num_threads);
}

/* Row t of k and of v (row_bytes each; rows k_stride / v_stride bytes apart: views into the QKV
 * output) to slot slot_mapping[t] of the caches; -1 skips (torch's index_copy_ cost a noticeable
 * share of a prefill step's attention: docs/kernels.md). Returns the first row
 * whose slot is past num_slots (nothing is written then), else -1. */
int64_t store_kv_cache(const char *k, int64_t k_stride, const char *v, int64_t v_stride, char *k_cache, char *v_cache,
                       const int64_t *slot_mapping, int64_t rows, int64_t row_bytes, int64_t num_slots) {
    for (int64_t t = 0; t < rows; t++)
        if (slot_mapping[t] >= num_slots) return t;
    for (int64_t t = 0; t < rows; t++) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        memcpy(k_cache + slot * row_bytes, k + t * k_stride, row_bytes);
        memcpy(v_cache + slot * row_bytes, v + t * v_stride, row_bytes);
    }
    return -1;
}
