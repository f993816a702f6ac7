/* A parallel-for whose caller never waits for a thread that has not started: for the decode
 * step (decode_step.c), included by it only.
 *
 * Why not OpenMP: an OpenMP parallel loop ends at a barrier that every thread of the team must
 * reach. On a shared CPU (a decode worker beside a prefill worker, a router, other jobs) the
 * second thread is often not running when the loop starts, and the caller then waits for the
 * scheduler to give it a slice, once per GEMM, ~50 times a step: measured on a 2-vCPU host
 * under load, a 2-thread step took 4-16x the 1-thread one. Here items are claimed one at a time
 * from a shared counter, the caller claims them too, and it waits only for items another
 * thread has claimed (which is running them). A worker that wakes late finds nothing left.
 *
 * Workers are created on first use (at most PD_MAX_WORKERS), spin on the generation word for
 * PD_SPIN pause instructions after each loop (10-300 us, by the CPU's pause latency: the next
 * GEMM of a step follows within microseconds, while the Python between two steps, ~1 ms, must
 * not have a spinning worker beside it), then sleep on a futex until a loop wakes them.
 *
 * Claims go through one 64-bit word: generation << 32 | next item (see pd_drain for why a
 * worker can only run items of the loop whose fields it read).
 */
#ifndef PDSERVE_POOL_H
#define PDSERVE_POOL_H

#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#define PD_MAX_WORKERS 63
#define PD_SPIN 2000

typedef void (*pd_task)(void *ctx, int64_t item);

static struct {
    _Atomic uint64_t work;   /* generation << 32 | next unclaimed item */
    _Atomic uint32_t wake;   /* futex word: bumped to wake sleepers */
    _Atomic int64_t done;    /* items finished in the current loop */
    _Atomic int sleepers;
    _Atomic int active;      /* workers allowed to claim (nthreads - 1 of the current loop) */
    pd_task _Atomic fn;
    void *_Atomic ctx;
    _Atomic int64_t n;
    int started;             /* workers created (caller thread only) */
    pthread_mutex_t lock;    /* one loop at a time across caller threads */
} pd_pool = {.lock = PTHREAD_MUTEX_INITIALIZER};

static void pd_futex_wait(_Atomic uint32_t *addr, uint32_t val) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT_PRIVATE, val, NULL, NULL, 0);
}

static void pd_futex_wake(_Atomic uint32_t *addr) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
}

#define PD_CLOSED 0xffffffffu /* item index while the caller publishes a new loop */

/* Claim and run items of generation `gen` until none are left (or the loop moved on). The
 * loop's fields are read after an open claim word of `gen` is seen and before the claim's
 * compare-and-swap on that word: if the swap succeeds, the word did not change in between, so
 * the fields were those of `gen` (a new loop closes the word before writing its fields). */
static void pd_drain(uint32_t gen) {
    for (;;) {
        uint64_t w = atomic_load(&pd_pool.work);
        if ((uint32_t)(w >> 32) != gen) return;
        const uint32_t i = (uint32_t)(w & 0xffffffffu);
        if (i == PD_CLOSED) {
            _mm_pause();
            continue;
        }
        pd_task fn = atomic_load(&pd_pool.fn);
        void *ctx = atomic_load(&pd_pool.ctx);
        if ((int64_t)i >= atomic_load(&pd_pool.n)) return;
        if (atomic_compare_exchange_weak(&pd_pool.work, &w, w + 1)) {
            fn(ctx, (int64_t)i);
            atomic_fetch_add(&pd_pool.done, 1);
        }
    }
}

static void *pd_worker(void *arg) {
    const int index = (int)(intptr_t)arg;
    uint32_t seen = (uint32_t)(atomic_load(&pd_pool.work) >> 32);
    for (;;) {
        uint32_t gen = seen;
        for (int spin = 0; spin < PD_SPIN; spin++) {
            gen = (uint32_t)(atomic_load_explicit(&pd_pool.work, memory_order_acquire) >> 32);
            if (gen != seen) break;
            _mm_pause();
        }
        if (gen == seen) {
            const uint32_t ticket = atomic_load(&pd_pool.wake);
            atomic_fetch_add(&pd_pool.sleepers, 1);
            gen = (uint32_t)(atomic_load(&pd_pool.work) >> 32);
            if (gen == seen) pd_futex_wait(&pd_pool.wake, ticket);
            atomic_fetch_sub(&pd_pool.sleepers, 1);
            continue;
        }
        seen = gen;
        if (index < atomic_load(&pd_pool.active)) pd_drain(gen);
    }
    return NULL;
}

/* fn(ctx, i) for every i < n, on the caller and up to nthreads - 1 pool workers; returns when
 * all are done. n < 2^32 - 1. */
static void pd_parallel_for(int64_t n, int nthreads, pd_task fn, void *ctx) {
    if (nthreads > PD_MAX_WORKERS + 1) nthreads = PD_MAX_WORKERS + 1;
    if (nthreads <= 1 || n <= 1) {
        for (int64_t i = 0; i < n; i++) fn(ctx, i);
        return;
    }
    pthread_mutex_lock(&pd_pool.lock);
    while (pd_pool.started < nthreads - 1) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&t, &attr, pd_worker, (void *)(intptr_t)pd_pool.started) != 0) break;
        pthread_attr_destroy(&attr);
        pd_pool.started++;
    }
    const uint32_t gen = (uint32_t)(atomic_load(&pd_pool.work) >> 32) + 1;
    atomic_store(&pd_pool.work, (uint64_t)gen << 32 | PD_CLOSED);
    atomic_store(&pd_pool.fn, fn);
    atomic_store(&pd_pool.ctx, ctx);
    atomic_store(&pd_pool.n, n);
    atomic_store(&pd_pool.done, 0);
    atomic_store(&pd_pool.active, nthreads - 1);
    atomic_store(&pd_pool.work, (uint64_t)gen << 32);
    if (atomic_load(&pd_pool.sleepers) > 0) {
        atomic_fetch_add(&pd_pool.wake, 1);
        pd_futex_wake(&pd_pool.wake);
    }
    pd_drain(gen);
    while (atomic_load_explicit(&pd_pool.done, memory_order_acquire) < n) _mm_pause();
    pthread_mutex_unlock(&pd_pool.lock);
}

#endif
