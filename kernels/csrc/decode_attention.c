/* Paged decode attention for the CPU: one query token per sequence, reading K/V through the
 * block tables one sequence at a time (no gathered copy of the whole batch). Meaning: kernels/torch_ref.py paged_decode_attention.
 *
 * Layouts (all contiguous): q, out [B, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D];
 * block_tables int32 [B, table_width]; seq_lens int32 [B].
 * One work item is one sequence with all its heads, so each slot's K/V row (Hkv * D contiguous
 * values) is read once and whole. Sequences are shared out dynamically because their lengths
 * differ a lot. The threads are OpenMP's: built with -fopenmp and loaded after torch, this library
 * binds to the libgomp torch already loaded (same soname), so it runs on torch's own thread pool
 * instead of fighting its spinning threads for the cores (a private pthread pool ran 10% slower
 * than the torch path inside the engine for exactly that reason).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const void *q, *k_cache, *v_cache;
    const int32_t *block_tables, *seq_lens;
    void *out;
    int64_t table_width;
    int num_heads, num_kv_heads, head_dim, block_size, is_bf16;
    float scale;
} Job;

static inline float bf16_to_float(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* Copy the first `len` K or V rows of one sequence (Hkv * D values each) out of its blocks into
 * `stage`, widening bfloat16 to float. Block-sized memcpys keep many loads in flight, which the
 * compute loops cannot; the staged rows then sit in L2 for the math (measured on 256 sequences:
 * 11 ms with loads straight from the pool, see docs/kernels.md for the staged figure). */
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
    const int64_t q_offset = (int64_t)seq * hq * d;

    for (int i = 0; i < hq * d; i++)
        qf[i] = job->is_bf16 ? bf16_to_float(((const uint16_t *)job->q)[q_offset + i]) : ((const float *)job->q)[q_offset + i];
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
    for (int i = 0; i < hq * d; i++) {
        if (job->is_bf16) ((uint16_t *)job->out)[q_offset + i] = float_to_bf16(acc[i]);
        else ((float *)job->out)[q_offset + i] = acc[i];
    }
}

/* Returns 0 on success, nonzero when a thread could not get its scratch memory. */
int paged_decode_attention(const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,
                           int64_t table_width, const int32_t *seq_lens, void *out, int batch, int num_heads,
                           int num_kv_heads, int head_dim, int block_size, int is_bf16, float scale, int num_threads) {
    const Job job = {q, k_cache, v_cache, block_tables, seq_lens, out, table_width, num_heads, num_kv_heads,
                     head_dim, block_size, is_bf16, scale};
    int max_len = 0, failed = 0;
    for (int i = 0; i < batch; i++) max_len = seq_lens[i] > max_len ? seq_lens[i] : max_len;
    const size_t hq = num_heads, d = head_dim;
    const size_t scratch_floats = hq * max_len + 2 * hq * d + (size_t)max_len * num_kv_heads * d;
#pragma omp parallel num_threads(num_threads)
    {
        float *scratch = malloc(sizeof(float) * scratch_floats);
        float *scores = scratch, *acc = scores + hq * max_len, *qf = acc + hq * d, *stage = qf + hq * d;
#pragma omp for schedule(dynamic, 1)
        for (int seq = 0; seq < batch; seq++) {
            if (scratch) run_sequence(&job, seq, scores, acc, qf, stage);
        }
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
        free(scratch);
    }
    return failed;
}
