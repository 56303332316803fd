/* Paged decode attention for the CPU: one query token per sequence, reading K/V through the
 * block tables one sequence at a time (no gathered copy of the whole batch). Meaning: kernels/tessera_kernels/torch_ref.py paged_decode_attention.
 *
 * Layouts (all contiguous): q, out [B, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D];
 * block_tables int32 [B, table_width]; seq_lens int32 [B].
 * One work item is one sequence with all its heads, so each slot's K/V row (Hkv * D contiguous
 * values) is read once and whole. Sequences are shared out dynamically because their lengths
 * differ a lot. The threads are OpenMP's: built with -fopenmp and loaded after torch, this library
 * binds to the libgomp torch already loaded (same soname), so it runs on torch's own thread pool
 * instead of fighting its spinning threads for the cores (a private pool lost to the torch path
 * inside the engine for exactly that reason: docs/kernels.md).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "vec.h"

typedef struct {
    const void *q, *k_cache, *v_cache;
    const int32_t *block_tables, *seq_lens;
    void *out;
    int64_t table_width, q_stride; /* q_stride: elements from one query row to the next */
    int num_heads, num_kv_heads, head_dim, block_size, is_bf16;
    float scale;
} Job;

/* Copy the first `len` K or V rows of one sequence (Hkv * D values each) out of its blocks into
 * `stage`, widening bfloat16 to float. Block-sized memcpys keep many loads in flight, which the
 * compute loops cannot; the staged rows then sit in L2 for the math (docs/kernels.md). */
static void stage_rows(const Job *job, const void *cache, const int32_t *table, int len, float *stage) {
    const int bs = job->block_size;
    const size_t width = (size_t)job->num_kv_heads * job->head_dim;
    for (int first = 0; first < len; first += bs) {
        const int rows = len - first < bs ? len - first : bs;
        const size_t offset = (size_t)table[first / bs] * bs * width;
        float *dst = stage + (size_t)first * width;
        if (!job->is_bf16) {
            memcpy(dst, (const float *)cache + offset, sizeof(float) * rows * width);
        } else {
            const uint16_t *src = (const uint16_t *)cache + offset;
            for (size_t i = 0; i < rows * width; i++) dst[i] = bf16_to_float(src[i]);
        }
    }
}

static inline float dot(const float *a, const float *b, int n) {
    float s = 0.f;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* One sequence, all heads. scores: Hq * seq_len floats; acc, qf: Hq * D; stage: seq_len * Hkv * D. */
static void run_sequence(const Job *job, int seq, float *scores, float *acc, float *qf, float *stage) {
    const int hq = job->num_heads, d = job->head_dim, width = job->num_kv_heads * d;
    const int group = hq / job->num_kv_heads;
    const int len = job->seq_lens[seq];
    const int32_t *table = job->block_tables + seq * job->table_width;
    const int64_t q_offset = (int64_t)seq * job->q_stride, out_offset = (int64_t)seq * hq * d;

    for (int i = 0; i < hq * d; i++)
        qf[i] = load_float(job->q, q_offset + i, job->is_bf16);
    stage_rows(job, job->k_cache, table, len, stage);
    for (int t = 0; t < len; t++) { /* scores = q . k * scale; query head h reads KV head h / group */
        const float *k = stage + (size_t)t * width;
        for (int h = 0; h < hq; h++) scores[h * len + t] = dot(qf + h * d, k + (h / group) * d, d) * job->scale;
    }
    for (int h = 0; h < hq; h++) { /* softmax per query head */
        float *s = scores + h * len, m = s[0], sum = 0.f; /* len >= 1 */
        for (int t = 1; t < len; t++) m = s[t] > m ? s[t] : m;
        for (int t = 0; t < len; t++) { s[t] = expf(s[t] - m); sum += s[t]; }
        for (int t = 0; t < len; t++) s[t] /= sum;
    }
    stage_rows(job, job->v_cache, table, len, stage);
    memset(acc, 0, sizeof(float) * hq * d);
    for (int t = 0; t < len; t++) { /* acc = softmax . v */
        const float *v = stage + (size_t)t * width;
        for (int h = 0; h < hq; h++) {
            const float p = scores[h * len + t], *vh = v + (h / group) * d;
            float *a = acc + h * d;
            for (int i = 0; i < d; i++) a[i] += p * vh[i];
        }
    }
    for (int i = 0; i < hq * d; i++) store_float(job->out, out_offset + i, acc[i], job->is_bf16);
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* The AVX-512 path: K and V are read in place from their blocks (no whole-sequence stage), 16
 * tokens at a time, one KV head at a time so a row is widened once for its whole query group.
 * - A score is a dot product; summing each one's 16 lanes on its own is a serial chain of
 *   shuffles per score. Instead the lane-vectors of 16 tokens are summed together (hsum16):
 *   45 independent shuffles and adds for 16 scores.
 * - With AVX512-BF16, bfloat16 scores come from vdpbf16ps on the raw rows (no widening at all).
 * - Rows are prefetched into L2 some 256 KiB ahead of the compute (prefetch_rows), and the
 *   sequences are pipelined: the K pass asks for the V rows it has just scored, and the V pass
 *   asks for the K rows of the sequence this thread runs next (each thread claims its next
 *   sequence before it starts the current one). A sequence's K often fits the window whole, so
 *   without this each pass began by waiting for memory. The K pass's prefetches go out row by row
 *   between the dot products (Ahead), not as one burst per chunk, so the arithmetic does not wait
 *   behind them. What each step bought, and this path against the portable one: docs/kernels.md. */
#define CHUNK 16

static inline __m512 load16(const void *base, size_t index, const int is_bf16) {
    if (is_bf16) { /* bfloat16 is the top half of a float: widen and shift */
        const __m256i raw = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + index));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
    return _mm512_loadu_ps((const float *)base + index);
}

/* Lane i of the result = the sum of the 16 lanes of v[i]. */
static inline __m512 hsum16(const __m512 v[CHUNK]) {
    __m512 a[8], b[4];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3] for x=v[2i], y=v[2i+1] */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: that lane's sums of v[4i..4i+3] */
        const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    /* add the four 128-bit lanes: pairs of lanes first, then pairs of pairs */
    const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
    const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x88), _mm512_shuffle_f32x4(c0, c1, 0xDD));
}

static inline size_t row_offset(const Job *job, const int32_t *table, int t) { /* in elements */
    const int bs = job->block_size;
    return ((size_t)table[t / bs] * bs + t % bs) * (size_t)job->num_kv_heads * job->head_dim;
}

/* Ask for the 64-byte lines of [start, start + bytes) into L2 (prefetcht1). */
static inline __attribute__((always_inline)) void prefetch_lines(const char *start, size_t bytes) {
    for (size_t line = 0; line < bytes; line += 64) __builtin_prefetch(start + line, 0, 2);
}

/* Ask for rows [first, end) of a sequence's K or V into L2. Blocks sit at random places in the
 * pool, so the hardware prefetcher, which stops at page boundaries, hardly helps: without this
 * the kernel waited on memory for most of its time (measured in docs/kernels.md). */
static inline void prefetch_rows(const Job *job, const void *cache, const int32_t *table, int first, int end) {
    const size_t elem = job->is_bf16 ? 2 : 4, bytes = (size_t)job->num_kv_heads * job->head_dim * elem;
    for (int t = first; t < end; t++) prefetch_lines((const char *)cache + row_offset(job, table, t) * elem, bytes);
}

/* How many rows ahead of the compute the prefetches run: about 256 KiB, well inside L2. */
static inline int prefetch_distance(const Job *job) {
    const int row_bytes = job->num_kv_heads * job->head_dim * (job->is_bf16 ? 2 : 4);
    const int rows = (256 * 1024 / row_bytes) / CHUNK * CHUNK;
    return rows > CHUNK ? rows : CHUNK;
}

/* float32 views of KV head g in n rows: the cache itself (float32) or rows widened into `widened`. */
static inline __attribute__((always_inline)) void head_rows(const Job *job, const void *cache, const size_t *rows,
                                                            int n, int g, float *widened, const float **out,
                                                            const int is_bf16, const int d) {
    for (int i = 0; i < n; i++) {
        const size_t at = rows[i] + (size_t)g * d;
        if (!is_bf16) {
            out[i] = (const float *)cache + at;
            continue;
        }
        float *dst = widened + (size_t)i * d;
        for (int j = 0; j < d; j += 16) _mm512_storeu_ps(dst + j, load16(cache, at + j, 1));
        out[i] = dst;
    }
}

static inline void store_scores(float *scores, int n, __m512 sums, float scale) {
    _mm512_mask_storeu_ps(scores, (__mmask16)((1u << n) - 1), _mm512_mul_ps(sums, _mm512_set1_ps(scale)));
}

/* Rows the K pass asks for while it scores a chunk: the K rows a window ahead and the V rows of the
 * chunk (see prefetch_rows). Each row's slice for KV head g is asked for inside the row loop of
 * that head's scores, so the prefetches interleave with the arithmetic: issued as one burst per
 * chunk, they filled the L1 miss buffers and the arithmetic waited behind them (see docs/kernels.md). */
typedef struct { const void *cache; const size_t *rows; int n; } Ahead;

static inline __attribute__((always_inline)) void prefetch_slices(const Ahead *asks, int i, int g, const int is_bf16,
                                                                  const int d) {
    const size_t elem = is_bf16 ? 2 : 4;
    for (int a = 0; a < 2; a++) {
        if (i >= asks[a].n) continue;
        prefetch_lines((const char *)asks[a].cache + (asks[a].rows[i] + (size_t)g * d) * elem, (size_t)d * elem);
    }
}

#if defined(__AVX512BF16__)
/* bfloat16 pairs multiplied and summed into float32 by vdpbf16ps, straight from the cache rows. */
static inline __attribute__((always_inline)) int chunk_scores_bf16(const Job *job, int64_t q_offset, const size_t *rows,
                                                                   int n, int g, int t0, int len, float *scores,
                                                                   const Ahead *asks, const int d) {
    const int group = job->num_heads / job->num_kv_heads;
    if (d % 32) return 0;
    const uint16_t *q = (const uint16_t *)job->q + q_offset, *cache = (const uint16_t *)job->k_cache;
    for (int h = g * group; h < (g + 1) * group; h++) {
        __m512 lanes[CHUNK];
        for (int i = 0; i < CHUNK; i++) {
            lanes[i] = _mm512_setzero_ps();
            if (h == g * group) prefetch_slices(asks, i, g, 1, d);
            if (i < n)
                for (int j = 0; j < d; j += 32)
                    lanes[i] = _mm512_dpbf16_ps(lanes[i], (__m512bh)_mm512_loadu_si512(q + (size_t)h * d + j),
                                                (__m512bh)_mm512_loadu_si512(cache + rows[i] + (size_t)g * d + j));
        }
        store_scores(scores + (size_t)h * len + t0, n, hsum16(lanes), job->scale);
    }
    return 1;
}
#endif

/* scores[h * len + t0 + i] = scale * q_h . k_i for the query heads of KV head g, n <= 16 rows. */
static inline __attribute__((always_inline)) void chunk_scores(const Job *job, const float *qf, int64_t q_offset,
                                                               const size_t *rows, int n, int g, int t0, int len,
                                                               float *scores, float *widened, const Ahead *asks,
                                                               const int is_bf16, const int d) {
#if defined(__AVX512BF16__)
    if (is_bf16 && chunk_scores_bf16(job, q_offset, rows, n, g, t0, len, scores, asks, d)) return;
#endif
    const int group = job->num_heads / job->num_kv_heads;
    const float *k[CHUNK];
    head_rows(job, job->k_cache, rows, n, g, widened, k, is_bf16, d);
    for (int h = g * group; h < (g + 1) * group; h++) {
        const float *qh = qf + (size_t)h * d;
        __m512 lanes[CHUNK];
        for (int i = 0; i < CHUNK; i++) {
            lanes[i] = _mm512_setzero_ps();
            if (h == g * group) prefetch_slices(asks, i, g, is_bf16, d);
            if (i < n)
                for (int j = 0; j < d; j += 16)
                    lanes[i] = _mm512_fmadd_ps(_mm512_loadu_ps(qh + j), _mm512_loadu_ps(k[i] + j), lanes[i]);
        }
        store_scores(scores + (size_t)h * len + t0, n, hsum16(lanes), job->scale);
    }
}

#define MAX_VECTORS 8 /* head_dim <= 128 in registers; larger heads take a second pass */
#define MAX_GROUP_ACCUMULATORS 16 /* of the 32 vector registers; the rest hold the row and p */

/* chunk_values for bfloat16 V with the whole query group's accumulators (G heads x V vectors) in
 * registers: each row is widened once, in registers, and multiplied into every head of the group.
 * The general loop widens the rows into memory and reads them back once per head, which kept
 * bfloat16 slower than float32 (docs/kernels.md). Every accumulator sees the same FMAs in the
 * same order as there, so the results are bit-equal. */
static inline __attribute__((always_inline)) void chunk_values_grouped(const Job *job, const float *scores,
                                                                       const size_t *rows, int n, int g, int t0,
                                                                       int len, float *acc, const int G, const int V) {
    const int d = 16 * V;
    float *out = acc + (size_t)g * G * d;
    const float *p = scores + (size_t)g * G * len + t0;
    __m512 a[MAX_GROUP_ACCUMULATORS];
    for (int k = 0; k < G * V; k++) a[k] = _mm512_loadu_ps(out + 16 * k);
    for (int i = 0; i < n; i++) {
        __m512 v[MAX_VECTORS];
        for (int j = 0; j < V; j++) v[j] = load16(job->v_cache, rows[i] + (size_t)g * d + 16 * j, 1);
        for (int h = 0; h < G; h++) {
            const __m512 pi = _mm512_set1_ps(p[(size_t)h * len + i]);
            for (int j = 0; j < V; j++) a[h * V + j] = _mm512_fmadd_ps(pi, v[j], a[h * V + j]);
        }
    }
    for (int k = 0; k < G * V; k++) _mm512_storeu_ps(out + 16 * k, a[k]);
}

/* The grouped loop where the group's accumulators fit in registers (head sizes 64 and 128). */
static inline __attribute__((always_inline)) int chunk_values_bf16(const Job *job, const float *scores,
                                                                   const size_t *rows, int n, int g, int t0, int len,
                                                                   float *acc, const int d) {
    const int group = job->num_heads / job->num_kv_heads;
#define GROUPED(G, V) chunk_values_grouped(job, scores, rows, n, g, t0, len, acc, G, V)
    if (d == 64) {
        switch (group) {
            case 1: GROUPED(1, 4); return 1;
            case 2: GROUPED(2, 4); return 1;
            case 3: GROUPED(3, 4); return 1;
            case 4: GROUPED(4, 4); return 1;
        }
    } else if (d == 128) {
        switch (group) {
            case 1: GROUPED(1, 8); return 1;
            case 2: GROUPED(2, 8); return 1;
        }
    }
#undef GROUPED
    return 0;
}

/* acc[h] += sum_i p[h][t0 + i] * v_i for the query heads of KV head g, n <= 16 rows. The head's
 * accumulators stay in registers over the 16 rows: one chain of 16 dependent FMAs per vector ran
 * at FMA latency, not throughput (the kernel's largest cost before). */
static inline __attribute__((always_inline)) void chunk_values(const Job *job, const float *scores, const size_t *rows,
                                                               int n, int g, int t0, int len, float *acc,
                                                               float *widened, const int is_bf16, const int d) {
    if (is_bf16 && chunk_values_bf16(job, scores, rows, n, g, t0, len, acc, d)) return;
    const int group = job->num_heads / job->num_kv_heads;
    const float *v[CHUNK];
    head_rows(job, job->v_cache, rows, n, g, widened, v, is_bf16, d);
    for (int h = g * group; h < (g + 1) * group; h++) {
        const float *p = scores + (size_t)h * len + t0;
        for (int j0 = 0; j0 < d; j0 += 16 * MAX_VECTORS) {
            const int nj = (d - j0) / 16 < MAX_VECTORS ? (d - j0) / 16 : MAX_VECTORS;
            float *out = acc + (size_t)h * d + j0;
            __m512 a[MAX_VECTORS];
            for (int j = 0; j < MAX_VECTORS; j++) a[j] = j < nj ? _mm512_loadu_ps(out + 16 * j) : _mm512_setzero_ps();
            for (int i = 0; i < n; i++) {
                const __m512 pi = _mm512_set1_ps(p[i]);
                for (int j = 0; j < MAX_VECTORS; j++)
                    if (j < nj) a[j] = _mm512_fmadd_ps(pi, _mm512_loadu_ps(v[i] + j0 + 16 * j), a[j]);
            }
            for (int j = 0; j < nj; j++) _mm512_storeu_ps(out + 16 * j, a[j]);
        }
    }
}

static inline __attribute__((always_inline)) void run_sequence_avx512(const Job *job, int seq, int next, float *scores,
                                                                      float *acc, float *qf, float *widened,
                                                                      const int is_bf16, const int d) {
    const int hq = job->num_heads, hkv = job->num_kv_heads;
    const int len = job->seq_lens[seq];
    const int32_t *table = job->block_tables + seq * job->table_width;
    const int64_t q_offset = (int64_t)seq * job->q_stride, out_offset = (int64_t)seq * hq * d;
    size_t rows[CHUNK], later[CHUNK];

    for (int i = 0; i < hq * d; i++)
        qf[i] = load_float(job->q, q_offset + i, is_bf16);
    const int ahead = prefetch_distance(job);
    prefetch_rows(job, job->k_cache, table, 0, min_int(ahead, len));
    for (int t0 = 0; t0 < len; t0 += CHUNK) {
        const int n = min_int(len - t0, CHUNK), n_later = min_int(len - min_int(t0 + ahead, len), CHUNK);
        for (int i = 0; i < n; i++) rows[i] = row_offset(job, table, t0 + i);
        for (int i = 0; i < n_later; i++) later[i] = row_offset(job, table, t0 + ahead + i);
        const Ahead asks[2] = {{job->k_cache, later, n_later}, {job->v_cache, rows, n}};
        for (int g = 0; g < hkv; g++)
            chunk_scores(job, qf, q_offset, rows, n, g, t0, len, scores, widened, asks, is_bf16, d);
    }
    for (int h = 0; h < hq; h++) { /* softmax per query head, normalised at the end */
        float *s = scores + (size_t)h * len, m = s[0], sum = 0.f; /* len >= 1 */
        for (int t = 1; t < len; t++) m = s[t] > m ? s[t] : m;
        for (int t = 0; t < len; t++) { s[t] = expf(s[t] - m); sum += s[t]; }
        qf[h] = 1.f / sum; /* q is done with: qf keeps the normalisers */
    }
    memset(acc, 0, sizeof(float) * hq * d);
    for (int t0 = 0; t0 < len; t0 += CHUNK) {
        const int n = min_int(len - t0, CHUNK);
        if (next >= 0) {
            const int next_len = job->seq_lens[next];
            const int32_t *next_table = job->block_tables + next * job->table_width;
            prefetch_rows(job, job->k_cache, next_table, min_int(t0, next_len), min_int(t0 + CHUNK, next_len));
        }
        for (int i = 0; i < n; i++) rows[i] = row_offset(job, table, t0 + i);
        for (int g = 0; g < hkv; g++) chunk_values(job, scores, rows, n, g, t0, len, acc, widened, is_bf16, d);
    }
    for (int h = 0; h < hq; h++) {
        for (int i = 0; i < d; i++) store_float(job->out, out_offset + (size_t)h * d + i, acc[(size_t)h * d + i] * qf[h], is_bf16);
    }
}

#define RUN(bf16, d) run_sequence_avx512(job, seq, next, scores, acc, qf, widened, bf16, d)
static void run_sequence_fast(const Job *job, int seq, int next, float *scores, float *acc, float *qf, float *widened) {
    DISPATCH_HEAD_SIZE(RUN, job->is_bf16, job->head_dim);
}
#undef RUN
#define HAS_FAST_PATH 1
#else
#define HAS_FAST_PATH 0
#endif

/* Returns 0 on success, nonzero when a thread could not get its scratch memory. */
int paged_decode_attention(const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,
                           int64_t table_width, const int32_t *seq_lens, void *out, int batch, int num_heads,
                           int num_kv_heads, int head_dim, int block_size, int is_bf16, float scale, int num_threads,
                           int64_t q_stride) {
    const Job job = {q, k_cache, v_cache, block_tables, seq_lens, out, table_width, q_stride, num_heads, num_kv_heads,
                     head_dim, block_size, is_bf16, scale};
    int max_len = 0, failed = 0, claimed = 0;
    for (int i = 0; i < batch; i++) max_len = seq_lens[i] > max_len ? seq_lens[i] : max_len;
    const size_t hq = num_heads, d = head_dim;
    const size_t stage_rows = max_len > 16 ? max_len : 16; /* the fast path widens 16 rows of one head there */
    const size_t scratch_floats = hq * max_len + 2 * hq * d + stage_rows * num_kv_heads * d;
#pragma omp parallel num_threads(num_threads)
    {
        float *scratch = malloc(sizeof(float) * scratch_floats);
        float *scores = scratch, *acc = scores + hq * max_len, *qf = acc + hq * d, *stage = qf + hq * d;
        int seq, next; /* dynamic sharing, one sequence of lookahead (see prefetch_rows above) */
#pragma omp atomic capture
        next = claimed++;
        while (next < batch) {
            seq = next;
#pragma omp atomic capture
            next = claimed++;
            if (!scratch) continue;
#if HAS_FAST_PATH
            if (head_dim % 16 == 0) { run_sequence_fast(&job, seq, next < batch ? next : -1, scores, acc, qf, stage); continue; }
#endif
            run_sequence(&job, seq, scores, acc, qf, stage);
        }
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
        free(scratch);
    }
    return failed;
}
