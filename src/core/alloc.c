/* The caching allocator. Storage is rounded up to a size class (four classes per power
 * of two, so a block wastes at most 25%) and freed blocks are kept on a per-backend,
 * per-class free list for the next request of that class: training steps allocate the
 * same shapes every step, and going back to the system each time costs page faults. */
#include <pthread.h>
#include <stdlib.h>
#include "core/tensor_impl.h"

#define N_CLASSES 256

typedef struct block {
    struct block *next;
    void *ptr;
} block;

typedef struct {
    kiln__backend *be;
    block *free_list[N_CLASSES];
} cache;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static cache caches[8];
static int n_caches;
static size_t bytes_live, bytes_peak;

struct kiln__pool {
    int refs;   /* the replay, and each storage allocated while it recorded */
    bool alive; /* the replay still exists */
    struct pool_block {
        struct pool_block *next;
        kiln__backend *be;
        void *ptr;
        int cls;
    } *free;
};
static _Thread_local kiln__pool *recording;
static void pool_release_ref(kiln__pool *p);
static void memory_account(long long delta);

static int size_class(size_t n, size_t *rounded)
{
    if (n < 256) n = 256;
    int k = 63 - __builtin_clzll((unsigned long long)n); /* 2^k <= n < 2^(k+1) */
    size_t base = (size_t)1 << k, step = base / 4;
    size_t q = (n - base + step - 1) / step; /* 0..4 */
    *rounded = base + q * step;
    return k * 4 + (int)q;
}

/* The rounded size of class cls, which a block of it was allocated with. */
static size_t class_size(int cls)
{
    size_t base = (size_t)1 << (cls / 4);
    return base + (size_t)(cls % 4) * (base / 4);
}

static cache *cache_for(kiln__backend *be)
{
    for (int i = 0; i < n_caches; i++)
        if (caches[i].be == be) return &caches[i];
    if (n_caches == (int)(sizeof caches / sizeof caches[0])) return NULL;
    caches[n_caches].be = be;
    return &caches[n_caches++];
}

/* Keeps block ptr (class cls) on be's free list; false when it cannot (no list, or no
 * memory for the entry), for the caller to give it back to the backend. */
static bool cache_put(kiln__backend *be, int cls, void *ptr)
{
    block *b = malloc(sizeof *b);
    pthread_mutex_lock(&lock);
    cache *c = cache_for(be);
    bool kept = b && c && cls < N_CLASSES;
    if (kept) {
        *b = (block){c->free_list[cls], ptr};
        c->free_list[cls] = b;
    }
    pthread_mutex_unlock(&lock);
    if (!kept) free(b);
    return kept;
}

static kiln__storage *storage_new(kiln__backend *be, size_t nbytes)
{
    kiln__storage *st = calloc(1, sizeof *st);
    if (!st) return NULL;
    size_t rounded;
    int cls = size_class(nbytes, &rounded);
    void *ptr = NULL;
    pthread_mutex_lock(&lock);
    cache *c = cache_for(be);
    kiln__pool *pool = recording;
    if (pool) { /* the pool's own blocks first */
        for (struct pool_block **q = &pool->free; *q && !ptr; q = &(*q)->next)
            if ((*q)->be == be && (*q)->cls == cls) {
                struct pool_block *b = *q;
                *q = b->next;
                ptr = b->ptr;
                free(b);
                break;
            }
        pool->refs++;
        st->pool = pool;
    }
    if (!ptr && c && cls < N_CLASSES && c->free_list[cls]) {
        block *b = c->free_list[cls];
        c->free_list[cls] = b->next;
        ptr = b->ptr;
        free(b);
    }
    pthread_mutex_unlock(&lock);
    if (!ptr) ptr = kiln__be_alloc(be, rounded);
    if (!ptr) {
        kiln_memory_empty_cache();
        ptr = kiln__be_alloc(be, rounded);
    }
    if (!ptr) {
        if (st->pool) pool_release_ref(st->pool);
        free(st);
        return NULL;
    }
    atomic_init(&st->refcount, 1);
    st->be = be;
    st->data = ptr;
    st->nbytes = rounded;
    memory_account((long long)rounded);
    return st;
}

void kiln__storage_release(kiln__storage *st)
{
    if (!st || atomic_fetch_sub(&st->refcount, 1) != 1) return;
    if (st->meta || st->wrapped) { /* nothing was allocated for it */
        if (st->wrapped && st->release) st->release(st->release_ctx);
        free(st);
        return;
    }
    size_t rounded;
    int cls = size_class(st->nbytes, &rounded);
    memory_account(-(long long)st->nbytes);
    /* A block a live replay owns goes back to that replay's pool; any other block freed
     * while this thread records goes to the recording's pool. Decided under the lock,
     * so that a replay being released meanwhile is seen as gone. */
    struct pool_block *pb = malloc(sizeof *pb);
    bool kept = false;
    pthread_mutex_lock(&lock);
    kiln__pool *pool = st->pool && st->pool->alive ? st->pool : recording;
    if (pb && pool && pool->alive) {
        *pb = (struct pool_block){pool->free, st->be, st->data, cls};
        pool->free = pb;
        kept = true;
    }
    pthread_mutex_unlock(&lock);
    if (st->pool) pool_release_ref(st->pool);
    if (!kept) {
        free(pb);
        if (!cache_put(st->be, cls, st->data)) kiln__be_free(st->be, st->data, st->nbytes);
    }
    free(st);
}

kiln__pool *kiln__pool_new(void)
{
    kiln__pool *p = malloc(sizeof *p);
    if (p) *p = (kiln__pool){.refs = 1, .alive = true};
    return p;
}

void kiln__pool_begin(kiln__pool *p) { recording = p; }
void kiln__pool_end(void) { recording = NULL; }

/* Drops one reference; the last one frees the pool (its blocks are gone by then). */
static void pool_release_ref(kiln__pool *p)
{
    pthread_mutex_lock(&lock);
    bool last = --p->refs == 0;
    pthread_mutex_unlock(&lock);
    if (last) free(p);
}

void kiln__pool_release(kiln__pool *p)
{
    if (!p) return;
    pthread_mutex_lock(&lock);
    p->alive = false;
    struct pool_block *b = p->free;
    p->free = NULL;
    pthread_mutex_unlock(&lock);
    while (b) { /* into the shared cache, as any freed block */
        struct pool_block *nx = b->next;
        if (!cache_put(b->be, b->cls, b->ptr)) kiln__be_free(b->be, b->ptr, class_size(b->cls));
        free(b);
        b = nx;
    }
    pool_release_ref(p);
}

void kiln_memory_empty_cache(void)
{
    pthread_mutex_lock(&lock);
    for (int i = 0; i < n_caches; i++) {
        for (int cls = 0; cls < N_CLASSES; cls++) {
            for (block *b = caches[i].free_list[cls], *nx; b; b = nx) {
                nx = b->next;
                kiln__be_free(caches[i].be, b->ptr, class_size(cls));
                free(b);
            }
            caches[i].free_list[cls] = NULL;
        }
    }
    pthread_mutex_unlock(&lock);
}

static void memory_account(long long delta)
{
    pthread_mutex_lock(&lock);
    bytes_live = (size_t)((long long)bytes_live + delta);
    if (bytes_live > bytes_peak) bytes_peak = bytes_live;
    pthread_mutex_unlock(&lock);
}

size_t kiln_memory_allocated(void) { return bytes_live; }
size_t kiln_memory_peak(void) { return bytes_peak; }

void kiln_memory_reset_peak(void)
{
    pthread_mutex_lock(&lock);
    bytes_peak = bytes_live;
    pthread_mutex_unlock(&lock);
}

kiln_tensor_t *kiln__tensor_alloc(kiln__backend *be, kiln_dtype dt, const int64_t *shape, int ndim)
{
    int64_t n = kiln__numel(ndim, shape);
    size_t nbytes = (size_t)n * kiln_dtype_size(dt);
    kiln__storage *st = storage_new(be, nbytes ? nbytes : 1);
    if (!st) return kiln__err(KILN_ERR_OOM, "out of memory allocating %zu bytes on %s", nbytes, be->name), NULL;
    int64_t stride[KILN_MAX_DIMS];
    kiln__contiguous_strides(ndim, shape, stride);
    kiln_tensor_t *t = kiln__tensor_alias(st, dt, ndim, shape, stride, 0);
    kiln__storage_release(st); /* the alias holds it now */
    return t;
}
