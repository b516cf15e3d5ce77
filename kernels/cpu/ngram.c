/* The n-gram proposer's matching (kernels/ngram.py), vLLM's prompt lookup: for each request, the
 * longest n in [min_n, max_n] whose last n tokens occur earlier in its row of the token table
 * (an occurrence may overlap the suffix, but must be followed by at least one token), at its
 * earliest occurrence; the drafts are the tokens that followed it, at most limit of them, and -1
 * after. One pass over a row: a position whose token is not the row's last one (nearly all)
 * costs one compare, and the scan stops at the first occurrence of a max_n-gram. */
#include <stdint.h>

/* Rows of more tokens than this, in all, are split over the threads (a parallel region costs a
 * few microseconds; a 2k-token row's scan about as much). */
#define PARALLEL_TOKENS 65536

/* The matched n-gram's length (0: none of at least min_n), and in *first the position of the
 * first token after its earliest occurrence. */
static int64_t longest_match(const int64_t *t, int64_t total, int64_t min_n, int64_t max_n,
                             int64_t *first)
{
    if (total < 2)
        return 0;
    const int64_t last = t[total - 1];
    int64_t best = 0, best_end = 0;
    for (int64_t e = 0; e + 1 < total; e++) {
        if (t[e] != last)
            continue;
        const int64_t cap = e + 1 < max_n ? e + 1 : max_n;
        int64_t n = 1;
        while (n < cap && t[e - n] == t[total - 1 - n])
            n++;
        if (n > best) {  /* strictly longer: the earliest occurrence of a length wins */
            best = n;
            best_end = e;
            if (best == max_n)
                break;
        }
    }
    if (best < min_n)
        return 0;
    *first = best_end + 1;
    return best;
}

void ngram_propose_i64(const int64_t *token_ids, int64_t stride, const int64_t *slots,
                       const int64_t *num_tokens, const int64_t *limits, int64_t num_reqs,
                       int32_t min_n, int32_t max_n, int32_t k, int64_t *out, int32_t num_threads)
{
    int64_t work = 0;
    for (int64_t i = 0; i < num_reqs; i++)
        work += num_tokens[i];
    #pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1) \
        if (num_reqs > 1 && work > PARALLEL_TOKENS)
    for (int64_t i = 0; i < num_reqs; i++) {
        const int64_t *t = token_ids + slots[i] * stride;
        const int64_t total = num_tokens[i];
        int64_t *row = out + i * k;
        int64_t count = limits[i] < k ? limits[i] : k;
        int64_t first = 0;
        if (count <= 0 || !longest_match(t, total, min_n, max_n, &first))
            count = 0;
        else if (total - first < count)
            count = total - first;
        for (int64_t j = 0; j < count; j++)
            row[j] = t[first + j];
        for (int64_t j = count; j < k; j++)
            row[j] = -1;
    }
}
