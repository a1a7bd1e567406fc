/* kiln/data.h — text corpora and reproducible batches.
 *
 *     char *text; size_t len;
 *     kiln_text_read("data/kjv.txt", &text, &len);
 *     ... tokenize into ids ...
 *     kiln_dataset_t *ds;
 *     kiln_dataset_new(ids, n, 0.1, &ds);                 // last 10% is validation
 *     kiln_tensor_t *x, *y;                               // (B,T) i64, y = x shifted by one
 *     kiln_dataset_batch(ds, KILN_SPLIT_TRAIN, 16, 128, seed, step, 0, 1, &x, &y);
 */
#ifndef KILN_DATA_H
#define KILN_DATA_H

#include "kiln/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Reads a file, or every regular file of a folder in name order, joined by newlines.
 * *text is malloc'd and NUL-terminated. */
kiln_status kiln_text_read(const char *path, char **text, size_t *len);

typedef enum { KILN_SPLIT_TRAIN, KILN_SPLIT_VAL } kiln_data_split;
typedef struct kiln_dataset kiln_dataset_t;

/* Copies n token ids; the last val_fraction of them (0 <= f < 1) is the validation split. */
kiln_status kiln_dataset_new(const int32_t *ids, size_t n, double val_fraction, kiln_dataset_t **out);
void kiln_dataset_free(kiln_dataset_t *d);
size_t kiln_dataset_len(const kiln_dataset_t *d, kiln_data_split split);
/* Batch `step` of the global batch of world * B windows of T + 1 tokens: rank r gets
 * windows [r*B, (r+1)*B). Window offsets are a pure function of (seed, split, step,
 * window), so a run resumed at step s sees the batches it would have seen. x and y are
 * new (B,T) i64 tensors; y is x shifted by one token. */
kiln_status kiln_dataset_batch(const kiln_dataset_t *d, kiln_data_split split, int B, int T, uint64_t seed, int64_t step,
                               int rank, int world, kiln_tensor_t **x, kiln_tensor_t **y);
/* Entropy in nats of the unigram distribution of the training split (a loss any model
 * that learns only token frequencies reaches). */
double kiln_dataset_unigram_entropy(const kiln_dataset_t *d, int vocab_size);

#ifdef __cplusplus
}
#endif
#endif
