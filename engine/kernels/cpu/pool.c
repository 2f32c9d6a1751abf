/*
 * A persistent thread pool with dynamic chunk scheduling.
 *
 * The pool keeps num_threads - 1 workers; the calling thread is the last one. A job is
 * published by bumping a generation counter; workers that see it join (a CAS on one
 * word that also counts them, so the caller knows who may still read the job), take
 * chunks from an atomic counter until none are left, and leave. The caller works too,
 * waits until every chunk has finished, closes the job against late joiners and waits
 * for the joined workers to leave; then the job's memory may go.
 *
 * Idle workers spin for a short while (TOKENMILL_SPIN_US, default 50 us: long enough to
 * catch the next kernel of a forward pass, short enough not to steal a shared core), then
 * sleep on a futex. Chunks are handed out dynamically, so on a machine shared with
 * another process the thread that runs at full speed takes more of them instead of
 * waiting for the slowed one (static splits make every kernel as slow as its slowest
 * thread).
 */
#define _GNU_SOURCE
#include "tm_cpu.h"

#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define ST_ACTIVE_BITS 16
#define ST_CLOSED ((uint64_t)1 << ST_ACTIVE_BITS)
#define ST_GEN_SHIFT (ST_ACTIVE_BITS + 1)
#define ST_ACTIVE_MASK (ST_CLOSED - 1)

typedef struct {
    tm_chunk_fn fn;
    void *ctx;
    int64_t nchunks;
    _Atomic int64_t next;
    _Atomic int64_t done;
} tm_pool_job;

static struct {
    pthread_mutex_t lock; /* serialises callers and (re)configuration */
    int num_threads;      /* workers + caller */
    int started;
    pthread_t workers[TM_MAX_THREADS];
    _Atomic uint64_t state; /* generation << 17 | closed << 16 | joined workers */
    _Atomic uint32_t wake;  /* futex word, bumped per job */
    _Atomic int sleepers;
    _Atomic int stop;
    int64_t spin_ns;
    tm_pool_job job;
} P = {.lock = PTHREAD_MUTEX_INITIALIZER};

static __thread int tm_in_pool; /* set on workers and on a caller inside a job */

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void run_chunks(tm_pool_job *j) {
    for (;;) {
        const int64_t c = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        if (c >= j->nchunks) return;
        j->fn(j->ctx, c);
        atomic_fetch_add_explicit(&j->done, 1, memory_order_release);
    }
}

static void *worker_main(void *arg) {
    (void)arg;
    tm_in_pool = 1;
    uint64_t seen_gen = atomic_load(&P.state) >> ST_GEN_SHIFT;
    for (;;) {
        /* wait for a new generation: spin, then sleep */
        uint64_t s = atomic_load_explicit(&P.state, memory_order_acquire);
        const int64_t t0 = now_ns();
        int spins = 0;
        while ((s >> ST_GEN_SHIFT) == seen_gen) {
            if (atomic_load_explicit(&P.stop, memory_order_relaxed)) return NULL;
            if (++spins < 64 || now_ns() - t0 < P.spin_ns) {
                cpu_relax();
            } else {
                const uint32_t w = atomic_load(&P.wake);
                atomic_fetch_add(&P.sleepers, 1);
                s = atomic_load_explicit(&P.state, memory_order_acquire);
                if ((s >> ST_GEN_SHIFT) == seen_gen && !atomic_load(&P.stop))
                    syscall(SYS_futex, &P.wake, FUTEX_WAIT_PRIVATE, w, NULL, NULL, 0);
                atomic_fetch_sub(&P.sleepers, 1);
                spins = 0;
            }
            s = atomic_load_explicit(&P.state, memory_order_acquire);
        }
        seen_gen = s >> ST_GEN_SHIFT;
        /* join the job unless it is already closed or replaced */
        while (!(s & ST_CLOSED) && (s >> ST_GEN_SHIFT) == seen_gen) {
            if (atomic_compare_exchange_weak_explicit(&P.state, &s, s + 1, memory_order_acq_rel,
                                                      memory_order_acquire)) {
                run_chunks(&P.job);
                atomic_fetch_sub_explicit(&P.state, 1, memory_order_release);
                break;
            }
        }
    }
}

static int detect_threads(void) {
    const char *env = getenv("TOKENMILL_NUM_THREADS");
    if (env && atoi(env) > 0) return atoi(env);
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set);
    const long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

static void stop_workers_locked(void) {
    if (!P.started) return;
    atomic_store(&P.stop, 1);
    atomic_fetch_add(&P.wake, 1);
    syscall(SYS_futex, &P.wake, FUTEX_WAKE_PRIVATE, TM_MAX_THREADS, NULL, NULL, 0);
    for (int i = 0; i < P.num_threads - 1; ++i) pthread_join(P.workers[i], NULL);
    atomic_store(&P.stop, 0);
    P.started = 0;
}

static void after_fork_in_child(void) {
    /* the child has none of the parent's workers: start anew on first use */
    pthread_mutex_init(&P.lock, NULL);
    P.started = 0;
    atomic_store(&P.state, 0);
    atomic_store(&P.sleepers, 0);
    atomic_store(&P.stop, 0);
}

static void start_locked(int n) {
    static int atfork_done;
    if (!atfork_done) {
        pthread_atfork(NULL, NULL, after_fork_in_child);
        atfork_done = 1;
    }
    if (n < 1) n = 1;
    if (n > TM_MAX_THREADS) n = TM_MAX_THREADS;
    const char *spin = getenv("TOKENMILL_SPIN_US");
    P.spin_ns = (spin ? atoll(spin) : 50) * 1000;
    P.num_threads = n;
    int ok = 1;
    for (int i = 0; i < n - 1; ++i) {
        if (pthread_create(&P.workers[i], NULL, worker_main, NULL) != 0) {
            P.num_threads = i + 1; /* run with the workers that did start */
            ok = 0;
            break;
        }
    }
    (void)ok;
    P.started = 1;
}

/* Set the number of threads (workers + caller); 0 means the CPUs this process may use
 * (or TOKENMILL_NUM_THREADS). Returns the number in effect. */
int tm_set_num_threads(int n) {
    pthread_mutex_lock(&P.lock);
    stop_workers_locked();
    start_locked(n > 0 ? n : detect_threads());
    const int r = P.num_threads;
    pthread_mutex_unlock(&P.lock);
    return r;
}

int tm_get_num_threads(void) {
    if (tm_in_pool) return P.num_threads; /* inside a job, whose caller holds the lock: fixed until it ends */
    pthread_mutex_lock(&P.lock);
    if (!P.started) start_locked(detect_threads());
    const int r = P.num_threads;
    pthread_mutex_unlock(&P.lock);
    return r;
}

/* Stop the workers (they are restarted by the next call). For fork safety and clean exits. */
void tm_shutdown(void) {
    pthread_mutex_lock(&P.lock);
    stop_workers_locked();
    pthread_mutex_unlock(&P.lock);
}

void tm_parallel_for(int64_t nchunks, tm_chunk_fn fn, void *ctx) {
    if (nchunks <= 0) return;
    if (nchunks == 1 || tm_in_pool) {
        for (int64_t c = 0; c < nchunks; ++c) fn(ctx, c);
        return;
    }
    pthread_mutex_lock(&P.lock);
    if (!P.started) start_locked(detect_threads());
    if (P.num_threads == 1) {
        pthread_mutex_unlock(&P.lock);
        for (int64_t c = 0; c < nchunks; ++c) fn(ctx, c);
        return;
    }
    tm_pool_job *j = &P.job;
    j->fn = fn;
    j->ctx = ctx;
    j->nchunks = nchunks;
    atomic_store_explicit(&j->next, 0, memory_order_relaxed);
    atomic_store_explicit(&j->done, 0, memory_order_relaxed);
    /* publish: new generation, open, nobody joined */
    const uint64_t gen = (atomic_load(&P.state) >> ST_GEN_SHIFT) + 1;
    atomic_store_explicit(&P.state, gen << ST_GEN_SHIFT, memory_order_release);
    if (atomic_load(&P.sleepers) > 0) {
        atomic_fetch_add(&P.wake, 1);
        syscall(SYS_futex, &P.wake, FUTEX_WAKE_PRIVATE, TM_MAX_THREADS, NULL, NULL, 0);
    }
    tm_in_pool = 1;
    run_chunks(j);
    tm_in_pool = 0;
    /* the last chunks may still run on workers; yield now and then, so that on a shared
     * core this wait does not take the CPU from the worker it is waiting for */
    for (int spins = 0; atomic_load_explicit(&j->done, memory_order_acquire) < nchunks; ++spins) {
        cpu_relax();
        if ((spins & 1023) == 1023) sched_yield();
    }
    /* close against late joiners, then wait for the joined ones to leave */
    uint64_t s = atomic_load(&P.state);
    while (!atomic_compare_exchange_weak(&P.state, &s, s | ST_CLOSED)) {
    }
    while (atomic_load_explicit(&P.state, memory_order_acquire) & ST_ACTIVE_MASK) cpu_relax();
    pthread_mutex_unlock(&P.lock);
}

/* ---------------------------------------------------------------- AMX permission (tm_cpu.h) */
#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#define TM_ARCH_GET_XCOMP_PERM 0x1022 /* <asm/prctl.h>, Linux 5.16 */
#define TM_ARCH_REQ_XCOMP_PERM 0x1023
#define TM_XFEATURE_XTILEDATA 18

static int amx_units;
static pthread_once_t amx_once = PTHREAD_ONCE_INIT;

static void amx_detect(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24))) return;
    const int units = ((d >> 25) & 1u ? TM_AMX_UNIT_INT8 : 0) | ((d >> 22) & 1u ? TM_AMX_UNIT_BF16 : 0);
    if (!units || syscall(SYS_arch_prctl, TM_ARCH_REQ_XCOMP_PERM, TM_XFEATURE_XTILEDATA) != 0) return;
    unsigned long perm = 0;
    if (syscall(SYS_arch_prctl, TM_ARCH_GET_XCOMP_PERM, &perm) != 0 || !(perm & (1ul << TM_XFEATURE_XTILEDATA)))
        return;
    amx_units = units;
}

int tm_amx_usable(void) {
    pthread_once(&amx_once, amx_detect);
    return amx_units;
}
#else
int tm_amx_usable(void) { return 0; }
#endif

int tm_amx_switch(_Atomic int *state, int mode, int unit) {
    if (mode >= 0) {
        atomic_store(state, mode && (tm_amx_usable() & unit));
    } else if (atomic_load_explicit(state, memory_order_relaxed) < 0) {
        const char *env = getenv("TOKENMILL_AMX");
        int undecided = -1;
        atomic_compare_exchange_strong(state, &undecided, !(env && strcmp(env, "0") == 0) && (tm_amx_usable() & unit));
    }
    return atomic_load_explicit(state, memory_order_relaxed);
}
