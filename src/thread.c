/* thread.c - the scaffolding of outofcuda's native threads (monitor.c's
 * watchdogs, summary.c's sampler).
 *
 * Each thread starts with every signal blocked, so Ctrl-C and every other
 * signal stay with the main thread (as faulthandler's watchdog does). It
 * sleeps on a condition variable on CLOCK_MONOTONIC, so a change of the wall
 * clock neither wakes it early nor keeps it asleep, and the owner's stop
 * request wakes it at once. The lock, condition variable and thread belong
 * to the process that made them: a copy inherited through fork() has no
 * thread and may hold a lock that the parent's thread had taken, so its
 * owner gives it fresh primitives (oc_thread_inherited, oc_thread_init)
 * before any other use. Threads are joined, never detached by default. */
#include "oc.h"

#include <pthread.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

void oc_thread_init(oc_thread *t)
{
    pthread_condattr_t ca;
    pthread_mutex_init(&t->lock, NULL);
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&t->wake, &ca);
    pthread_condattr_destroy(&ca);
    t->pid = getpid();
}

void oc_thread_destroy(oc_thread *t)
{
    pthread_mutex_destroy(&t->lock);
    pthread_cond_destroy(&t->wake);
}

int oc_thread_inherited(const oc_thread *t)
{
    return t->pid != getpid();
}

int oc_thread_start(oc_thread *t, void *(*fn)(void *), void *arg, const char *name)
{
    sigset_t all, old;
    int rc;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    rc = pthread_create(&t->thread, NULL, fn, arg);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
#ifdef __linux__
    /* Named before start returns, so `top -H` and tests see it at once. */
    if (rc == 0 && name != NULL)
        pthread_setname_np(t->thread, name);
#else
    (void)name;
#endif
    return rc;
}

void oc_thread_request_stop(oc_thread *t, int *stop_requested)
{
    pthread_mutex_lock(&t->lock);
    *stop_requested = 1;
    pthread_cond_signal(&t->wake);
    pthread_mutex_unlock(&t->lock);
}

struct timespec oc_thread_deadline(long long seconds, long nanoseconds)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_sec += (time_t)seconds;
    ts.tv_nsec += nanoseconds < 0 ? 0 : nanoseconds > 999999999L ? 999999999L : nanoseconds;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    return ts;
}

void oc_thread_wait(oc_thread *t, const int *stop_requested, const struct timespec *deadline)
{
    /* A wake-up with rc 0 may be spurious: wait again. Every error
     * (ETIMEDOUT, or EINVAL from a bad deadline) ends the wait, so a failing
     * wait can never spin holding the lock. */
    while (!*stop_requested)
        if (pthread_cond_timedwait(&t->wake, &t->lock, deadline) != 0)
            break;
}

int oc_thread_join(pthread_t thread, long limit_ms)
{
#ifdef __GLIBC__
    struct timespec limit;
    if (limit_ms > 0) {
        clock_gettime(CLOCK_REALTIME, &limit);
        limit.tv_nsec += limit_ms % 1000 * 1000000L;
        limit.tv_sec += limit_ms / 1000 + limit.tv_nsec / 1000000000L;
        limit.tv_nsec %= 1000000000L;
        return pthread_timedjoin_np(thread, NULL, &limit) == 0;
    }
#else
    (void)limit_ms;
#endif
    return pthread_join(thread, NULL) == 0;
}

double oc_thread_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}
