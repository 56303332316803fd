/* Paged prefill attention for the CPU: a ragged batch of new tokens, each attending causally to its
 * sequence's cached prefix and to the new tokens up to itself. Meaning: kernels/tessera_kernels/torch_ref.py
 * paged_prefill_attention. It replaces torch's SDPA, one call per sequence on K/V gathered out of
 * the blocks, which was a large share of a long prefill step (docs/kernels.md).
 *
 * Layouts: q [T, Hq, D] with tokens q_stride elements apart (a view into the fused QKV output);
 * out [T, Hq, D] contiguous; caches [num_blocks, block_size, Hkv, D]; block_tables int32
 * [S, table_width]; query_start_loc int32 [S + 1]; seq_lens int32 [S] (context after this step).
 *
 * Flash attention, tiled for the CPU's vector registers:
 * - A work item (Tile) is up to TILE_TOKENS query tokens of one sequence and one KV head, with all
 *   the query heads of that KV head's group: TILE_TOKENS * G rows of one query each.
 * - Keys go CHUNK at a time (CHUNK / 16 vectors of scores). Each chunk of K is transposed once
 *   ([D][CHUNK]) and V laid out once, then used by every row of the tile.
 * - Rows go ROWS at a time, so the dot products are ROWS independent FMA chains, and each V vector
 *   loaded feeds ROWS accumulators. A row block reads only the key vectors one of its rows sees.
 * - Online softmax per row (running max and sum); the output is divided by the sum at the end.
 * - Tiles are started heaviest first and shared out dynamically over torch's OpenMP threads.
 * float32 inputs are computed in float32. bfloat16 ones, on CPUs with AVX512-BF16, multiply
 * bfloat16 pairs into float32 sums with vdpbf16ps (Q.K over pairs of head dimensions, P.V over
 * pairs of keys, P rounded to bfloat16 as torch's own flash attention does): half the
 * instructions of widening to float32. Elsewhere bfloat16 is widened. The output is rounded once.
 * The vectors are vec.h's generic ones, so the same source builds for any target.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "vec.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#define BF16_PAIRS 1
#else
#define BF16_PAIRS 0
#endif

#define CHUNK 64       /* keys per step of the online softmax: CHUNK / LANES vectors of scores */
#define ROWS 4         /* query rows computed together */
#define TILE_TOKENS 32 /* query tokens per work item */
#define MASKED -1e30f  /* a masked score; finite, as the library is built with -ffast-math */

typedef struct {
    const void *q, *k_cache, *v_cache;
    const int32_t *block_tables, *query_start_loc, *seq_lens;
    void *out;
    int64_t q_stride, table_width;
    int num_heads, num_kv_heads, head_dim, block_size, is_bf16;
    float scale;
} Prefill;

typedef struct {
    int seq, kv_head, first, count; /* query tokens [first, first + count) of the sequence's new ones */
    int64_t cost;                   /* about the work it holds: the heavier tiles are started first */
} Tile;

typedef struct { /* per-thread scratch, 64-byte aligned rows */
    float *q, *o, *max, *sum, *kt, *v, *p;
} Scratch;

static inline int query_len(const Prefill *job, int seq) {
    return job->query_start_loc[seq + 1] - job->query_start_loc[seq];
}

static inline int context_before(const Prefill *job, int seq) { /* cached positions before the new tokens */
    return job->seq_lens[seq] - query_len(job, seq);
}

/* K of keys [t0, t0 + n) of KV head g transposed into kt [D][CHUNK], V into v [CHUNK][D], both
 * float32; keys past n up to the next whole vector are zero (masked scores, zero weights). */
static inline __attribute__((always_inline)) void load_chunk(const Prefill *job, const int32_t *table, int t0, int n,
                                                             int g, float *kt, float *v, const int is_bf16,
                                                             const int d) {
    const int bs = job->block_size, padded = (n + LANES - 1) / LANES * LANES;
    const int64_t width = (int64_t)job->num_kv_heads * d;
    for (int k = 0; k < padded; k++) {
        if (k >= n) {
            for (int i = 0; i < d; i++) kt[i * CHUNK + k] = 0.f;
            memset(v + k * d, 0, sizeof(float) * d);
            continue;
        }
        const int t = t0 + k;
        const int64_t row = ((int64_t)table[t / bs] * bs + t % bs) * width + (int64_t)g * d;
        for (int i = 0; i < d; i++) kt[i * CHUNK + k] = load_float(job->k_cache, row + i, is_bf16);
        for (int i = 0; i < d; i++) v[k * d + i] = load_float(job->v_cache, row + i, is_bf16);
    }
}

/* load_chunk for bfloat16 pairs: kt as [D / 2][CHUNK] pairs (dimensions 2i, 2i + 1 of one key), v as
 * [CHUNK / 2][D] pairs (one dimension of keys 2m, 2m + 1), both raw bfloat16, zero past n. */
static inline __attribute__((always_inline)) void load_chunk_pairs(const Prefill *job, const int32_t *table, int t0,
                                                                   int n, int g, uint32_t *kt, uint16_t *v,
                                                                   const int d) {
    const int bs = job->block_size, padded = (n + LANES - 1) / LANES * LANES;
    const int64_t width = (int64_t)job->num_kv_heads * d;
    for (int k = 0; k < padded; k++) {
        uint16_t *v_pairs = v + (int64_t)(k / 2) * d * 2 + (k & 1);
        if (k >= n) {
            for (int i = 0; i < d / 2; i++) kt[i * CHUNK + k] = 0;
            for (int i = 0; i < d; i++) v_pairs[2 * i] = 0;
            continue;
        }
        const int t = t0 + k;
        const int64_t row = ((int64_t)table[t / bs] * bs + t % bs) * width + (int64_t)g * d;
        const uint16_t *k_row = (const uint16_t *)job->k_cache + row, *v_row = (const uint16_t *)job->v_cache + row;
        for (int i = 0; i < d / 2; i++) kt[i * CHUNK + k] = (uint32_t)k_row[2 * i] | (uint32_t)k_row[2 * i + 1] << 16;
        for (int i = 0; i < d; i++) v_pairs[2 * i] = v_row[i];
    }
}

static inline __attribute__((always_inline)) float max_lane(vec x) {
    float top = x[0];
    for (int k = 1; k < LANES; k++) top = x[k] > top ? x[k] : top;
    return top;
}

static inline __attribute__((always_inline)) float sum_lanes(vec x) {
    float total = 0.f;
    for (int k = 0; k < LANES; k++) total += x[k];
    return total;
}

/* Rows [r0, r0 + ROWS) against keys [t0, t0 + n) of the chunk: scores, the online softmax, and
 * P.V into o. Only the vectors of keys that some row of the block sees are computed. */
static inline __attribute__((always_inline)) void row_block(const Scratch *s, int r0, int nr, const int *positions,
                                                            int t0, int n, float scale, const int pairs, const int d) {
    const int seen_by_block = min_int(n, positions[r0 + nr - 1] - t0 + 1);
    const int nv = (seen_by_block + LANES - 1) / LANES;
    vec scores[ROWS][CHUNK / LANES] = {0};
#if BF16_PAIRS
    if (pairs) { /* q rows and kt hold bfloat16 pairs */
        const uint32_t *q = (const uint32_t *)s->q, *kt = (const uint32_t *)s->kt;
        for (int i = 0; i < d / 2; i++) {
            for (int j = 0; j < CHUNK / LANES; j++) {
                if (j >= nv) break;
                const __m512bh k = (__m512bh)_mm512_load_si512(kt + i * CHUNK + j * LANES);
                for (int r = 0; r < ROWS; r++)
                    scores[r][j] = (vec)_mm512_dpbf16_ps((__m512)scores[r][j],
                                                         (__m512bh)_mm512_set1_epi32((int)q[(int64_t)(r0 + r) * d / 2 + i]), k);
            }
        }
    }
#endif
    if (!pairs) {
        for (int i = 0; i < d; i++) {
            for (int j = 0; j < CHUNK / LANES; j++) {
                if (j >= nv) break;
                const vec k = *(const vec *)(s->kt + i * CHUNK + j * LANES);
                for (int r = 0; r < ROWS; r++) scores[r][j] += s->q[(int64_t)(r0 + r) * d + i] * k;
            }
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int j = 0; j < nv; j++) scores[r][j] *= scale;
    const ivec lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    float alpha[ROWS];
    for (int r = 0; r < ROWS; r++) {
        vec *p = (vec *)(s->p + r * CHUNK);
        const int visible = r < nr ? positions[r0 + r] - t0 + 1 : 0; /* keys of this chunk the row sees */
        if (visible <= 0) { /* padding rows, and rows that end before this chunk */
            for (int j = 0; j < nv; j++) p[j] = splat(0.f);
            alpha[r] = 1.f;
            continue;
        }
        vec top = splat(MASKED);
        for (int j = 0; j < nv; j++) {
            scores[r][j] = pick(lane + j * LANES < (ivec){0} + visible, scores[r][j], splat(MASKED));
            top = pick(scores[r][j] > top, scores[r][j], top);
        }
        const float old = s->max[r0 + r], row_top = max_lane(top), new_max = old > row_top ? old : row_top;
        vec total = splat(0.f);
        for (int j = 0; j < nv; j++) {
            p[j] = pick(lane + j * LANES < (ivec){0} + visible, exp_vec(scores[r][j] - new_max), splat(0.f));
            total += p[j];
        }
        alpha[r] = old == new_max ? 1.f : expf(old - new_max);
        s->max[r0 + r] = new_max;
        s->sum[r0 + r] = s->sum[r0 + r] * alpha[r] + sum_lanes(total);
    }
    const int keys = nv * LANES;
#if BF16_PAIRS
    if (pairs) { /* P rounded to bfloat16 pairs of keys, times v's pairs */
        uint32_t p_pairs[ROWS][CHUNK / 2];
        for (int r = 0; r < ROWS; r++)
            for (int j = 0; j < nv; j++)
                _mm256_storeu_si256((__m256i *)((uint16_t *)p_pairs[r] + j * LANES),
                                    (__m256i)_mm512_cvtneps_pbh(*(const __m512 *)(s->p + r * CHUNK + j * LANES)));
        const uint32_t *v = (const uint32_t *)s->v;
        for (int j0 = 0; j0 < d; j0 += 4 * LANES) {
            __m512 acc[ROWS][4];
            const int hv = min_int((d - j0) / LANES, 4);
            for (int r = 0; r < ROWS; r++)
                for (int j = 0; j < hv; j++)
                    acc[r][j] = (__m512)(*(vec *)(s->o + (int64_t)(r0 + r) * d + j0 + j * LANES) * alpha[r]);
            for (int m = 0; m < keys / 2; m++) {
                for (int j = 0; j < hv; j++) {
                    const __m512bh pair = (__m512bh)_mm512_load_si512(v + (int64_t)m * d + j0 + j * LANES);
                    for (int r = 0; r < ROWS; r++)
                        acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)_mm512_set1_epi32((int)p_pairs[r][m]), pair);
                }
            }
            for (int r = 0; r < ROWS; r++)
                for (int j = 0; j < hv; j++) *(vec *)(s->o + (int64_t)(r0 + r) * d + j0 + j * LANES) = (vec)acc[r][j];
        }
        return;
    }
#endif
    for (int j0 = 0; j0 < d; j0 += 4 * LANES) { /* four vectors of the head at a time */
        vec acc[ROWS][4];
        const int hv = min_int((d - j0) / LANES, 4);
        for (int r = 0; r < ROWS; r++)
            for (int j = 0; j < hv; j++) acc[r][j] = *(vec *)(s->o + (int64_t)(r0 + r) * d + j0 + j * LANES) * alpha[r];
        for (int k = 0; k < keys; k++) {
            for (int j = 0; j < hv; j++) {
                const vec v = *(const vec *)(s->v + k * d + j0 + j * LANES);
                for (int r = 0; r < ROWS; r++) acc[r][j] += s->p[r * CHUNK + k] * v;
            }
        }
        for (int r = 0; r < ROWS; r++)
            for (int j = 0; j < hv; j++) *(vec *)(s->o + (int64_t)(r0 + r) * d + j0 + j * LANES) = acc[r][j];
    }
}

static inline __attribute__((always_inline)) void run_tile(const Prefill *job, const Tile *tile, const Scratch *s,
                                                           const int is_bf16, const int d) {
    const int pairs = BF16_PAIRS && is_bf16;
    const int group = job->num_heads / job->num_kv_heads;
    const int rows = tile->count * group, padded = (rows + ROWS - 1) / ROWS * ROWS;
    const int ctx = context_before(job, tile->seq), first_token = job->query_start_loc[tile->seq] + tile->first;
    const int32_t *table = job->block_tables + tile->seq * job->table_width;
    int positions[TILE_TOKENS * 8 + ROWS]; /* group <= 8 (checked by the caller) */

    for (int r = 0; r < padded; r++) { /* row r: query token r / group, head g * group + r % group */
        float *dst = s->q + (int64_t)r * d; /* pairs: d bfloat16 values in the first half of the row's room */
        positions[r] = ctx + tile->first + (r < rows ? r / group : tile->count - 1);
        if (r >= rows) {
            memset(dst, 0, sizeof(float) * d);
            continue;
        }
        const int64_t src = (int64_t)(first_token + r / group) * job->q_stride
                            + (int64_t)(tile->kv_head * group + r % group) * d;
        if (pairs) memcpy((uint16_t *)s->q + (int64_t)r * d, (const uint16_t *)job->q + src, sizeof(uint16_t) * d);
        else for (int i = 0; i < d; i++) dst[i] = load_float(job->q, src + i, is_bf16);
        s->max[r] = MASKED;
        s->sum[r] = 0.f;
    }
    memset(s->o, 0, sizeof(float) * padded * d);
    const int last = positions[rows - 1];
    for (int t0 = 0; t0 <= last; t0 += CHUNK) {
        const int n = min_int(last - t0 + 1, CHUNK);
        if (pairs) load_chunk_pairs(job, table, t0, n, tile->kv_head, (uint32_t *)s->kt, (uint16_t *)s->v, d);
        else load_chunk(job, table, t0, n, tile->kv_head, s->kt, s->v, is_bf16, d);
        for (int r0 = 0; r0 < rows; r0 += ROWS) {
            const int nr = min_int(rows - r0, ROWS);
            if (positions[r0 + nr - 1] < t0) continue; /* none of the block's rows sees this chunk */
            row_block(s, r0, nr, positions, t0, n, job->scale, pairs, d);
        }
    }
    for (int r = 0; r < rows; r++) {
        const float inv = 1.f / s->sum[r];
        const int64_t at = ((int64_t)(first_token + r / group) * job->num_heads + tile->kv_head * group + r % group) * d;
        for (int i = 0; i < d; i++) store_float(job->out, at + i, s->o[(int64_t)r * d + i] * inv, is_bf16);
    }
}

#define RUN(bf16, dim) run_tile(job, tile, s, bf16, dim)
static void run_tile_any(const Prefill *job, const Tile *tile, const Scratch *s) {
    DISPATCH_HEAD_SIZE(RUN, job->is_bf16, job->head_dim);
}
#undef RUN

static int heavier_first(const void *a, const void *b) {
    const int64_t x = ((const Tile *)a)->cost, y = ((const Tile *)b)->cost;
    return (x < y) - (x > y);
}

static Tile *make_tiles(const Prefill *job, int num_seqs, int *count) {
    int n = 0;
    for (int s = 0; s < num_seqs; s++) n += (query_len(job, s) + TILE_TOKENS - 1) / TILE_TOKENS * job->num_kv_heads;
    Tile *tiles = malloc(sizeof(Tile) * (n ? n : 1));
    if (!tiles) return NULL;
    n = 0;
    for (int s = 0; s < num_seqs; s++)
        for (int first = 0; first < query_len(job, s); first += TILE_TOKENS)
            for (int g = 0; g < job->num_kv_heads; g++) {
                const int count = min_int(query_len(job, s) - first, TILE_TOKENS);
                tiles[n++] = (Tile){s, g, first, count, (int64_t)(context_before(job, s) + first + count) * count};
            }
    qsort(tiles, n, sizeof(Tile), heavier_first);
    *count = n;
    return tiles;
}

static float *aligned_floats(size_t n) {
    return aligned_alloc(64, (n * sizeof(float) + 63) / 64 * 64);
}

/* Returns 0 on success, nonzero when memory could not be had (or the query group is over 8). */
int paged_prefill_attention(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                            const int32_t *block_tables, int64_t table_width, const int32_t *query_start_loc,
                            const int32_t *seq_lens, void *out, int num_seqs, int num_heads, int num_kv_heads,
                            int head_dim, int block_size, int is_bf16, float scale, int num_threads) {
    const Prefill job = {q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, q_stride, table_width,
                         num_heads, num_kv_heads, head_dim, block_size, is_bf16, scale};
    const int group = num_heads / num_kv_heads;
    if (group > 8 || head_dim % LANES) return 1;
    int num_tiles = 0, failed = 0;
    Tile *tiles = make_tiles(&job, num_seqs, &num_tiles);
    if (!tiles) return 1;
    const size_t rows = (size_t)TILE_TOKENS * group + ROWS;
#pragma omp parallel num_threads(num_threads)
    {
        Scratch s = {aligned_floats(rows * head_dim), aligned_floats(rows * head_dim), aligned_floats(rows),
                     aligned_floats(rows), aligned_floats(CHUNK * head_dim), aligned_floats(CHUNK * head_dim),
                     aligned_floats(ROWS * CHUNK)};
        const int ok = s.q && s.o && s.max && s.sum && s.kt && s.v && s.p;
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < num_tiles; i++)
            if (ok) run_tile_any(&job, &tiles[i], &s);
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        free(s.q); free(s.o); free(s.max); free(s.sum); free(s.kt); free(s.v); free(s.p);
    }
    free(tiles);
    return failed;
}
