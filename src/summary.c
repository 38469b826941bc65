/* summary.c - OUTOFCUDA_SUMMARY: what the GPU did, and how long the main
 * thread waited for its data, printed at exit.
 *
 * With the summary on, `import torch` starts one native thread. Each tick
 * (about every 200 ms, jittered so that a loop of a fixed period is not
 * sampled at one phase of it) it takes the GIL for tens of microseconds and
 * looks at the main thread's stack through sys._current_frames() (the
 * Limited API has no way to another thread's frame): a stack holding code
 * from torch/utils/data/ is a main thread waiting for its next batch. Once
 * CUDA initialises (torch's lazy-init queue) the same tick also samples each
 * device's utilisation and memory from NVML, without the GIL, so the two
 * can be paired: how often the GPU was under 50 % busy while the main
 * thread waited. Like the watchdog in monitor.c the thread blocks every
 * signal, waits on a condition variable with a CLOCK_MONOTONIC deadline,
 * takes the GIL only with its lock released and never once asked to stop
 * (so never during finalisation), and is joined, never detached. A
 * DataLoader worker that imports torch (spawn, forkserver) sees its own
 * _worker_loop on the stack at the first sample: the thread stops sampling
 * and the worker prints nothing. At exit an atexit callback joins the
 * thread, adds torch's peak figures, the OOM and micro-batch counts, ranks
 * up to three hints and prints one block per device used (a process that
 * never started CUDA: one block without a GPU part, when it iterated data),
 * or writes the JSON form. */
#include "oc.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define SUMMARY_MAX_DEVICES 16
#define DEFAULT_INTERVAL_MS 200
#define MIN_INTERVAL_MS 10
#define MAX_INTERVAL_MS 60000
#define HINTS_MAX 3
#define LOW_UTIL OC_SUMMARY_LOW_UTIL
#define JOIN_LIMIT_MS 5000
#define JOIN_SLICE_MS 50    /* how soon a Ctrl-C ends the wait for the sampler */
#define MAX_STACK_DEPTH 256 /* frames looked at per sample, innermost first */

typedef struct {
    int torch_index, nvml_index;
    char name[96];
    /* written by the sampler under S.lock */
    unsigned long long ticks, util_samples, under_low, mem_samples, mem_peak, mem_total;
    unsigned long long paired_samples, paired_wait_low; /* with a stack sample; waiting and low */
    double util_sum;
    /* filled at exit, with the GIL */
    long long peak_allocated, peak_reserved; /* -1: unknown */
} sum_device;

/* The sampler thread's state: the thread reads and writes it without the
 * GIL, under th.lock, and a summary that starts afresh clears it whole (what
 * the GIL-held state below keeps outlives that). */
static struct {
    oc_thread th; /* th.lock guards the aggregates, n, frames_on and stop_requested */
    int started, running, stop_requested;
    long interval_ms;
    double t0;     /* oc_thread_now() when the summary started (torch imported) */
    double t_cuda; /* ... and when CUDA started (cuda set) */
    int cuda;      /* CUDA started: dev[0..n) are this process's devices */
    int n;
    sum_device dev[SUMMARY_MAX_DEVICES];
    char why[240]; /* why no utilisation is sampled, or "" */
    /* The main thread's stack, sampled with the GIL. */
    unsigned long main_ident; /* threading.main_thread().ident; 0: not sampled */
    int frames_on, in_worker; /* in_worker: a DataLoader worker, says nothing */
    unsigned long long frame_samples, frame_waits;
    double gil_wait_s, gil_held_s; /* waiting for the GIL, holding it: the sampler's cost */
    long waited_workers; /* num_workers of the DataLoader last seen waited in; -1 unknown */
    unsigned rng;        /* the jitter's state, the thread's alone */
} S;

/* Where the summary goes, resolved once (GIL held). */
static struct {
    int resolved;
    oc_summary_mode mode;
    char json_path[PATH_MAX];
    /* atexit.register ran in this process or the parent it was forked
     * from (a child inherits the registration too). */
    int atexit_registered;
} output;

/* What bridge.c read of torch and its allocator (oc_summary_prepare). */
static oc_summary_torch torch_facts;
/* CUDA OOMs torch's observer reported in this process (oom.c tells). */
static unsigned long oom_events;

void oc_summary_note_oom(void)
{
    oom_events++;
}

/* ---- the sampler thread: no Python object, no GIL ---- */

static void sample_device(sum_device *d, int waited)
{
    oc_gpu_info g;
    unsigned gpu = 0, mem_busy = 0;
    int mem_ok = oc_nvml_device_info(d->nvml_index, &g) == 0 && g.total > 0;
    int util_ok = oc_nvml_utilization(d->nvml_index, &gpu, &mem_busy) == 0 && gpu <= 100;
    pthread_mutex_lock(&S.th.lock);
    d->ticks++;
    if (mem_ok) {
        d->mem_samples++;
        d->mem_total = g.total;
        if (g.used > d->mem_peak)
            d->mem_peak = g.used;
        if (!d->name[0])
            snprintf(d->name, sizeof d->name, "%s", g.name);
    }
    if (util_ok) {
        d->util_samples++;
        d->util_sum += gpu;
        d->under_low += gpu < LOW_UTIL;
        if (waited >= 0) {
            d->paired_samples++;
            d->paired_wait_low += waited && gpu < LOW_UTIL;
        }
    }
    pthread_mutex_unlock(&S.th.lock);
}

/* ---- the main thread's stack (the sampler thread, with the GIL) ---- */

/* The iterator's num_workers, from the `self` of torch's
 * _BaseDataLoaderIter.__next__ frame; -1 when it cannot be read. */
static long iterator_workers(PyObject *frame)
{
    PyObject *locals = PyObject_GetAttrString(frame, "f_locals");
    PyObject *it = locals ? PyMapping_GetItemString(locals, "self") : NULL;
    PyObject *nw = it ? PyObject_GetAttrString(it, "_num_workers") : NULL;
    long n = nw && PyLong_Check(nw) ? PyLong_AsLong(nw) : -1;
    Py_XDECREF(nw);
    Py_XDECREF(it);
    Py_XDECREF(locals);
    OC_CLEAR_ABSENT(); /* not torch's iterator, or no such attribute */
    return n;
}

/* 1 when the code's file is under torch/utils/data/; *name: its co_name
 * (new reference) then. */
static int in_data_code(PyObject *code, PyObject *needle, PyObject **name)
{
    PyObject *file = PyObject_GetAttrString(code, "co_filename");
    int in = file != NULL && PyUnicode_Check(file) &&
             PyUnicode_Find(file, needle, 0, PY_SSIZE_T_MAX, 1) >= 0;
    Py_XDECREF(file);
    *name = in ? PyObject_GetAttrString(code, "co_name") : NULL;
    return in;
}

static int name_is(PyObject *name, const char *s)
{
    return name != NULL && PyUnicode_Check(name) && PyUnicode_CompareWithASCIIString(name, s) == 0;
}

/* Where the main thread is: 1 inside a torch.utils.data iterator, 0
 * elsewhere, -1 unknown (no frame). *workers: the waited iterator's
 * num_workers where seen; *worker: this process is a DataLoader worker. */
static int main_thread_in_data(long *workers, int *worker)
{
    PyObject *fn = PySys_GetObject("_current_frames"); /* borrowed */
    PyObject *frames = fn ? PyObject_CallObject(fn, NULL) : NULL;
    PyObject *key = PyLong_FromUnsignedLong(S.main_ident);
    PyObject *needle = PyUnicode_FromString("/torch/utils/data/");
    PyObject *frame = frames && key && needle && PyDict_Check(frames)
                          ? PyDict_GetItem(frames, key) /* borrowed */
                          : NULL;
    int where = frame != NULL ? 0 : -1;
    Py_XINCREF(frame);
    for (int depth = 0; frame != NULL && frame != Py_None && depth < MAX_STACK_DEPTH; depth++) {
        PyObject *code = PyObject_GetAttrString(frame, "f_code"), *name = NULL, *back;
        int in = code != NULL && in_data_code(code, needle, &name), next;
        Py_XDECREF(code);
        where = in ? 1 : where;
        *worker = name_is(name, "_worker_loop");
        next = name_is(name, "__next__");
        if (next)
            *workers = iterator_workers(frame);
        Py_XDECREF(name);
        /* The iterator's entry: the frames further out are the program's. */
        if (next || *worker)
            break;
        back = PyObject_GetAttrString(frame, "f_back");
        Py_DECREF(frame);
        frame = back;
    }
    Py_XDECREF(frame);
    Py_XDECREF(needle);
    Py_XDECREF(key);
    Py_XDECREF(frames);
    OC_CLEAR();
    return where;
}

/* One stack sample, unless the summary is stopping: takes the GIL with no
 * lock held (monitor.c's order). Returns main_thread_in_data's answer, -1
 * when nothing was sampled. */
static int sample_main_thread(void)
{
    PyGILState_STATE gil;
    long workers = -1;
    int where, worker = 0, stop;
    double asked, got, done;
    pthread_mutex_lock(&S.th.lock);
    stop = S.stop_requested || !S.frames_on;
    pthread_mutex_unlock(&S.th.lock);
    if (stop)
        return -1;
    asked = oc_thread_now();
    gil = PyGILState_Ensure();
    got = oc_thread_now();
    where = main_thread_in_data(&workers, &worker);
    done = oc_thread_now();
    PyGILState_Release(gil);
    pthread_mutex_lock(&S.th.lock);
    S.gil_wait_s += got - asked;
    S.gil_held_s += done - got;
    if (worker) {
        S.in_worker = 1;
        S.frames_on = 0;
        where = -1;
    } else if (where >= 0) {
        S.frame_samples++;
        S.frame_waits += (unsigned long long)where;
        if (where && workers >= 0)
            S.waited_workers = workers;
    }
    pthread_mutex_unlock(&S.th.lock);
    return where;
}

/* The next wait: the interval, 80 % to 120 % of it. */
static struct timespec next_deadline(long interval_ms)
{
    long ms;
    S.rng = S.rng * 1103515245u + 12345u;
    ms = interval_ms * (80 + (long)((S.rng >> 16) % 41)) / 100;
    ms = ms > 0 ? ms : 1;
    return oc_thread_deadline(ms / 1000, (ms % 1000) * 1000000L);
}

static void *sampler(void *arg)
{
    (void)arg;
    pthread_mutex_lock(&S.th.lock);
    while (!S.stop_requested) {
        struct timespec deadline;
        int n = S.n, waited;
        long interval_ms = S.interval_ms;
        pthread_mutex_unlock(&S.th.lock);
        waited = sample_main_thread();
        /* dev[0..n) were filled before n was published, under the lock. */
        for (int i = 0; i < n; i++)
            if (S.dev[i].nvml_index >= 0)
                sample_device(&S.dev[i], waited);
        deadline = next_deadline(interval_ms);
        pthread_mutex_lock(&S.th.lock);
        oc_thread_wait(&S.th, &S.stop_requested, &deadline);
    }
    pthread_mutex_unlock(&S.th.lock);
    return NULL;
}

/* Stops and joins the sampler, with the GIL held on entry (released for the
 * join). A forked copy has no thread: only the owner joins. */
static void sampler_stop(void)
{
    int joined = 0;
    if (!S.running || oc_thread_inherited(&S.th) || pthread_equal(pthread_self(), S.th.thread))
        return;
    oc_thread_request_stop(&S.th, &S.stop_requested);
    /* At most JOIN_LIMIT_MS (an NVML call can hang in a broken driver), in
     * slices with the signals handled between them: a Ctrl-C ends the wait,
     * set aside for the edge to raise. */
    for (int ms = 0; !joined && ms < JOIN_LIMIT_MS && !oc_interrupt_waiting();
         ms += JOIN_SLICE_MS) {
        Py_BEGIN_ALLOW_THREADS
        joined = oc_thread_join(S.th.thread, JOIN_SLICE_MS);
        Py_END_ALLOW_THREADS
        if (!joined && PyErr_CheckSignals() < 0)
            OC_CLEAR();
    }
    /* A thread stuck in a driver call is left behind rather than hang the
     * exit; it writes only to this static state, under the lock. */
    S.running = joined ? 0 : S.running;
}

/* ---- where the summary goes ---- */

/* Resolves OUTOFCUDA_SUMMARY's JSON path to an absolute one in the working
 * directory of now (it may change before exit): at `import torch`, and again
 * (again: 1) when CUDA starts, whose answer stands. A directory that does not
 * exist gets one warning and turns the feature off. Returns the mode. */
static oc_summary_mode resolve_output(int again)
{
    const oc_config *cfg = oc_config_get();
    char dir[OC_SUMMARY_PATH_MAX], msg[OC_WARN_LEN + 2 * OC_SUMMARY_PATH_MAX];
    if (output.resolved && !(again && output.mode == OC_SUMMARY_JSON))
        return output.mode;
    output.resolved = 1;
    output.mode = cfg->summary;
    if (output.mode != OC_SUMMARY_JSON)
        return output.mode;
    if (oc_resolve_file_path(cfg->summary_path, dir, sizeof dir, output.json_path,
                             sizeof output.json_path) != 0) {
        snprintf(msg, sizeof msg,
                 "outofcuda: ignoring OUTOFCUDA_SUMMARY=%.300s: the directory %.300s does not "
                 "exist; no summary will be written",
                 cfg->summary_path, dir);
        oc_warn(msg);
        output.json_path[0] = '\0';
        output.mode = OC_SUMMARY_OFF;
    }
    return output.mode;
}

/* ---- starting ---- */

static PyObject *py_summary_at_exit(PyObject *self, PyObject *unused);
OC_EDGE_NOARGS(py_summary_at_exit)
static PyMethodDef at_exit_def = OC_METHOD("outofcuda_summary_at_exit", py_summary_at_exit, NULL);

/* threading.main_thread().ident, or 0 when it cannot be read. */
static unsigned long main_thread_ident(void)
{
    PyObject *threading = PyImport_ImportModule("threading");
    PyObject *t = threading ? PyObject_CallMethod(threading, "main_thread", NULL) : NULL;
    PyObject *ident = t ? PyObject_GetAttrString(t, "ident") : NULL;
    unsigned long id = ident && PyLong_Check(ident) ? PyLong_AsUnsignedLong(ident) : 0;
    Py_XDECREF(ident);
    Py_XDECREF(t);
    Py_XDECREF(threading);
    OC_CLEAR();
    return id;
}

/* Starts the sampling thread once. Returns 0 (a thread that cannot start
 * is said in S.why). */
static int start_thread(void)
{
    int rc = S.running ? 0 : oc_thread_start(&S.th, sampler, NULL, "oc-summary");
    if (rc != 0)
        snprintf(S.why, sizeof S.why, "the sampling thread could not start (%s)", strerror(rc));
    S.running = rc == 0;
    return 0;
}

/* Starts the clock, the exit report and the thread sampling the main
 * thread's stack. Returns 0, or -1 with an exception set. */
static int summary_begin(long interval_ms)
{
    if (S.started && !oc_thread_inherited(&S.th))
        return 0;
    /* Fresh primitives: a forked child may inherit a lock the parent's thread held. */
    memset(&S, 0, sizeof S);
    oc_thread_init(&S.th);
    S.interval_ms = interval_ms;
    S.waited_workers = -1;
    S.rng = (unsigned)getpid();
    S.main_ident = main_thread_ident();
    S.frames_on = S.main_ident != 0;
    S.t0 = oc_thread_now();
    S.started = 1;
    if (oc_register_at_exit(&at_exit_def, &output.atexit_registered) < 0)
        return -1;
    return S.frames_on ? start_thread() : 0;
}

/* CUDA started: the devices to sample join the running thread (started
 * here when the stack is not sampled). Returns 0. */
static int devices_begin(const int *torch_index, int n)
{
    sum_device dev[SUMMARY_MAX_DEVICES];
    char why[200] = "";
    int sampled = 0;
    if (S.cuda)
        return 0;
    n = n < SUMMARY_MAX_DEVICES ? n : SUMMARY_MAX_DEVICES;
    memset(dev, 0, sizeof dev);
    for (int i = 0; i < n; i++) {
        dev[i].torch_index = torch_index[i];
        dev[i].nvml_index = oc_nvml_index(torch_index[i]);
        dev[i].peak_allocated = dev[i].peak_reserved = -1;
        sampled += dev[i].nvml_index >= 0;
    }
    pthread_mutex_lock(&S.th.lock);
    memcpy(S.dev, dev, sizeof dev);
    S.n = n;
    S.cuda = 1;
    S.t_cuda = oc_thread_now();
    pthread_mutex_unlock(&S.th.lock);
    if (!oc_nvml_available(why, sizeof why))
        snprintf(S.why, sizeof S.why, "%s", why);
    else if (sampled == 0)
        snprintf(S.why, sizeof S.why, "NVML shows none of this process's CUDA devices");
    else
        return start_thread();
    return 0;
}

/* This process's devices: LOCAL_RANK's alone under torchrun (one GPU per
 * rank), otherwise every visible one (a single process may use several). */
static int choose_devices(int *torch_index)
{
    int map[OC_NVML_MAX_DEVICES];
    int count = oc_nvml_visible_map(map, OC_NVML_MAX_DEVICES), n = 0;
    long rank = oc_env_rank("LOCAL_RANK");
    if (count <= 0) {
        torch_index[0] = rank >= 0 && rank < SUMMARY_MAX_DEVICES ? (int)rank : 0;
        return 1;
    }
    if (rank >= 0 && rank < count) {
        torch_index[0] = (int)rank;
        return 1;
    }
    for (int i = 0; i < count && n < SUMMARY_MAX_DEVICES; i++)
        torch_index[n++] = i;
    return n;
}

/* Step of bridge.c's one CUDA-init callback (its rules apply). */
void oc_summary_at_cuda_init(void)
{
    int devices[SUMMARY_MAX_DEVICES] = {0};
    int n = choose_devices(devices);
    if (resolve_output(1) != OC_SUMMARY_OFF &&
        (summary_begin(DEFAULT_INTERVAL_MS) < 0 || devices_begin(devices, n) < 0))
        oc_set_error("starting the exit summary");
    OC_CLEAR();
}

void oc_summary_prepare(int cuda_queue, const oc_summary_torch *torch)
{
    torch_facts = *torch;
    if (oc_config_get()->summary == OC_SUMMARY_OFF || resolve_output(0) == OC_SUMMARY_OFF)
        return;
    if (summary_begin(DEFAULT_INTERVAL_MS) < 0)
        oc_set_error("starting the exit summary");
    OC_CLEAR();
    if (cuda_queue)
        oc_cuda_step_arm(OC_STEP_SUMMARY);
}

/* ---- at exit: figures from torch and the Python layer (GIL held) ---- */

static long long call_ll(PyObject *owner, const char *name, int arg)
{
    PyObject *r = arg >= 0 ? PyObject_CallMethod(owner, name, "i", arg)
                           : PyObject_CallMethod(owner, name, NULL);
    long long x = r ? PyLong_AsLongLong(r) : -1;
    Py_XDECREF(r);
    if (PyErr_Occurred()) {
        OC_CLEAR();
        return -1;
    }
    return x;
}

/* Peak figures per device when torch has initialised CUDA (never initialises
 * it), and drops the devices this process did not use. Returns 1 when
 * torch's figures were read. */
static int torch_figures(sum_device *dev, int *n)
{
    PyObject *torch = oc_sys_module("torch");
    PyObject *cuda = torch ? PyObject_GetAttrString(torch, "cuda") : NULL;
    PyObject *init = cuda ? PyObject_CallMethod(cuda, "is_initialized", NULL) : NULL;
    long long current;
    int ok = init != NULL && PyObject_IsTrue(init) == 1, kept = 0;
    OC_CLEAR();
    Py_XDECREF(init);
    if (!ok)
        goto done;
    current = call_ll(cuda, "current_device", -1);
    for (int i = 0; i < *n; i++) {
        dev[i].peak_allocated = call_ll(cuda, "max_memory_allocated", dev[i].torch_index);
        dev[i].peak_reserved = call_ll(cuda, "max_memory_reserved", dev[i].torch_index);
    }
    /* Devices this process used: memory reserved on it, or the current one. */
    for (int i = 0; i < *n; i++)
        if (dev[i].peak_reserved > 0 || dev[i].torch_index == current)
            dev[kept++] = dev[i];
    if (kept > 0)
        *n = kept;
done:
    Py_XDECREF(cuda);
    Py_XDECREF(torch);
    return ok;
}

/* The largest num_workers among DataLoaders alive at exit, or -1 when none
 * is (or torch.utils.data was never imported). gc.get_referrers finds
 * instances through their type without listing every object. */
static long dataloader_workers(void)
{
    PyObject *mod = oc_sys_module("torch.utils.data.dataloader");
    PyObject *cls = mod ? PyObject_GetAttrString(mod, "DataLoader") : NULL;
    PyObject *classes = NULL, *args = NULL, *gc = NULL, *refs = NULL;
    long best = -1;
    if (cls == NULL || !PyType_Check(cls))
        goto done;
    classes = PyList_New(0);
    if (classes == NULL || PyList_Append(classes, cls) < 0)
        goto done;
    /* Subclasses too: their instances refer to the subclass. */
    for (Py_ssize_t i = 0; i < PyList_Size(classes) && i < 256; i++) {
        PyObject *subs = PyObject_CallMethod(PyList_GetItem(classes, i), "__subclasses__", NULL);
        for (Py_ssize_t j = 0; subs != NULL && j < PyList_Size(subs); j++)
            if (PyList_Append(classes, PyList_GetItem(subs, j)) < 0)
                break;
        Py_XDECREF(subs);
    }
    args = PyList_AsTuple(classes);
    gc = PyImport_ImportModule("gc");
    refs = gc && args ? PyObject_GetAttrString(gc, "get_referrers") : NULL;
    if (refs != NULL) {
        PyObject *found = PyObject_CallObject(refs, args);
        Py_DECREF(refs);
        refs = found;
    }
    for (Py_ssize_t i = 0; refs != NULL && PyList_Check(refs) && i < PyList_Size(refs); i++) {
        PyObject *o = PyList_GetItem(refs, i);
        if (PyObject_IsInstance(o, cls) == 1) {
            PyObject *nw = PyObject_GetAttrString(o, "num_workers");
            long x = nw ? PyLong_AsLong(nw) : -1;
            Py_XDECREF(nw);
            if (x > best)
                best = x;
        }
        OC_CLEAR();
    }
done:
    OC_CLEAR();
    Py_XDECREF(refs);
    Py_XDECREF(gc);
    Py_XDECREF(args);
    Py_XDECREF(classes);
    Py_XDECREF(cls);
    Py_XDECREF(mod);
    return best;
}

/* ---- at exit: the block and the JSON ---- */

typedef struct {
    double wall, since_import; /* since CUDA started; since the summary started */
    long rank, workers, cpus, suggested_workers;
    unsigned long ooms;
    long long splits;
    unsigned long long frame_samples, frame_waits;
    const char *no_gpu; /* why there is no GPU part, or NULL */
} proc_figs;

/* Up to HINTS_MAX hints for one device (NULL: no GPU part), highest score
 * first; f gets the figures they rest on. Returns how many. */
static int make_hints(const sum_device *d, const proc_figs *p, oc_summary_figures *f,
                      oc_advice_item *h)
{
    int nh;
    memset(f, 0, sizeof *f);
    f->peak_allocated = f->peak_reserved = -1;
    if (d != NULL) {
        f->util_samples = d->util_samples;
        f->under_low = d->under_low;
        f->util_sum = d->util_sum;
        f->mem_samples = d->mem_samples;
        f->mem_peak = d->mem_peak;
        f->mem_total = d->mem_total;
        f->peak_allocated = d->peak_allocated;
        f->peak_reserved = d->peak_reserved;
        f->paired_samples = d->paired_samples;
        f->paired_wait_low = d->paired_wait_low;
    }
    f->workers = p->workers;
    f->frame_samples = p->frame_samples;
    f->frame_waits = p->frame_waits;
    f->cpus = p->cpus;
    f->suggested_workers = p->suggested_workers;
    f->expandable = torch_facts.expandable;
    f->no_expandable_here = oc_platform_no_expandable() != NULL;
    nh = oc_summary_hints(f, h, HINTS_MAX + 1);
    return nh < HINTS_MAX ? nh : HINTS_MAX;
}

static void format_wait(oc_text *t, const proc_figs *p, const sum_device *d)
{
    if (p->frame_samples == 0) {
        oc_appendf(t, "  input wait     not measured (no sample of the main thread)\n");
        return;
    }
    oc_appendf(t, "  input wait     main thread in torch.utils.data in %.1f %% of %llu samples",
               100.0 * (double)p->frame_waits / (double)p->frame_samples, p->frame_samples);
    if (d != NULL && d->paired_samples > 0)
        oc_appendf(t, "; GPU under %d %% while it waited in %.1f %% of %llu\n", LOW_UTIL,
                   100.0 * (double)d->paired_wait_low / (double)d->paired_samples,
                   d->paired_samples);
    else
        oc_appendf(t, " (every %ld ms)\n", S.interval_ms);
}

/* The block of a process without a GPU part: the input wait and its hints. */
static void format_no_gpu(oc_text *t, const proc_figs *p, const oc_advice_item *h, int nh)
{
    oc_appendf(t, "outofcuda summary: no GPU part (%s), %.1f s since torch was imported\n",
               p->no_gpu, p->since_import);
    format_wait(t, p, NULL);
    for (int i = 0; i < nh; i++)
        oc_appendf(t, "  hint %d         %s\n", i + 1, h[i].text);
}

/* The rank label is the writer's (oc_stderr_write), on every line. */
static void format_block(oc_text *t, const sum_device *d, const proc_figs *p,
                         const oc_advice_item *h, int nh)
{
    oc_appendf(t, "outofcuda summary: cuda:%d%s%s", d->torch_index, d->name[0] ? " " : "", d->name);
    if (d->nvml_index >= 0)
        oc_appendf(t, " (NVML %d)", d->nvml_index);
    oc_appendf(t, ", %.1f s since CUDA started\n", p->wall);
    if (d->util_samples > 0)
        oc_appendf(t,
                   "  utilisation    mean %.1f %%; under %d %% in %.1f %% of %llu samples "
                   "(every %ld ms, all processes)\n",
                   d->util_sum / (double)d->util_samples, LOW_UTIL,
                   100.0 * (double)d->under_low / (double)d->util_samples, d->util_samples,
                   S.interval_ms);
    else
        oc_appendf(t, "  utilisation    not sampled: %s\n",
                   S.why[0]            ? S.why
                   : d->nvml_index < 0 ? "NVML does not show this device"
                   : d->ticks > 0      ? "NVML gave no utilisation for this device"
                                       : "no sample taken yet");
    format_wait(t, p, d);
    if (d->mem_samples > 0)
        oc_appendf(t, "  device memory  peak %.2f of %.2f GiB (%.1f %%, all processes)\n",
                   (double)d->mem_peak / OC_GIB, (double)d->mem_total / OC_GIB,
                   100.0 * (double)d->mem_peak / (double)d->mem_total);
    if (d->peak_allocated >= 0 && d->peak_reserved >= 0)
        oc_appendf(t, "  this process   peak allocated %.2f GiB, peak reserved %.2f GiB\n",
                   (double)d->peak_allocated / OC_GIB, (double)d->peak_reserved / OC_GIB);
    else
        oc_appendf(t, "  this process   no allocator figures (torch's CUDA is not initialised)\n");
    oc_appendf(t, "  events         %lu CUDA OOM%s, %lld micro-batch split%s\n", p->ooms,
               p->ooms == 1 ? "" : "s", p->splits, p->splits == 1 ? "" : "s");
    for (int i = 0; i < nh; i++)
        oc_appendf(t, "  hint %d         %s\n", i + 1, h[i].text);
}

/* The known bugs that apply here and that outofcuda does not avoid
 * (knownbugs.c), once per process, after the device blocks. */
static void append_known_bugs(oc_text *t, const proc_figs *p)
{
    char pre[32] = "", lines[4096];
    if (p->rank >= 0)
        snprintf(pre, sizeof pre, "[rank %ld] ", p->rank);
    if (oc_known_bugs_summary(lines, sizeof lines, pre) > 0)
        oc_appendf(t, "%s", lines);
}

/* num / den, or None without a sample (den 0). */
static PyObject *none_or_ratio(double num, double den)
{
    if (den <= 0.0)
        Py_RETURN_NONE;
    return PyFloat_FromDouble(num / den);
}

/* One device's entry of the JSON form (new reference or NULL). */
static PyObject *device_dict(const sum_device *d, const oc_advice_item *h, int nh)
{
    PyObject *hints = oc_advice_texts(h, nh);
    int m = d->mem_samples > 0;
    if (hints == NULL)
        return NULL;
    return Py_BuildValue(
        "{s:i,s:N,s:s,s:K,s:N,s:N,s:N,s:N,s:N,s:N,s:N}", "device", d->torch_index, "nvml_index",
        oc_none_or_ll(d->nvml_index), "name", d->name, "samples", d->util_samples,
        "utilization_mean", none_or_ratio(d->util_sum, (double)d->util_samples),
        "utilization_under_50_share", none_or_ratio((double)d->under_low, (double)d->util_samples),
        "memory_used_peak", m ? PyLong_FromUnsignedLongLong(d->mem_peak) : oc_none_or_ll(-1),
        "memory_total", m ? PyLong_FromUnsignedLongLong(d->mem_total) : oc_none_or_ll(-1),
        "peak_allocated", oc_none_or_ll(d->peak_allocated), "peak_reserved",
        oc_none_or_ll(d->peak_reserved), "hints", hints);
}

/* The JSON's input_wait (new reference or NULL): the measured figures and
 * the decision the hints rest on. */
static PyObject *wait_dict(const proc_figs *p, const oc_summary_figures *f, const sum_device *dev,
                           int n)
{
    PyObject *paired = PyList_New(0);
    for (int i = 0; paired != NULL && i < n; i++) {
        PyObject *x = none_or_ratio((double)dev[i].paired_wait_low, (double)dev[i].paired_samples);
        if (x == NULL || PyList_Append(paired, x) < 0)
            Py_CLEAR(paired);
        Py_XDECREF(x);
    }
    if (paired == NULL)
        return NULL;
    return Py_BuildValue("{s:K,s:K,s:N,s:O,s:N,s:l,s:l,s:N}", "samples", p->frame_samples,
                         "waiting", p->frame_waits, "share",
                         none_or_ratio((double)p->frame_waits, (double)p->frame_samples), "starved",
                         oc_summary_starved(f) ? Py_True : Py_False, "num_workers",
                         oc_none_or_ll(p->workers), "cpus", p->cpus, "suggested_workers",
                         p->suggested_workers, "gpu_under_50_while_waiting_share", paired);
}

/* Writes the JSON form through a temporary file renamed into place. The
 * temporary file is made new (O_EXCL, never through a link) under a name
 * with the clock's nanoseconds in it: a name another user planted in a
 * shared directory is never written through, and rename() replaces a final
 * name that is a link. Returns 0, or -1 with the reason in err. */
static int write_json(PyObject *doc, long rank, char *err, size_t errsz)
{
    char path[PATH_MAX + 32], tmp[PATH_MAX + 64];
    PyObject *json = PyImport_ImportModule("json");
    PyObject *s = json ? PyObject_CallMethod(json, "dumps", "O", doc) : NULL;
    PyObject *b = s ? PyUnicode_AsUTF8String(s) : NULL;
    int rc = -1, fd, written;
    /* "x.json" -> "x.rank3.json" so that ranks do not overwrite each other. */
    if (rank < 0)
        snprintf(path, sizeof path, "%s", output.json_path);
    else
        snprintf(path, sizeof path, "%.*s.rank%ld.json", (int)(strlen(output.json_path) - 5),
                 output.json_path, rank);
    snprintf(tmp, sizeof tmp, "%s.tmp%ld.%ld", path, (long)getpid(),
             oc_thread_deadline(0, 0).tv_nsec);
    if (b == NULL) {
        snprintf(err, errsz, "the JSON could not be built");
        goto done;
    }
    fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
    if (fd < 0) {
        snprintf(err, errsz, "%s: %s", tmp, strerror(errno));
        goto done;
    }
    written = write(fd, PyBytes_AsString(b), (size_t)PyBytes_Size(b)) == PyBytes_Size(b) &&
              write(fd, "\n", 1) == 1;
    if (close(fd) != 0 || !written || rename(tmp, path) != 0) {
        snprintf(err, errsz, "%s: %s", path, strerror(errno));
        remove(tmp);
        goto done;
    }
    rc = 0;
done:
    OC_CLEAR();
    Py_XDECREF(b);
    Py_XDECREF(s);
    Py_XDECREF(json);
    return rc;
}

/* Builds the text blocks (one per device, or one without a GPU part) and,
 * in JSON mode, the document. */
static void emit(const proc_figs *p, const sum_device *dev, int n)
{
    oc_text t = {malloc(65536), 0, 65536};
    int json = output.mode == OC_SUMMARY_JSON;
    PyObject *devices = json ? PyList_New(0) : NULL, *hints = NULL, *wait = NULL;
    oc_summary_figures f;
    oc_advice_item h[HINTS_MAX + 1];
    char err[PATH_MAX + 200];
    int nh = 0;
    if (p->no_gpu != NULL) {
        nh = make_hints(NULL, p, &f, h);
        format_no_gpu(&t, p, h, nh);
    }
    hints = json ? oc_advice_texts(h, nh) : NULL; /* the top level's: a block without a GPU part */
    for (int i = 0; i < n; i++) {
        nh = make_hints(&dev[i], p, &f, h);
        format_block(&t, &dev[i], p, h, nh);
        if (i == n - 1)
            append_known_bugs(&t, p);
        if (devices != NULL) {
            PyObject *d = device_dict(&dev[i], h, nh);
            if (d == NULL || PyList_Append(devices, d) < 0)
                Py_CLEAR(devices);
            Py_XDECREF(d);
        }
    }
    if (json) {
        PyObject *doc = NULL;
        if (n == 0)
            make_hints(NULL, p, &f, h); /* the figures of the decision below */
        wait = wait_dict(p, &f, dev, n);
        if (devices && hints && wait)
            doc = Py_BuildValue("{s:i,s:N,s:d,s:d,s:k,s:L,s:N,s:l,s:O,s:N,s:O,s:O}", "version", 1,
                                "rank", oc_none_or_ll(p->rank), "wall_s", p->wall, "since_import_s",
                                p->since_import, "ooms", p->ooms, "microbatch_splits", p->splits,
                                "dataloader_workers", oc_none_or_ll(p->workers), "interval_ms",
                                S.interval_ms, "devices", devices, "no_gpu",
                                p->no_gpu ? PyUnicode_FromString(p->no_gpu) : oc_none_or_ll(-1),
                                "input_wait", wait, "hints", hints);
        if (doc != NULL && write_json(doc, p->rank, err, sizeof err) == 0) {
            Py_DECREF(doc);
            goto done;
        }
        OC_CLEAR();
        Py_XDECREF(doc);
        /* Never lose the figures: print them where the file could not go. */
        oc_stderr_printf("outofcuda: OUTOFCUDA_SUMMARY: could not write the JSON (%s); the "
                         "summary follows\n",
                         doc ? err : "the JSON could not be built");
    }
    if (t.buf != NULL)
        oc_stderr_write(t.buf);
done:
    OC_CLEAR();
    Py_XDECREF(wait);
    Py_XDECREF(hints);
    Py_XDECREF(devices);
    free(t.buf);
}

/* Why a process has no GPU part. */
static const char *no_gpu_reason(void)
{
    if (torch_facts.hip_build)
        return "torch is a ROCm build, whose GPU the summary does not sample";
    return torch_facts.cuda_build ? "CUDA was not initialised" : "torch is a CPU build";
}

/* 1 in a process that multiprocessing started (a DataLoader worker by spawn
 * or forkserver that ended before the sampler saw it): it has nothing of its
 * own to report. Never imports. */
static int multiprocessing_child(void)
{
    PyObject *mp = oc_sys_module("multiprocessing.process");
    PyObject *parent = mp != NULL ? PyObject_CallMethod(mp, "parent_process", NULL) : NULL;
    int child = parent != NULL && parent != Py_None;
    Py_XDECREF(parent);
    Py_XDECREF(mp);
    OC_CLEAR();
    return child;
}

/* atexit callback: join the sampler, gather, print or write. Raises only
 * the program's Ctrl-C or exit, through its edge (one that ended the wait
 * for the sampler skips the summary). */
static PyObject *py_summary_at_exit(PyObject *self, PyObject *unused)
{
    proc_figs p;
    sum_device dev[SUMMARY_MAX_DEVICES];
    int n, cuda, in_worker;
    double now;
    (void)self;
    (void)unused;
    /* A forked child inherits the registration but not the thread or the
     * figures' meaning: only the process that started the clock reports. */
    if (!S.started || oc_thread_inherited(&S.th))
        Py_RETURN_NONE;
    S.started = 0;
    now = oc_thread_now();
    sampler_stop();
    if (oc_interrupt_waiting())
        Py_RETURN_NONE;
    memset(&p, 0, sizeof p);
    /* A copy: a thread that could not be joined may still write S. */
    pthread_mutex_lock(&S.th.lock);
    n = S.n;
    cuda = S.cuda;
    in_worker = S.in_worker;
    memcpy(dev, S.dev, sizeof dev);
    p.frame_samples = S.frame_samples;
    p.frame_waits = S.frame_waits;
    p.workers = S.waited_workers;
    pthread_mutex_unlock(&S.th.lock);
    p.wall = now - (cuda ? S.t_cuda : S.t0);
    p.since_import = now - S.t0;
    p.rank = oc_job_rank();
    p.ooms = oom_events;
    p.splits = oc_api_microbatch_splits();
    p.suggested_workers = oc_loader_suggestion(&p.cpus);
    if (cuda)
        torch_figures(dev, &n);
    else
        p.no_gpu = no_gpu_reason();
    if (p.workers < 0)
        p.workers = dataloader_workers();
    /* Without CUDA, only a process that iterated data has something to say
     * (not torchrun's launcher, not a program that only imports torch); a
     * DataLoader worker never does. The rest say why, rather than nothing. */
    if (output.mode != OC_SUMMARY_OFF && !in_worker &&
        (cuda || p.frame_waits > 0 || p.workers >= 0))
        emit(&p, dev, cuda ? n : 0);
    else if (output.mode != OC_SUMMARY_OFF && !in_worker && !oc_torchrun_launcher() &&
             !multiprocessing_child())
        oc_stderr_printf("outofcuda summary: nothing to report: %s%s\n",
                         p.no_gpu != NULL ? p.no_gpu : "no CUDA device was used",
                         output.mode == OC_SUMMARY_JSON ? " (no JSON written)" : "");
    OC_CLEAR();
    Py_RETURN_NONE;
}

/* ---- test-only entry points ---- */

/* _testing.summary_start(devices, interval_ms=200) -> bool. Starts the
 * clock, the sampler for the given torch device indices (none: the stack
 * alone) and the exit report as CUDA's initialisation would, without CUDA;
 * a summary already started samples every interval_ms from now on. Output as OUTOFCUDA_SUMMARY
 * says (stderr when unset or off). False when a JSON path is unusable. */
static PyObject *py_summary_start(PyObject *self, PyObject *args)
{
    PyObject *seq;
    Py_ssize_t count;
    int devices[SUMMARY_MAX_DEVICES] = {0}, n = 0;
    long interval_ms = DEFAULT_INTERVAL_MS;
    (void)self;
    if (!PyArg_ParseTuple(args, "O|l", &seq, &interval_ms))
        return NULL;
    if (interval_ms < MIN_INTERVAL_MS || interval_ms > MAX_INTERVAL_MS) {
        PyErr_Format(PyExc_ValueError, "summary_start: interval_ms must be %d..%d", MIN_INTERVAL_MS,
                     MAX_INTERVAL_MS);
        return NULL;
    }
    count = PyList_Check(seq) || PyTuple_Check(seq) ? PySequence_Size(seq) : -1;
    if (count < 0 || count > SUMMARY_MAX_DEVICES) {
        OC_CLEAR();
        PyErr_Format(PyExc_TypeError, "summary_start: devices must be a list of up to %d ints",
                     SUMMARY_MAX_DEVICES);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PySequence_GetItem(seq, i);
        long x = item ? PyLong_AsLong(item) : -1;
        Py_XDECREF(item);
        if (PyErr_Occurred())
            return NULL;
        if (x < 0 || x >= OC_NVML_MAX_DEVICES) {
            PyErr_SetString(PyExc_ValueError, "summary_start: a device index is out of range");
            return NULL;
        }
        devices[n++] = (int)x;
    }
    if (oc_config_get()->summary != OC_SUMMARY_OFF && resolve_output(1) == OC_SUMMARY_OFF)
        Py_RETURN_FALSE;
    if (!output.resolved || output.mode == OC_SUMMARY_OFF) {
        output.resolved = 1;
        output.mode = OC_SUMMARY_STDERR;
    }
    if (summary_begin(interval_ms) < 0)
        return NULL;
    pthread_mutex_lock(&S.th.lock);
    S.interval_ms = interval_ms; /* a summary started by `import torch` samples faster too */
    pthread_mutex_unlock(&S.th.lock);
    if (n > 0 && devices_begin(devices, n) < 0)
        return NULL;
    Py_RETURN_TRUE;
}

/* _summary_stats() -> dict(running, why, interval_ms, devices=[...]): the
 * aggregates so far (tests wait on them). */
static PyObject *py_summary_stats(PyObject *self, PyObject *unused)
{
    sum_device copy[SUMMARY_MAX_DEVICES];
    PyObject *list, *d, *frames;
    int n = 0, mine = S.started && !oc_thread_inherited(&S.th);
    (void)self;
    (void)unused;
    if (mine) {
        pthread_mutex_lock(&S.th.lock);
        n = S.n;
        memcpy(copy, S.dev, sizeof copy);
        frames = Py_BuildValue("{s:K,s:K,s:l,s:O,s:O,s:d,s:d}", "samples", S.frame_samples,
                               "waiting", S.frame_waits, "workers", S.waited_workers, "on",
                               S.frames_on ? Py_True : Py_False, "in_worker",
                               S.in_worker ? Py_True : Py_False, "gil_wait_s", S.gil_wait_s,
                               "gil_held_s", S.gil_held_s);
        pthread_mutex_unlock(&S.th.lock);
    } else {
        frames = Py_BuildValue("{s:i,s:i,s:i,s:O,s:O,s:d,s:d}", "samples", 0, "waiting", 0,
                               "workers", -1, "on", Py_False, "in_worker", Py_False, "gil_wait_s",
                               0.0, "gil_held_s", 0.0);
    }
    list = frames != NULL ? PyList_New(0) : NULL;
    for (int i = 0; list != NULL && i < n; i++) {
        d = Py_BuildValue("{s:i,s:i,s:K,s:K,s:d,s:K,s:K,s:K,s:K,s:K}", "device",
                          copy[i].torch_index, "nvml_index", copy[i].nvml_index, "ticks",
                          copy[i].ticks, "util_samples", copy[i].util_samples, "util_sum",
                          copy[i].util_sum, "under_50", copy[i].under_low, "mem_peak",
                          copy[i].mem_peak, "mem_total", copy[i].mem_total, "paired",
                          copy[i].paired_samples, "paired_wait_low", copy[i].paired_wait_low);
        if (d == NULL || PyList_Append(list, d) < 0)
            Py_CLEAR(list);
        Py_XDECREF(d);
    }
    if (list == NULL) {
        Py_XDECREF(frames);
        return NULL;
    }
    return Py_BuildValue("{s:O,s:s,s:l,s:N,s:N}", "running", mine && S.running ? Py_True : Py_False,
                         "why", mine ? S.why : "", "interval_ms", mine ? S.interval_ms : 0L,
                         "devices", list, "frames", frames);
}

OC_EDGE_VARARGS(py_summary_start)

/* Behind the test door (_outofcuda._testing, module.c). */
PyMethodDef oc_summary_testing_methods[] = {
    OC_METHOD(
        "summary_start", py_summary_start,
        "summary_start(devices, interval_ms=200, /)\n--\n\nStart the exit summary's sampler for "
        "these CUDA device indices as CUDA initialisation would."),
    {NULL, NULL, 0, NULL},
};

OC_EDGE_NOARGS(py_summary_stats)

PyMethodDef oc_summary_methods[] = {
    OC_METHOD("_summary_stats", py_summary_stats,
              "_summary_stats()\n--\n\nThe exit summary's aggregates so far (for tests)."),
    {NULL, NULL, 0, NULL},
};
