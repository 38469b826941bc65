/* summary.c - OUTOFCUDA_SUMMARY: what the GPU did, printed at exit.
 *
 * When CUDA initialises (torch's lazy-init queue) a native thread starts
 * sampling each device's utilisation and memory from NVML into fixed-size
 * aggregates. It never takes the GIL and touches no Python object; like the
 * watchdog in monitor.c it blocks every signal, waits on a condition variable
 * with a CLOCK_MONOTONIC deadline, and is joined, never detached. At exit an
 * atexit callback (registered when CUDA initialised, so a process that never
 * uses CUDA does no work at all) joins it, adds torch's peak figures, the OOM
 * and micro-batch counts, ranks up to three hints and prints one block per
 * device used, or writes the JSON form. */
#include "oc.h"

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
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
#define JOIN_LIMIT_S 5

typedef struct {
    int torch_index, nvml_index;
    char name[96];
    /* written by the sampler under S.lock */
    unsigned long long ticks, util_samples, under_low, mem_samples, mem_peak, mem_total;
    double util_sum;
    /* filled at exit, with the GIL */
    long long peak_allocated, peak_reserved; /* -1: unknown */
} sum_device;

/* The sampler thread's state: outside oc_state (oc.h) because the thread
 * reads and writes it without the GIL, under th.lock. */
static struct {
    oc_thread th; /* th.lock guards the aggregates and stop_requested */
    int started, running, stop_requested;
    long interval_ms;
    double t0; /* oc_thread_now() when CUDA started */
    int n;
    sum_device dev[SUMMARY_MAX_DEVICES];
    char why[240]; /* why nothing is sampled, or "" */
} S;

/* ---- the sampler thread: no Python object, no GIL ---- */

static void sample_device(sum_device *d)
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
    }
    pthread_mutex_unlock(&S.th.lock);
}

static void *sampler(void *arg)
{
    (void)arg;
    pthread_mutex_lock(&S.th.lock);
    while (!S.stop_requested) {
        struct timespec deadline;
        pthread_mutex_unlock(&S.th.lock);
        for (int i = 0; i < S.n; i++)
            if (S.dev[i].nvml_index >= 0)
                sample_device(&S.dev[i]);
        deadline = oc_thread_deadline(S.interval_ms / 1000, (S.interval_ms % 1000) * 1000000L);
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
    int joined;
    if (!S.running || oc_thread_inherited(&S.th) || pthread_equal(pthread_self(), S.th.thread))
        return;
    oc_thread_request_stop(&S.th, &S.stop_requested);
    /* At most JOIN_LIMIT_S: an NVML call can hang in a broken driver. */
    Py_BEGIN_ALLOW_THREADS
    joined = oc_thread_join(S.th.thread, JOIN_LIMIT_S);
    Py_END_ALLOW_THREADS
    /* A thread stuck in a driver call is left behind rather than hang the
     * exit; it writes only to this static state, under the lock. */
    S.running = joined ? 0 : S.running;
}

/* ---- where the summary goes ---- */

/* Resolves OUTOFCUDA_SUMMARY's JSON path to an absolute one now (the working
 * directory may change before exit). A directory that does not exist gets one
 * warning and turns the feature off. Returns the mode. */
static oc_summary_mode resolve_output(void)
{
    const oc_config *cfg = oc_config_get();
    char dir[OC_SUMMARY_PATH_MAX], msg[OC_WARN_LEN + 2 * OC_SUMMARY_PATH_MAX];
    if (oc_g.summary_out.resolved)
        return oc_g.summary_out.mode;
    oc_g.summary_out.resolved = 1;
    oc_g.summary_out.mode = cfg->summary;
    if (oc_g.summary_out.mode != OC_SUMMARY_JSON)
        return oc_g.summary_out.mode;
    if (oc_resolve_file_path(cfg->summary_path, dir, sizeof dir, oc_g.summary_out.json_path,
                             sizeof oc_g.summary_out.json_path) != 0) {
        snprintf(msg, sizeof msg,
                 "outofcuda: ignoring OUTOFCUDA_SUMMARY=%.300s: the directory %.300s does not "
                 "exist; no summary will be written",
                 cfg->summary_path, dir);
        oc_warn(msg);
        oc_g.summary_out.json_path[0] = '\0';
        oc_g.summary_out.mode = OC_SUMMARY_OFF;
    }
    return oc_g.summary_out.mode;
}

/* RANK (torchrun's global rank), else LOCAL_RANK, else -1. */
static long env_rank(void)
{
    long r = oc_env_rank("RANK");
    return r >= 0 ? r : oc_env_rank("LOCAL_RANK");
}

/* ---- starting ---- */

static PyObject *at_exit(PyObject *self, PyObject *unused);
static PyMethodDef at_exit_def = {"outofcuda_summary_at_exit", at_exit, METH_NOARGS, NULL};

/* atexit.register(at_exit), once per process (a forked child inherits both
 * the registration and this flag). Returns 0 or -1 with an exception set. */
static int register_at_exit(void)
{
    PyObject *atexit_mod, *fn, *r;
    if (oc_g.summary_out.atexit_registered)
        return 0;
    atexit_mod = PyImport_ImportModule("atexit");
    fn = atexit_mod ? oc_edge_function(&at_exit_def, NULL, NULL) : NULL;
    r = fn ? PyObject_CallMethod(atexit_mod, "register", "O", fn) : NULL;
    Py_XDECREF(fn);
    Py_XDECREF(atexit_mod);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    oc_g.summary_out.atexit_registered = 1;
    return 0;
}

/* Starts the clock and, where NVML knows the devices, the sampler for the
 * given torch device indices. Returns 0, or -1 with an exception set. */
static int summary_begin(const int *torch_index, int n, long interval_ms)
{
    char why[200] = "";
    int sampled = 0, rc;
    if (S.started && !oc_thread_inherited(&S.th))
        return 0;
    /* Fresh primitives: a forked child may inherit a lock the parent's thread held. */
    memset(&S, 0, sizeof S);
    oc_thread_init(&S.th);
    S.interval_ms = interval_ms;
    n = n < SUMMARY_MAX_DEVICES ? n : SUMMARY_MAX_DEVICES;
    S.n = n;
    for (int i = 0; i < n; i++) {
        S.dev[i].torch_index = torch_index[i];
        S.dev[i].nvml_index = oc_nvml_index(torch_index[i]);
        S.dev[i].peak_allocated = S.dev[i].peak_reserved = -1;
        sampled += S.dev[i].nvml_index >= 0;
    }
    S.t0 = oc_thread_now();
    S.started = 1;
    if (register_at_exit() < 0)
        return -1;
    if (!oc_nvml_available(why, sizeof why)) {
        snprintf(S.why, sizeof S.why, "%s", why);
        return 0;
    }
    if (sampled == 0) {
        snprintf(S.why, sizeof S.why, "NVML shows none of this process's CUDA devices");
        return 0;
    }
    /* Named before start returns, so `top -H` and tests see it at once. */
    rc = oc_thread_start(&S.th, sampler, NULL, "oc-summary");
    if (rc != 0) {
        snprintf(S.why, sizeof S.why, "the sampling thread could not start (%s)", strerror(rc));
        return 0;
    }
    S.running = 1;
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
    int n;
    n = choose_devices(devices);
    if (summary_begin(devices, n, DEFAULT_INTERVAL_MS) < 0)
        oc_set_error("starting the exit summary");
    OC_CLEAR();
}

void oc_summary_prepare(void)
{
    if (oc_config_get()->summary != OC_SUMMARY_OFF && resolve_output() != OC_SUMMARY_OFF)
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

/* ---- hints: advice.c ranks them over the figures ---- */

/* Up to HINTS_MAX hints for one device, highest score first. */
static int make_hints(const sum_device *d, long workers, oc_advice_item *h)
{
    oc_summary_figures f;
    memset(&f, 0, sizeof f);
    f.util_samples = d->util_samples;
    f.under_low = d->under_low;
    f.util_sum = d->util_sum;
    f.mem_samples = d->mem_samples;
    f.mem_peak = d->mem_peak;
    f.mem_total = d->mem_total;
    f.peak_allocated = d->peak_allocated;
    f.peak_reserved = d->peak_reserved;
    f.workers = workers;
    f.expandable = oc_alloc_expandable(oc_g.alloc_value);
    f.no_expandable_here = oc_platform_no_expandable();
    return oc_summary_hints(&f, h, HINTS_MAX + 1);
}

/* ---- at exit: the block and the JSON ---- */

typedef struct {
    char *buf;
    size_t len, cap;
} text;

static void appendf(text *t, const char *fmt, ...)
{
    va_list ap;
    int n;
    if (t->buf == NULL || t->len + 1 >= t->cap)
        return;
    va_start(ap, fmt);
    n = vsnprintf(t->buf + t->len, t->cap - t->len, fmt, ap);
    va_end(ap);
    if (n > 0)
        t->len = t->len + (size_t)n < t->cap ? t->len + (size_t)n : t->cap - 1;
}

typedef struct {
    double wall;
    long rank, workers;
    unsigned long ooms;
    long long splits;
} proc_figs;

static void format_block(text *t, const sum_device *d, const proc_figs *p, const oc_advice_item *h,
                         int nh)
{
    char pre[32] = "";
    if (p->rank >= 0)
        snprintf(pre, sizeof pre, "[rank %ld] ", p->rank);
    appendf(t, "%soutofcuda summary: cuda:%d%s%s", pre, d->torch_index, d->name[0] ? " " : "",
            d->name);
    if (d->nvml_index >= 0)
        appendf(t, " (NVML %d)", d->nvml_index);
    appendf(t, ", %.1f s since CUDA started\n", p->wall);
    if (d->util_samples > 0)
        appendf(t,
                "%s  utilisation    mean %.1f %%; under %d %% in %.1f %% of %llu samples "
                "(every %ld ms, all processes)\n",
                pre, d->util_sum / (double)d->util_samples, LOW_UTIL,
                100.0 * (double)d->under_low / (double)d->util_samples, d->util_samples,
                S.interval_ms);
    else
        appendf(t, "%s  utilisation    not sampled: %s\n", pre,
                S.why[0]            ? S.why
                : d->nvml_index < 0 ? "NVML does not show this device"
                : d->ticks > 0      ? "NVML gave no utilisation for this device"
                                    : "no sample taken yet");
    if (d->mem_samples > 0)
        appendf(t, "%s  device memory  peak %.2f of %.2f GiB (%.1f %%, all processes)\n", pre,
                (double)d->mem_peak / OC_GIB, (double)d->mem_total / OC_GIB,
                100.0 * (double)d->mem_peak / (double)d->mem_total);
    if (d->peak_allocated >= 0 && d->peak_reserved >= 0)
        appendf(t, "%s  this process   peak allocated %.2f GiB, peak reserved %.2f GiB\n", pre,
                (double)d->peak_allocated / OC_GIB, (double)d->peak_reserved / OC_GIB);
    else
        appendf(t, "%s  this process   no allocator figures (torch's CUDA is not initialised)\n",
                pre);
    appendf(t, "%s  events         %lu CUDA OOM%s, %lld micro-batch split%s\n", pre, p->ooms,
            p->ooms == 1 ? "" : "s", p->splits, p->splits == 1 ? "" : "s");
    for (int i = 0; i < nh; i++)
        appendf(t, "%s  hint %d         %s\n", pre, i + 1, h[i].text);
}

/* The known bugs that apply here and that outofcuda does not avoid
 * (knownbugs.c), once per process, after the device blocks. */
static void append_known_bugs(text *t, const proc_figs *p)
{
    char pre[32] = "", lines[4096];
    if (p->rank >= 0)
        snprintf(pre, sizeof pre, "[rank %ld] ", p->rank);
    if (oc_known_bugs_summary(lines, sizeof lines, pre) > 0)
        appendf(t, "%s", lines);
}

static PyObject *none_or_ll(long long x)
{
    if (x < 0)
        Py_RETURN_NONE;
    return PyLong_FromLongLong(x);
}

static PyObject *none_or_double(int known, double x)
{
    if (!known)
        Py_RETURN_NONE;
    return PyFloat_FromDouble(x);
}

/* One device's entry of the JSON form (new reference or NULL). */
static PyObject *device_dict(const sum_device *d, const oc_advice_item *h, int nh)
{
    PyObject *hints = PyList_New(0);
    int u = d->util_samples > 0, m = d->mem_samples > 0;
    for (int i = 0; hints != NULL && i < nh; i++) {
        PyObject *s = PyUnicode_FromString(h[i].text);
        if (s == NULL || PyList_Append(hints, s) < 0)
            Py_CLEAR(hints);
        Py_XDECREF(s);
    }
    if (hints == NULL)
        return NULL;
    return Py_BuildValue(
        "{s:i,s:N,s:s,s:K,s:N,s:N,s:N,s:N,s:N,s:N,s:N}", "device", d->torch_index, "nvml_index",
        none_or_ll(d->nvml_index), "name", d->name, "samples", d->util_samples, "utilization_mean",
        none_or_double(u, u ? d->util_sum / (double)d->util_samples : 0.0),
        "utilization_under_50_share",
        none_or_double(u, u ? (double)d->under_low / (double)d->util_samples : 0.0),
        "memory_used_peak", m ? PyLong_FromUnsignedLongLong(d->mem_peak) : none_or_ll(-1),
        "memory_total", m ? PyLong_FromUnsignedLongLong(d->mem_total) : none_or_ll(-1),
        "peak_allocated", none_or_ll(d->peak_allocated), "peak_reserved",
        none_or_ll(d->peak_reserved), "hints", hints);
}

/* "x.json" -> "x.rank3.json" so that ranks do not overwrite each other. */
static void json_target(long rank, char *path, size_t sz)
{
    size_t n = strlen(oc_g.summary_out.json_path);
    if (rank < 0)
        snprintf(path, sz, "%s", oc_g.summary_out.json_path);
    else
        snprintf(path, sz, "%.*s.rank%ld.json", (int)(n - 5), oc_g.summary_out.json_path, rank);
}

/* Writes the JSON form (through a temporary file, renamed into place).
 * Returns 0, or -1 with the reason in err. */
static int write_json(PyObject *doc, long rank, char *err, size_t errsz)
{
    char path[PATH_MAX + 32], tmp[PATH_MAX + 64];
    PyObject *json = PyImport_ImportModule("json");
    PyObject *s = json ? PyObject_CallMethod(json, "dumps", "O", doc) : NULL;
    PyObject *b = s ? PyUnicode_AsUTF8String(s) : NULL;
    FILE *f;
    int rc = -1;
    json_target(rank, path, sizeof path);
    snprintf(tmp, sizeof tmp, "%s.tmp%ld", path, (long)getpid());
    if (b == NULL) {
        snprintf(err, errsz, "the JSON could not be built");
        goto done;
    }
    f = fopen(tmp, "w");
    if (f == NULL) {
        snprintf(err, errsz, "%s: %s", tmp, strerror(errno));
        goto done;
    }
    if (fwrite(PyBytes_AsString(b), 1, (size_t)PyBytes_Size(b), f) != (size_t)PyBytes_Size(b) ||
        fputc('\n', f) == EOF) {
        snprintf(err, errsz, "%s: %s", tmp, strerror(errno));
        fclose(f);
        remove(tmp);
        goto done;
    }
    if (fclose(f) != 0 || rename(tmp, path) != 0) {
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

/* Builds the per-device text blocks and, in JSON mode, the document. */
static void emit(const proc_figs *p, const sum_device *dev, int n)
{
    text t = {malloc(65536), 0, 65536};
    PyObject *devices = oc_g.summary_out.mode == OC_SUMMARY_JSON ? PyList_New(0) : NULL;
    char err[PATH_MAX + 200];
    for (int i = 0; i < n; i++) {
        oc_advice_item h[HINTS_MAX + 1];
        int nh = make_hints(&dev[i], p->workers, h);
        nh = nh < HINTS_MAX ? nh : HINTS_MAX;
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
    if (oc_g.summary_out.mode == OC_SUMMARY_JSON) {
        PyObject *doc = devices ? Py_BuildValue("{s:i,s:N,s:d,s:k,s:L,s:N,s:l,s:O}", "version", 1,
                                                "rank", none_or_ll(p->rank), "wall_s", p->wall,
                                                "ooms", p->ooms, "microbatch_splits", p->splits,
                                                "dataloader_workers", none_or_ll(p->workers),
                                                "interval_ms", S.interval_ms, "devices", devices)
                                : NULL;
        if (doc != NULL && write_json(doc, p->rank, err, sizeof err) == 0) {
            Py_DECREF(doc);
            goto done;
        }
        OC_CLEAR();
        Py_XDECREF(doc);
        /* Never lose the figures: print them where the file could not go. */
        oc_stderr_printf("outofcuda: OUTOFCUDA_SUMMARY: could not write the JSON (%s); the "
                         "summary follows\n",
                         devices ? err : "the JSON could not be built");
    }
    if (t.buf != NULL)
        oc_stderr_write(t.buf);
done:
    OC_CLEAR();
    Py_XDECREF(devices);
    free(t.buf);
}

/* atexit callback: join the sampler, gather, print or write. Never raises. */
static PyObject *at_exit(PyObject *self, PyObject *unused)
{
    proc_figs p;
    sum_device dev[SUMMARY_MAX_DEVICES];
    int n;
    double wall;
    PyObject *type, *value, *tb;
    (void)self;
    (void)unused;
    /* A forked child inherits the registration but not the thread or the
     * figures' meaning: only the process that started the clock reports. */
    if (!S.started || oc_thread_inherited(&S.th))
        Py_RETURN_NONE;
    S.started = 0;
    PyErr_Fetch(&type, &value, &tb);
    wall = oc_thread_now() - S.t0;
    sampler_stop();
    /* A copy: a thread that could not be joined may still write S.dev. */
    pthread_mutex_lock(&S.th.lock);
    n = S.n;
    memcpy(dev, S.dev, sizeof dev);
    pthread_mutex_unlock(&S.th.lock);
    memset(&p, 0, sizeof p);
    p.wall = wall;
    p.rank = env_rank();
    p.ooms = oc_g.oom_events;
    p.splits = oc_g.microbatch_splits;
    torch_figures(dev, &n);
    p.workers = dataloader_workers();
    if (oc_g.summary_out.mode != OC_SUMMARY_OFF)
        emit(&p, dev, n);
    OC_CLEAR();
    PyErr_Restore(type, value, tb);
    Py_RETURN_NONE;
}

/* ---- test-only entry points ---- */

/* _testing.summary_start(devices, interval_ms=200) -> bool. Starts the
 * clock, the sampler for the given torch device indices and the exit report
 * as CUDA's initialisation would, without CUDA. Output as OUTOFCUDA_SUMMARY
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
    if (oc_config_get()->summary != OC_SUMMARY_OFF && resolve_output() == OC_SUMMARY_OFF)
        Py_RETURN_FALSE;
    if (!oc_g.summary_out.resolved || oc_g.summary_out.mode == OC_SUMMARY_OFF) {
        oc_g.summary_out.resolved = 1;
        oc_g.summary_out.mode = OC_SUMMARY_STDERR;
    }
    if (summary_begin(devices, n, interval_ms) < 0)
        return NULL;
    Py_RETURN_TRUE;
}

/* _summary_stats() -> dict(running, why, interval_ms, devices=[...]): the
 * aggregates so far (tests wait on them). */
static PyObject *py_summary_stats(PyObject *self, PyObject *unused)
{
    sum_device copy[SUMMARY_MAX_DEVICES];
    PyObject *list, *d;
    int n = 0, mine = S.started && !oc_thread_inherited(&S.th);
    (void)self;
    (void)unused;
    if (mine) {
        pthread_mutex_lock(&S.th.lock);
        n = S.n;
        memcpy(copy, S.dev, sizeof copy);
        pthread_mutex_unlock(&S.th.lock);
    }
    list = PyList_New(0);
    for (int i = 0; list != NULL && i < n; i++) {
        d = Py_BuildValue("{s:i,s:i,s:K,s:K,s:d,s:K,s:K,s:K}", "device", copy[i].torch_index,
                          "nvml_index", copy[i].nvml_index, "ticks", copy[i].ticks, "util_samples",
                          copy[i].util_samples, "util_sum", copy[i].util_sum, "under_50",
                          copy[i].under_low, "mem_peak", copy[i].mem_peak, "mem_total",
                          copy[i].mem_total);
        if (d == NULL || PyList_Append(list, d) < 0)
            Py_CLEAR(list);
        Py_XDECREF(d);
    }
    if (list == NULL)
        return NULL;
    return Py_BuildValue("{s:O,s:s,s:l,s:N}", "running", mine && S.running ? Py_True : Py_False,
                         "why", mine ? S.why : "", "interval_ms", mine ? S.interval_ms : 0L,
                         "devices", list);
}

/* Behind the test door (_outofcuda._testing, module.c). */
PyMethodDef oc_summary_testing_methods[] = {
    {"summary_start", py_summary_start, METH_VARARGS,
     "summary_start(devices, interval_ms=200, /)\n--\n\nStart the exit summary's sampler for "
     "these CUDA device indices as CUDA initialisation would."},
    {NULL, NULL, 0, NULL},
};

PyMethodDef oc_summary_methods[] = {
    {"_summary_stats", py_summary_stats, METH_NOARGS,
     "_summary_stats()\n--\n\nThe exit summary's aggregates so far (for tests)."},
    {NULL, NULL, 0, NULL},
};
