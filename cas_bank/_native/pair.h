/* The partner: one native thread that takes half of a read or a copy beside the
 * thread that asked for it (cas_bank._fill's read_pair and copy_pair).
 *
 * `pair_run(run, arg)` hands `run(arg)` to the partner if it is free, runs it on the
 * calling thread too, and returns once both are done: `run` must take its work from
 * a source both share (an atomic counter) until none is left. A call the partner has
 * not begun by the time the caller is done is taken back (the caller did it all); a
 * partner busy with another caller's call leaves this one to its caller alone.
 *
 * It replaces, for these calls, the Python helper of cas_bank.restore.workers.together:
 * no ticket, no GIL to hand over on either side (the partner never takes it), so the
 * partner starts as soon as it wakes and the caller hears at once that it is done.
 * Measured there: `together` cost a cold 1k-token restore ~60 us before its own
 * half began and ~40 after it ended.
 *
 * Linux: the partner is kept off the CPU the calling thread is on (one
 * sched_setaffinity, only when that CPU changed since the last call), for the reason
 * cas_bank/restore/workers.py gives: woken onto the waker's own CPU, both halves shared
 * one CPU until the load balancer moved one. It starts with the CPUs the module was
 * imported with (`pair_init`), not those of the thread that first calls, which may be
 * pinned. A forked child starts its own partner (the parent's is not there).
 */
#ifndef CAS_BANK_PAIR_H
#define CAS_BANK_PAIR_H

#if defined(__linux__) && !defined(_GNU_SOURCE)
#define _GNU_SOURCE
#endif
#include <pthread.h>
#include <stddef.h>
#if defined(__linux__)
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

typedef struct pair_job {
  void (*run)(void *);
  void *arg;
  int done; /* the partner finished it */
} pair_job;

static pthread_mutex_t pair_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pair_go = PTHREAD_COND_INITIALIZER;   /* a job is pending */
static pthread_cond_t pair_fin = PTHREAD_COND_INITIALIZER;  /* a job is done, or started */
static pair_job *pair_pending = NULL; /* handed over, not begun */
static int pair_state = 0;            /* 0 none, 1 running (in this process), -1 cannot start */
static int pair_busy = 0;             /* running a job */
static long pair_tid = 0;             /* its thread id (Linux), once running */
#if defined(__linux__)
static cpu_set_t pair_cpus; /* the CPUs it may use, less the caller's */
static int pair_have_cpus = 0;
static int pair_kept_off = -1;
#endif

static void *pair_main(void *unused) {
  (void)unused;
  pthread_mutex_lock(&pair_mu);
#if defined(__linux__)
  pair_tid = (long)syscall(SYS_gettid);
#else
  pair_tid = 1;
#endif
  pthread_cond_broadcast(&pair_fin);
  for (;;) {
    while (pair_pending == NULL) pthread_cond_wait(&pair_go, &pair_mu);
    pair_job *job = pair_pending;
    pair_pending = NULL;
    pair_busy = 1;
    pthread_mutex_unlock(&pair_mu);
    job->run(job->arg);
    pthread_mutex_lock(&pair_mu);
    job->done = 1;
    pair_busy = 0;
    pthread_cond_broadcast(&pair_fin);
  }
  return NULL;
}

/* A forked child has no partner (only the forking thread exists there). */
static void pair_prefork(void) { pthread_mutex_lock(&pair_mu); }
static void pair_postfork_parent(void) { pthread_mutex_unlock(&pair_mu); }
static void pair_postfork_child(void) {
  pthread_mutex_init(&pair_mu, NULL);
  pthread_cond_init(&pair_go, NULL);
  pthread_cond_init(&pair_fin, NULL);
  pair_pending = NULL;
  pair_state = 0;
  pair_busy = 0;
  pair_tid = 0;
#if defined(__linux__)
  pair_kept_off = -1;
#endif
}

/* Once, when the module is loaded: the CPUs the partner starts with, and the fork
 * handlers. */
static void pair_init(void) {
#if defined(__linux__)
  pair_have_cpus = sched_getaffinity(0, sizeof pair_cpus, &pair_cpus) == 0;
#endif
  (void)pthread_atfork(pair_prefork, pair_postfork_parent, pair_postfork_child);
}

/* Start the partner if it is not running (pair_mu held); whether it runs. */
static int pair_ready_locked(void) {
  if (pair_state != 0) return pair_state > 0;
  pthread_attr_t attr;
  pthread_t thread;
  pair_state = -1;
  if (pthread_attr_init(&attr) != 0) return 0;
  (void)pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
#if defined(__linux__) && defined(__GLIBC__)
  if (pair_have_cpus) (void)pthread_attr_setaffinity_np(&attr, sizeof pair_cpus, &pair_cpus);
#endif
  if (pthread_create(&thread, &attr, pair_main, NULL) == 0) {
    pair_state = 1;
    while (pair_tid == 0) pthread_cond_wait(&pair_fin, &pair_mu);
  }
  (void)pthread_attr_destroy(&attr);
  return pair_state > 0;
}

/* Keep the partner off the calling thread's CPU (pair_mu held). */
static void pair_keep_off_locked(void) {
#if defined(__linux__)
  int cpu = sched_getcpu();
  if (!pair_have_cpus || cpu < 0 || cpu == pair_kept_off || cpu >= CPU_SETSIZE) return;
  cpu_set_t mask = pair_cpus;
  CPU_CLR(cpu, &mask);
  if (CPU_COUNT(&mask) == 0) return; /* nowhere else to go */
  if (sched_setaffinity((pid_t)pair_tid, sizeof mask, &mask) == 0) pair_kept_off = cpu;
#endif
}

/* run(arg) on this thread and, if it is free, on the partner at once (see above). */
static void pair_run(void (*run)(void *), void *arg) {
  pair_job job = {run, arg, 0};
  int handed = 0;
  pthread_mutex_lock(&pair_mu);
  if (pair_ready_locked() && !pair_busy && pair_pending == NULL) {
    pair_keep_off_locked();
    pair_pending = &job;
    handed = 1;
    pthread_cond_signal(&pair_go);
  }
  pthread_mutex_unlock(&pair_mu);
  run(arg);
  if (!handed) return;
  pthread_mutex_lock(&pair_mu);
  if (pair_pending == &job) {
    pair_pending = NULL; /* never begun: this thread did it all */
  } else {
    while (!job.done) pthread_cond_wait(&pair_fin, &pair_mu);
  }
  pthread_mutex_unlock(&pair_mu);
}

/* The partner's thread id (Linux; 0 until it first ran). */
static long pair_thread_id(void) {
  pthread_mutex_lock(&pair_mu);
  long tid = pair_tid;
  pthread_mutex_unlock(&pair_mu);
  return tid;
}

#endif /* CAS_BANK_PAIR_H */
