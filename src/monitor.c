/* monitor.c - the native watchdog behind MemoryMonitor.
 *
 * One pthread per monitor polls the device's memory through NVML (no CUDA
 * context, so it cannot create one on the wrong GPU) without the GIL. Only
 * when usage crosses the threshold does it take the GIL, to empty torch's
 * cache and call the user's on_high. Like faulthandler's watchdog it blocks
 * every signal (Ctrl-C stays with the main thread), waits on a condition
 * variable so stop() wakes it at once, and is joined, never detached.
 *
 * The Python side holds each monitor through a capsule; module functions
 * (not a type) keep `import _outofcuda` cheap. Every monitor is also on a
 * list that _monitor_stop_all(True) walks at interpreter exit. A forked child
 * sees its pid differ from the owner's and treats the copy as stopped.
 *
 * Because the thread runs Python code (on_high, gc.collect()), it can stop,
 * drop or collect its own monitor, or another monitor whose thread is busy
 * stopping this one. So the struct is reference-counted (the capsule holds
 * one reference, a running thread the other; the last one frees it), and a
 * watchdog thread never joins a thread: it asks it to stop and leaves the
 * join to the next non-watchdog caller (stop(), start(), interpreter exit).
 * No thread waits on another watchdog, so no two can wait on each other.
 *
 * Locks: the GIL may be held when taking a monitor's lock, never the other
 * way round; the thread takes the GIL only with no lock held. */
#include "oc.h"

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define CAPSULE_NAME "_outofcuda.monitor"
#define EVENTS_MAX 256
/* The longest wait between polls the thread accepts (one day): longer
 * intervals are clamped, so a deadline never overflows time_t. The Python
 * layer refuses them with a ValueError. */
#define INTERVAL_MAX_S 86400.0
/* The shortest: a shorter interval is raised to it (the Python layer does
 * the same), so the thread never spins a core on NVML. */
#define INTERVAL_MIN_S 0.01

typedef struct {
    double t;
    long long used, total, process, reserved, allocated;
} mon_sample;

typedef struct {
    double t;
    int error; /* 0: cleared above the threshold; 1: on_high raised */
    long long used, total, used_after, released;
    char message[200];
} mon_event;

typedef struct oc_monitor {
    atomic_int refs;                  /* the capsule's and the running thread's; last frees */
    oc_thread th;                     /* th.lock guards everything below that the thread writes */
    int running;                      /* a thread was started and not asked to stop (GIL) */
    int stop_requested;               /* under lock */
    int thread_started, thread_ended; /* under lock; ended: it dropped its reference */
    int torch_index, nvml_index, allocator_stats;
    double threshold, interval, cooldown, t0;
    PyObject *on_high; /* strong ref or NULL; touched only with the GIL */
    char source[512];  /* test source file ("used total [process]") or "" */
    char why[240];     /* why nothing is watched, or "" */
    mon_sample *ring;
    size_t cap, head, count;
    unsigned long long dropped;
    mon_event events[EVENTS_MAX];
    size_t ev_head, ev_count;
    struct oc_monitor *next; /* every live monitor; changed only with the GIL */
} oc_monitor;

/* The monitors' state: the watchdog threads it serves run without the
 * GIL. */
static oc_monitor *all_monitors;

/* Threads asked to stop by a watchdog thread, which must not join them: the
 * next non-watchdog caller joins them. Guarded by the GIL. */
typedef struct {
    pthread_t thread;
    pid_t pid;
} pending_join;
static pending_join *pending;
static size_t pending_n, pending_cap;

/* Set by _monitor_stop_all(True) at interpreter exit: from then on no thread
 * starts, so none can take the GIL once finalisation has begun. */
static atomic_int shutting_down;

/* 1 in a watchdog thread, which never joins a thread. */
static _Thread_local int in_watchdog;

/* Whether the interpreter has begun finalising; 0 where it cannot tell.
 * Py_IsFinalizing (3.13) and _Py_IsFinalizing (3.9 - 3.12) are outside the
 * Limited API, so they are looked up at run time and used only when present:
 * a second guard behind _monitor_stop_all(True), for an exit that skips atexit
 * handlers. The first call (py_monitor_start, with the GIL, before any
 * thread exists) looks it up; later calls are safe without the GIL. */
static int interpreter_finalizing(void)
{
    static int (*is_finalizing)(void);
    static atomic_int looked_up;
    if (!atomic_load(&looked_up)) {
        void *f = dlsym(RTLD_DEFAULT, "Py_IsFinalizing");
        if (f == NULL)
            f = dlsym(RTLD_DEFAULT, "_Py_IsFinalizing");
        /* A function pointer through void *: POSIX guarantees it for dlsym. */
        memcpy(&is_finalizing, &f, sizeof f);
        atomic_store(&looked_up, 1);
    }
    return is_finalizing != NULL && is_finalizing();
}

/* Frees m's memory. Called by whoever drops the last reference, the thread
 * included, so it touches no Python object (on_high is cleared before the
 * capsule's reference is dropped). */
static void monitor_free(oc_monitor *m)
{
    oc_thread_destroy(&m->th);
    free(m->ring);
    free(m);
}

/* Drops one reference to m (the capsule's or the thread's); frees it on the
 * last. Any thread, GIL or not. */
static void monitor_release(oc_monitor *m)
{
    if (atomic_fetch_sub(&m->refs, 1) == 1)
        monitor_free(m);
}

/* A copy inherited through fork() has no thread and may hold a lock that
 * the parent's thread had taken: give it fresh primitives, mark it stopped,
 * and drop the reference of a thread that does not exist here (unless that
 * thread had already dropped it when the process forked). Called with the
 * GIL, before any other use of m. */
static void adopt_after_fork(oc_monitor *m)
{
    if (!oc_thread_inherited(&m->th))
        return;
    oc_thread_init(&m->th);
    if (m->running)
        snprintf(m->why, sizeof m->why, "inherited across fork(): not running in this process");
    if (m->thread_started && !m->thread_ended) {
        m->thread_ended = 1;
        atomic_fetch_sub(&m->refs, 1); /* the capsule's reference remains */
    }
    m->running = 0;
    m->stop_requested = 1;
}

/* Joins every thread left by a watchdog's stop(), with the GIL released
 * (a thread may still need it to finish). Called with the GIL, never from a
 * watchdog thread; threads inherited across fork() are forgotten. */
static void join_pending(void)
{
    pending_join *list = pending;
    size_t n = pending_n;
    /* Once finalising, a thread waiting for the GIL never gets it. */
    if (in_watchdog || n == 0 || interpreter_finalizing())
        return;
    pending = NULL;
    pending_n = pending_cap = 0;
    Py_BEGIN_ALLOW_THREADS
    for (size_t i = 0; i < n; i++)
        if (list[i].pid == getpid())
            oc_thread_join(list[i].thread, 0);
    Py_END_ALLOW_THREADS
    free(list);
}

/* Leaves thread t, already asked to stop, for join_pending(); detaches it
 * when the list cannot grow (it still ends on its own). GIL held. */
static void defer_join(pthread_t t)
{
    if (pending_n == pending_cap) {
        size_t cap = pending_cap ? 2 * pending_cap : 8;
        pending_join *grown = realloc(pending, cap * sizeof *grown);
        if (grown == NULL) {
            pthread_detach(t);
            return;
        }
        pending = grown;
        pending_cap = cap;
    }
    pending[pending_n].thread = t;
    pending[pending_n].pid = getpid();
    pending_n++;
}

/* ---- the watchdog thread (no Python object is touched without the GIL) ---- */

/* Reads one sample from the test source file or NVML. Returns 0 or -1. */
static int read_memory(oc_monitor *m, mon_sample *s)
{
    oc_gpu_info g;
    oc_gpu_proc *procs;
    int n;
    s->process = s->reserved = s->allocated = -1;
    if (m->source[0]) {
        FILE *f = fopen(m->source, "r");
        if (f == NULL)
            return -1;
        n = fscanf(f, "%lld %lld %lld", &s->used, &s->total, &s->process);
        fclose(f);
        if (n < 3)
            s->process = -1;
        return n >= 2 && s->total > 0 ? 0 : -1;
    }
    if (oc_nvml_device_info(m->nvml_index, &g) != 0 || g.total == 0)
        return -1;
    s->used = (long long)g.used;
    s->total = (long long)g.total;
    /* The whole list: on a busy GPU this process may come after the
     * first few dozen entries. */
    n = oc_nvml_process_list(m->nvml_index, &procs);
    for (int i = 0; i < n; i++)
        if (procs[i].pid == (unsigned int)getpid() && procs[i].used != OC_NVML_NOT_AVAILABLE)
            s->process = (long long)procs[i].used;
    free(procs);
    return 0;
}

/* Appends item to a ring of cap items of `size` bytes, dropping the oldest
 * when it is full. Returns 1 when it dropped one. */
static int ring_push(void *ring, size_t *head, size_t *count, size_t cap, size_t size,
                     const void *item)
{
    memcpy((char *)ring + ((*head + *count) % cap) * size, item, size);
    if (*count < cap) {
        (*count)++;
        return 0;
    }
    *head = (*head + 1) % cap;
    return 1;
}

/* One event as a dict; also ring_list's item for the events ring. */
static PyObject *event_dict(const oc_monitor *m, const void *x)
{
    const mon_event *e = x;
    return Py_BuildValue("{s:d,s:s,s:i,s:L,s:L,s:d,s:L,s:L,s:s}", "time", e->t, "kind",
                         e->error ? "on_high_error" : "high", "device", m->torch_index, "used",
                         e->used, "total", e->total, "fraction",
                         e->total > 0 ? (double)e->used / (double)e->total : 0.0, "used_after",
                         e->used_after, "released", e->released, "message", e->message);
}

/* Whether the thread should stop: stop() asked, or the interpreter is
 * going away (no GIL may be taken then). Takes m's lock; any thread. */
static int should_stop(oc_monitor *m)
{
    int stop;
    pthread_mutex_lock(&m->th.lock);
    stop = m->stop_requested;
    pthread_mutex_unlock(&m->th.lock);
    return stop || atomic_load(&shutting_down) || interpreter_finalizing();
}

/* Calls on_high(event) with the GIL held, through a reference of its own:
 * the callback may stop or drop the monitor, which clears m->on_high. An
 * exception is recorded in *err and reported as unraisable. */
static void call_on_high(oc_monitor *m, const mon_event *e, mon_event *err)
{
    PyObject *cb = m->on_high, *d, *r;
    if (cb == NULL)
        return;
    Py_INCREF(cb);
    d = event_dict(m, e);
    r = d ? PyObject_CallFunctionObjArgs(cb, d, NULL) : NULL;
    Py_XDECREF(d);
    if (r == NULL) {
        PyObject *t, *v, *tb, *text;
        *err = *e;
        err->error = 1;
        PyErr_Fetch(&t, &v, &tb);
        text = v ? PyObject_Str(v) : NULL;
        snprintf(err->message, sizeof err->message, "on_high raised: %s",
                 text ? oc_utf8(text, (char[160]){0}, 160) : "?");
        Py_XDECREF(text);
        OC_CLEAR();
        PyErr_Restore(t, v, tb);
        /* The caller's thread cannot catch it: report it the way Python
         * reports errors in callbacks nobody awaits. */
        PyErr_WriteUnraisable(cb);
    }
    Py_XDECREF(r);
    Py_DECREF(cb);
}

/* Above the threshold: empty the cache and call on_high, with the GIL, each
 * step only while the monitor is not stopping. The thread holds its own
 * reference to m, so m outlives whatever the Python code here frees. */
static void act_on_high(oc_monitor *m, const mon_sample *s)
{
    mon_event e = {.t = s->t, .used = s->used, .total = s->total}, err = {0};
    mon_sample after;
    PyGILState_STATE gil;
    if (should_stop(m))
        return;
    gil = PyGILState_Ensure();
    if (oc_api_clear_cache(&e.released) < 0) {
        OC_CLEAR();
        snprintf(e.message, sizeof e.message, "emptying the cache failed");
    }
    PyGILState_Release(gil);
    /* NVML again, without the GIL: what the device holds after clearing. */
    e.used_after = read_memory(m, &after) == 0 ? after.used : -1;
    if (!e.message[0])
        snprintf(e.message, sizeof e.message, "%.1f%% >= threshold %.1f%%: cache emptied",
                 100.0 * (double)e.used / (double)e.total, 100.0 * m->threshold);
    if (!should_stop(m)) {
        gil = PyGILState_Ensure();
        call_on_high(m, &e, &err);
        PyGILState_Release(gil);
    }
    pthread_mutex_lock(&m->th.lock);
    ring_push(m->events, &m->ev_head, &m->ev_count, EVENTS_MAX, sizeof e, &e);
    if (err.error)
        ring_push(m->events, &m->ev_head, &m->ev_count, EVENTS_MAX, sizeof err, &err);
    pthread_mutex_unlock(&m->th.lock);
}

/* Reads torch's allocator figures (with the GIL) into s when asked to, and
 * not while the monitor is stopping. */
static void read_allocator(oc_monitor *m, mon_sample *s)
{
    oc_torch_mem t;
    PyGILState_STATE gil;
    if (should_stop(m))
        return;
    gil = PyGILState_Ensure();
    if (oc_api_torch_stats(m->torch_index, &t)) {
        s->reserved = t.reserved;
        s->allocated = t.allocated;
    }
    PyGILState_Release(gil);
}

/* Sleeps until the next poll is due or stop() wakes it. Called with m's lock
 * held; returns with it held. The deadline is computed from an interval
 * clamped at start, so it cannot overflow; any error from the wait ends it
 * (only a wake-up before the deadline waits again), so a failing wait can
 * never spin holding the lock. */
static void wait_next_poll(oc_monitor *m)
{
    long long whole = (long long)m->interval;
    struct timespec deadline =
        oc_thread_deadline(whole, (long)((m->interval - (double)whole) * 1e9));
    oc_thread_wait(&m->th, &m->stop_requested, &deadline);
}

/* The thread: polls until asked to stop, then drops its reference to m
 * (freeing it when the capsule is already gone) and ends. */
static void *watchdog(void *arg)
{
    oc_monitor *m = arg;
    int armed = 1;
    double last_action = -1e300;
    in_watchdog = 1;
    pthread_mutex_lock(&m->th.lock);
    while (!m->stop_requested) {
        mon_sample s;
        pthread_mutex_unlock(&m->th.lock);
        s.t = oc_thread_now() - m->t0;
        if (read_memory(m, &s) == 0) {
            int high = (double)s.used >= m->threshold * (double)s.total;
            if (m->allocator_stats)
                read_allocator(m, &s);
            pthread_mutex_lock(&m->th.lock);
            m->dropped += ring_push(m->ring, &m->head, &m->count, m->cap, sizeof s, &s);
            pthread_mutex_unlock(&m->th.lock);
            /* Act on each upward crossing, and again while it stays high only
             * after `cooldown`: empty_cache() in a loop slows training. */
            if (high && (armed || s.t - last_action >= m->cooldown)) {
                armed = 0;
                last_action = s.t;
                act_on_high(m, &s);
            } else if (!high) {
                armed = 1;
            }
        }
        pthread_mutex_lock(&m->th.lock);
        if (atomic_load(&shutting_down) || interpreter_finalizing())
            m->stop_requested = 1;
        wait_next_poll(m);
    }
    m->thread_ended = 1;
    pthread_mutex_unlock(&m->th.lock);
    monitor_release(m);
    return NULL;
}

/* ---- lifecycle ---- */

/* Asks m's thread to stop and joins it with the GIL released (the thread
 * may be waiting for the GIL). From a watchdog thread (on_high, or a
 * gc.collect() that frees a monitor), and once the interpreter finalises,
 * it does not wait: the join is left to join_pending(). Afterwards on_high
 * is never called again. Idempotent; GIL held; m stays valid (the caller
 * holds the capsule's reference). */
static void monitor_stop(oc_monitor *m)
{
    pthread_t t;
    adopt_after_fork(m);
    if (!m->running) {
        join_pending();
        return;
    }
    m->running = 0;
    t = m->th.thread;
    oc_thread_request_stop(&m->th, &m->stop_requested);
    /* Drops a likely reference cycle (on_high -> MemoryMonitor -> capsule). */
    Py_CLEAR(m->on_high);
    if (in_watchdog || interpreter_finalizing()) {
        defer_join(t);
        return;
    }
    Py_BEGIN_ALLOW_THREADS
    oc_thread_join(t, 0);
    Py_END_ALLOW_THREADS
    join_pending();
}

/* The capsule's destructor, from whichever thread drops the last reference
 * (a watchdog's own included): stops the thread, unlists m, and drops the
 * capsule's reference; the thread frees m if it still runs. GIL held. */
static void capsule_free(PyObject *capsule)
{
    oc_monitor *m = PyCapsule_GetPointer(capsule, CAPSULE_NAME), **pp;
    if (m == NULL) {
        OC_CLEAR();
        return;
    }
    monitor_stop(m);
    for (pp = &all_monitors; *pp; pp = &(*pp)->next) {
        if (*pp == m) {
            *pp = m->next;
            break;
        }
    }
    Py_CLEAR(m->on_high);
    monitor_release(m);
}

static oc_monitor *get_monitor(PyObject *capsule)
{
    oc_monitor *m = PyCapsule_GetPointer(capsule, CAPSULE_NAME);
    if (m != NULL)
        adopt_after_fork(m);
    return m;
}

/* Starts the thread with every signal blocked, handing it a reference to
 * m. Returns 0 or an errno (then m keeps only the capsule's reference). */
static int spawn(oc_monitor *m)
{
    int rc;
    atomic_fetch_add(&m->refs, 1);
    m->thread_started = 1;
    rc = oc_thread_start(&m->th, watchdog, m, NULL);
    if (rc != 0) {
        m->thread_started = 0;
        atomic_fetch_sub(&m->refs, 1);
    }
    return rc;
}

/* _monitor_start(device, threshold, interval, cooldown, on_high, capacity,
 * allocator_stats) -> capsule; the test door's monitor_start takes a source
 * file last ("used total [process]") read instead of NVML. Arguments are
 * validated by the Python
 * layer; here NaN and out-of-range values raise ValueError and an interval
 * above INTERVAL_MAX_S (inf included) is clamped to it. Without a device to
 * watch, or once the interpreter is shutting down, the capsule holds a
 * stopped monitor whose info()["why"] says why. */
static PyObject *monitor_start(PyObject *args, int with_source)
{
    oc_monitor *m = NULL;
    PyObject *on_high, *capsule = NULL;
    const char *source = "";
    Py_ssize_t capacity;
    int device, alloc_stats, rc;
    double threshold, interval, cooldown;
    if (!(with_source
              ? PyArg_ParseTuple(args, "idddOnps:monitor_start", &device, &threshold, &interval,
                                 &cooldown, &on_high, &capacity, &alloc_stats, &source)
              : PyArg_ParseTuple(args, "idddOnp:_monitor_start", &device, &threshold, &interval,
                                 &cooldown, &on_high, &capacity, &alloc_stats)))
        return NULL;
    if (!(threshold > 0.0 && threshold <= 1.0) || !(interval > 0.0) || !(cooldown >= 0.0) ||
        capacity < 1 || (size_t)capacity > SIZE_MAX / sizeof(mon_sample) || device < 0 ||
        strlen(source) >= sizeof m->source) {
        PyErr_SetString(PyExc_ValueError, "_monitor_start: argument out of range");
        return NULL;
    }
    join_pending();
    /* Looked up here, with the GIL, before any thread reads it. */
    (void)interpreter_finalizing();
    m = calloc(1, sizeof *m);
    if (m == NULL)
        return PyErr_NoMemory();
    m->ring = calloc((size_t)capacity, sizeof *m->ring);
    if (m->ring == NULL) {
        free(m);
        return PyErr_NoMemory();
    }
    atomic_init(&m->refs, 1);
    oc_thread_init(&m->th);
    m->cap = (size_t)capacity;
    m->torch_index = device;
    m->threshold = threshold;
    m->interval = interval < INTERVAL_MIN_S   ? INTERVAL_MIN_S
                  : interval < INTERVAL_MAX_S ? interval
                                              : INTERVAL_MAX_S;
    m->cooldown = cooldown;
    m->allocator_stats = alloc_stats;
    snprintf(m->source, sizeof m->source, "%s", source);
    if (on_high != Py_None) {
        Py_INCREF(on_high);
        m->on_high = on_high;
    }
    m->next = all_monitors;
    all_monitors = m;
    capsule = PyCapsule_New(m, CAPSULE_NAME, capsule_free);
    if (capsule == NULL) {
        all_monitors = m->next;
        Py_CLEAR(m->on_high);
        monitor_free(m);
        return NULL;
    }
    if (atomic_load(&shutting_down)) {
        snprintf(m->why, sizeof m->why, "the interpreter is shutting down");
        return capsule;
    }
    m->nvml_index = m->source[0] ? 0 : oc_nvml_index(device);
    if (m->nvml_index < 0) {
        char why[200] = "";
        if (!oc_nvml_available(why, sizeof why))
            snprintf(m->why, sizeof m->why, "no GPU to watch: %s", why);
        else
            snprintf(m->why, sizeof m->why, "no GPU to watch: cuda:%d is not a visible device",
                     device);
        return capsule;
    }
    m->t0 = oc_thread_now();
    rc = spawn(m);
    if (rc != 0) {
        Py_DECREF(capsule);
        errno = rc;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    m->running = 1;
    return capsule;
}

/* _monitor_stop(capsule) -> None: stops and joins (from a watchdog thread:
 * stops, and the join follows later); idempotent. */
static PyObject *py_monitor_stop(PyObject *self, PyObject *capsule)
{
    oc_monitor *m = get_monitor(capsule);
    (void)self;
    if (m == NULL)
        return NULL;
    monitor_stop(m);
    Py_RETURN_NONE;
}

/* Stops every running monitor; returns how many were running. The list may
 * change while a join has the GIL released, so each stop starts the walk
 * again (a stopped monitor is skipped, so the walk ends). GIL held. */
static int stop_all(void)
{
    int n = 0;
    oc_monitor *m = all_monitors;
    while (m != NULL) {
        adopt_after_fork(m);
        if (m->running) {
            monitor_stop(m);
            n++;
            m = all_monitors;
        } else {
            m = m->next;
        }
    }
    join_pending();
    return n;
}

/* _monitor_stop_all(shutdown=False) -> int: stops every running monitor;
 * returns how many were running. shutdown=True is the atexit handler: it
 * joins every thread while Python still runs, and from then on no thread
 * starts, so no watchdog takes the GIL during finalisation. */
static PyObject *py_monitor_stop_all(PyObject *self, PyObject *args)
{
    int shutdown = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "|p", &shutdown))
        return NULL;
    if (shutdown)
        atomic_store(&shutting_down, 1);
    return PyLong_FromLong(stop_all());
}

/* _monitor_info(capsule) -> dict(running, why, dropped, nvml_index, count,
 * interval: the seconds between polls, clamped). */
static PyObject *py_monitor_info(PyObject *self, PyObject *capsule)
{
    oc_monitor *m = get_monitor(capsule);
    unsigned long long dropped;
    size_t count;
    (void)self;
    if (m == NULL)
        return NULL;
    pthread_mutex_lock(&m->th.lock);
    dropped = m->dropped;
    count = m->count;
    pthread_mutex_unlock(&m->th.lock);
    return Py_BuildValue("{s:O,s:s,s:K,s:i,s:n,s:d}", "running", m->running ? Py_True : Py_False,
                         "why", m->why, "dropped", dropped, "nvml_index", m->nvml_index, "count",
                         (Py_ssize_t)count, "interval", m->interval);
}

/* One ring's items, oldest first, as a new list of item(m, x) (NULL with an
 * exception). The items are copied under m's lock, and the Python objects
 * built after it is released, so no Python code runs while it is held. */
static PyObject *ring_list(oc_monitor *m, const void *ring, const size_t *head, const size_t *count,
                           size_t cap, size_t size,
                           PyObject *(*item)(const oc_monitor *m, const void *x))
{
    size_t n;
    char *copy = malloc(cap * size);
    PyObject *list;
    if (copy == NULL)
        return PyErr_NoMemory();
    pthread_mutex_lock(&m->th.lock);
    n = *count;
    for (size_t i = 0; i < n; i++)
        memcpy(copy + i * size, (const char *)ring + ((*head + i) % cap) * size, size);
    pthread_mutex_unlock(&m->th.lock);
    list = PyList_New(0);
    for (size_t i = 0; list != NULL && i < n; i++) {
        PyObject *x = item(m, copy + i * size);
        if (x == NULL || PyList_Append(list, x) < 0)
            Py_CLEAR(list);
        Py_XDECREF(x);
    }
    free(copy);
    return list;
}

static PyObject *sample_tuple(const oc_monitor *m, const void *x)
{
    const mon_sample *s = x;
    (void)m;
    return Py_BuildValue("(dLLNNN)", s->t, s->used, s->total, oc_none_or_ll(s->process),
                         oc_none_or_ll(s->reserved), oc_none_or_ll(s->allocated));
}

/* _monitor_samples(capsule) -> [(time, used, total, process, reserved,
 * allocated)], oldest first; None where a figure was not read. */
static PyObject *py_monitor_samples(PyObject *self, PyObject *capsule)
{
    oc_monitor *m = get_monitor(capsule);
    (void)self;
    if (m == NULL)
        return NULL;
    return ring_list(m, m->ring, &m->head, &m->count, m->cap, sizeof(mon_sample), sample_tuple);
}

/* _monitor_events(capsule) -> [dict], oldest first (the last 256 kept). */
static PyObject *py_monitor_events(PyObject *self, PyObject *capsule)
{
    oc_monitor *m = get_monitor(capsule);
    (void)self;
    if (m == NULL)
        return NULL;
    return ring_list(m, m->events, &m->ev_head, &m->ev_count, EVENTS_MAX, sizeof(mon_event),
                     event_dict);
}

static PyObject *py_monitor_start(PyObject *self, PyObject *args)
{
    (void)self;
    return monitor_start(args, 0);
}

static PyObject *py_testing_monitor_start(PyObject *self, PyObject *args)
{
    (void)self;
    return monitor_start(args, 1);
}

OC_EDGE_VARARGS(py_monitor_start)
OC_EDGE_O(py_monitor_stop)
OC_EDGE_VARARGS(py_monitor_stop_all)
OC_EDGE_O(py_monitor_info)
OC_EDGE_O(py_monitor_samples)
OC_EDGE_O(py_monitor_events)
OC_EDGE_VARARGS(py_testing_monitor_start)

/* Behind the test door (_outofcuda._testing, module.c). */
PyMethodDef oc_monitor_testing_methods[] = {
    OC_METHOD("monitor_start", py_testing_monitor_start,
              "monitor_start(device, threshold, interval, cooldown, on_high, capacity, "
              "allocator_stats, source, /)\n--\n\n_monitor_start reading the file `source` "
              "instead of NVML."),
    {NULL, NULL, 0, NULL},
};

PyMethodDef oc_monitor_methods[] = {
    OC_METHOD("_monitor_start", py_monitor_start,
              "_monitor_start(device, threshold, interval, cooldown, on_high, capacity, "
              "allocator_stats, /)\n--\n\nStart a native watchdog; returns its handle."),
    OC_METHOD("_monitor_stop", py_monitor_stop,
              "_monitor_stop(handle, /)\n--\n\nStop and join a watchdog (idempotent)."),
    OC_METHOD("_monitor_stop_all", py_monitor_stop_all,
              "_monitor_stop_all(shutdown=False, /)\n--\n\n"
              "Stop every running watchdog; returns how many were running. shutdown=True "
              "(atexit) also starts no watchdog from then on."),
    OC_METHOD("_monitor_info", py_monitor_info,
              "_monitor_info(handle, /)\n--\n\nState of a watchdog."),
    OC_METHOD("_monitor_samples", py_monitor_samples,
              "_monitor_samples(handle, /)\n--\n\nThe watchdog's timeline."),
    OC_METHOD("_monitor_events", py_monitor_events,
              "_monitor_events(handle, /)\n--\n\nWhat the watchdog did."),
    {NULL, NULL, 0, NULL},
};
