/* api.c - the decisions behind the Python API (outofcuda/api.py): autocast
 * dtype, DataLoader worker counts and shared memory, channels-last format,
 * memory figures, cache clearing. Nothing here imports torch or initialises
 * CUDA: torch is only looked up in sys.modules, and its allocator is only
 * asked once torch.cuda.is_initialized() says CUDA is already up. */
#include "oc.h"

#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/statvfs.h>
#include <unistd.h>

/* Docker's default /dev/shm is 64 MiB; a few workers each holding
 * prefetch_factor batches of images exhaust anything this small ("bus error"
 * or "unable to write to file </torch_...>"). */
#define OC_SHM_MIN_BYTES (512ULL * 1024 * 1024)

/* ---- torch's allocator, only when CUDA is already initialised ---- */

/* Returns torch.cuda (new ref) when torch is imported and CUDA initialised,
 * else NULL with no exception: asking earlier would initialise CUDA. */
static PyObject *initialised_torch_cuda(void)
{
    PyObject *torch = oc_sys_module("torch");
    PyObject *cuda = torch ? PyObject_GetAttrString(torch, "cuda") : NULL;
    PyObject *r = cuda ? PyObject_CallMethod(cuda, "is_initialized", NULL) : NULL;
    if (r != Py_True)
        Py_CLEAR(cuda);
    OC_CLEAR();
    Py_XDECREF(r);
    Py_XDECREF(torch);
    return cuda;
}

static long long stat_value(PyObject *stats, const char *key)
{
    PyObject *v = PyDict_GetItemString(stats, key);
    long long x = v ? PyLong_AsLongLong(v) : 0;
    if (x == -1 && PyErr_Occurred()) {
        OC_CLEAR();
        x = 0;
    }
    return x;
}

int oc_api_torch_stats(int torch_index, oc_torch_mem *out)
{
    PyObject *cuda = initialised_torch_cuda(), *stats = NULL;
    int ok = 0;
    memset(out, 0, sizeof *out);
    if (cuda == NULL)
        return 0;
    stats = PyObject_CallMethod(cuda, "memory_stats", "i", torch_index);
    if (stats == NULL || !PyDict_Check(stats) || PyDict_Size(stats) == 0)
        goto error;
    out->allocated = stat_value(stats, "allocated_bytes.all.current");
    out->reserved = stat_value(stats, "reserved_bytes.all.current");
    out->peak_allocated = stat_value(stats, "allocated_bytes.all.peak");
    ok = 1;
error:
    OC_CLEAR();
    Py_XDECREF(stats);
    Py_DECREF(cuda);
    return ok;
}

/* Sum of torch's reserved bytes over the devices it sees; 0 when CUDA is not
 * initialised. */
static long long total_reserved(PyObject *cuda)
{
    PyObject *r = PyObject_CallMethod(cuda, "device_count", NULL);
    long n = r ? PyLong_AsLong(r) : 0;
    long long sum = 0;
    Py_XDECREF(r);
    OC_CLEAR();
    for (long i = 0; i < n && i < OC_NVML_MAX_DEVICES; i++) {
        oc_torch_mem m;
        if (oc_api_torch_stats((int)i, &m))
            sum += m.reserved;
    }
    return sum;
}

int oc_api_clear_cache(long long *released)
{
    PyObject *cuda, *r;
    long long before = 0;
    *released = 0;
    /* Collect first: tensors kept alive only by reference cycles go back to
     * the cache, which empty_cache then hands to the driver. */
    if (oc_config_get()->gc_collect) {
        PyObject *gc = PyImport_ImportModule("gc");
        r = gc ? PyObject_CallMethod(gc, "collect", NULL) : NULL;
        Py_XDECREF(gc);
        if (r == NULL)
            return -1;
        Py_DECREF(r);
    }
    cuda = initialised_torch_cuda();
    if (cuda == NULL)
        return 0;
    before = total_reserved(cuda);
    r = PyObject_CallMethod(cuda, "empty_cache", NULL);
    if (r == NULL) {
        Py_DECREF(cuda);
        return -1;
    }
    Py_DECREF(r);
    *released = before - total_reserved(cuda);
    if (*released < 0)
        *released = 0;
    Py_DECREF(cuda);
    return 0;
}

/* ---- autocast dtype ---- */

/* _api_autocast_dtype(device_type) -> (dtype name or None, reason). None
 * leaves torch's own default for that device type. */
static PyObject *py_autocast_dtype(PyObject *self, PyObject *arg)
{
    const oc_config *cfg = oc_config_get();
    const oc_record *hook = oc_record_get(OC_OPT_AMP_DTYPE);
    char dev[32], reason[260];
    (void)self;
    if (!PyUnicode_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "device_type must be a str such as 'cuda' or 'cpu'");
        return NULL;
    }
    oc_utf8(arg, dev, sizeof dev);
    if (cfg->amp_dtype == OC_AMP_AUTO && strcmp(dev, "cpu") == 0)
        return Py_BuildValue("(ss)", "bfloat16", "CPU autocast computes in bfloat16");
    if (cfg->amp_dtype == OC_AMP_AUTO && strcmp(dev, "cuda") != 0)
        return Py_BuildValue("(Os)", Py_None, "torch's default for this device type");
    /* Passing the hook's choice explicitly matters: torch's autocast dtype
     * is thread-local, so the hook's setting holds only in the importing
     * thread. */
    if (cfg->amp_dtype == OC_AMP_AUTO && hook->state == OC_REC_APPLIED && hook->kind == OC_VAL_TEXT)
        return Py_BuildValue("(ss)", hook->text, "the start-up hook's choice");
    /* A dtype the user set holds on every device type (NULL under
     * OC_AMP_OFF: torch's own default); under auto, the start-up hook's rule
     * (bridge.c asks the same): no guess when the capability is unknown, None
     * leaves torch's own CUDA default. */
    return Py_BuildValue("(zs)", oc_amp_cuda_dtype(cfg, reason, sizeof reason), reason);
}

const char *oc_amp_cuda_dtype(const oc_config *cfg, char *reason, size_t sz)
{
    char why[200] = "";
    int cc;
    if (cfg->amp_dtype == OC_AMP_OFF) {
        snprintf(reason, sz, "off by OUTOFCUDA_AMP_DTYPE: torch's own default");
        return NULL;
    }
    if (cfg->amp_dtype != OC_AMP_AUTO) {
        const char *name = cfg->amp_dtype == OC_AMP_BFLOAT16 ? "bfloat16" : "float16";
        snprintf(reason, sz, "OUTOFCUDA_AMP_DTYPE=%s", name);
        return name;
    }
    cc = oc_nvml_available(why, sizeof why) ? oc_nvml_min_visible_cc() : -1;
    if (cc < 0) {
        snprintf(reason, sz, "compute capability unknown: %s",
                 why[0] ? why : "no visible GPU reported a compute capability");
        return NULL;
    }
    snprintf(reason, sz, "compute capability %d.%d %s 8.0 (from NVML)", cc / 10, cc % 10,
             cc >= 80 ? ">=" : "<");
    return cc >= 80 ? "bfloat16" : "float16";
}

/* ---- DataLoader plan ---- */

/* CPUs this process may run on: the affinity mask, lowered by a cgroup v2
 * CPU quota (containers limited with --cpus keep a full affinity mask). */
static long usable_cpus(void)
{
    cpu_set_t set;
    long n = 1;
    FILE *f;
    if (sched_getaffinity(0, sizeof set, &set) == 0)
        n = CPU_COUNT(&set);
    f = fopen("/sys/fs/cgroup/cpu.max", "r");
    if (f != NULL) {
        char quota[32] = "";
        long period = 0;
        if (fscanf(f, "%31s %ld", quota, &period) == 2 && strcmp(quota, "max") != 0 && period > 0) {
            long q = atol(quota);
            long cap = (q + period - 1) / period;
            if (cap >= 1 && cap < n)
                n = cap;
        }
        fclose(f);
    }
    return n < 1 ? 1 : n;
}

long oc_loader_suggestion(long *cpus)
{
    const oc_config *cfg = oc_config_get();
    *cpus = usable_cpus();
    return cfg->num_workers < *cpus ? cfg->num_workers : *cpus;
}

static int shm_warned; /* the shared-memory warning was given, once per process */

/* _api_loader_plan(cuda_available, num_workers=-1, shm_path="/dev/shm",
 * shm_min_bytes=512 MiB) -> dict: the DataLoader arguments outofcuda proposes
 * (num_workers: the caller's, or -1 for outofcuda's), the CPU count behind
 * them, the shared-memory verdict for those workers (shm_present,
 * shm_enough, shm_min_bytes: what smart_dataloader and `outofcuda doctor`
 * both go by) and, the first time workers meet a too-small /dev/shm, a
 * warning. */
static PyObject *py_loader_plan(PyObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"cuda_available", "num_workers", "shm_path", "shm_min_bytes", NULL};
    const oc_config *cfg = oc_config_get();
    const char *shm_path = "/dev/shm";
    unsigned long long shm_min = OC_SHM_MIN_BYTES, shm_total = 0;
    int cuda_available, shm_ok, shm_enough;
    long cpus, workers, requested = -1;
    char warning[400] = "";
    struct statvfs st;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "p|lsK", kwlist, &cuda_available, &requested,
                                     &shm_path, &shm_min))
        return NULL;
    /* The cap also keeps torch's own "suggested max number of worker" warning
     * away, which compares with the affinity mask. */
    workers = oc_loader_suggestion(&cpus);
    workers = requested >= 0 ? requested : workers;
    shm_ok = statvfs(shm_path, &st) == 0; /* -1: no /dev/shm */
    if (shm_ok)
        shm_total = (unsigned long long)st.f_blocks * st.f_frsize;
    shm_enough = workers <= 0 || (shm_ok && shm_total >= shm_min);
    if (!shm_enough && !shm_warned) {
        shm_warned = 1;
        if (shm_ok)
            snprintf(warning, sizeof warning,
                     "outofcuda: %s holds only %llu MiB; DataLoader workers pass batches "
                     "through it and may fail with a bus error. Give the container more "
                     "(docker run --shm-size=2g or --ipc=host) or set num_workers=0",
                     shm_path, shm_total >> 20);
        else
            snprintf(warning, sizeof warning,
                     "outofcuda: %s is missing; DataLoader workers need shared memory and may "
                     "fail. Mount a tmpfs there or set num_workers=0",
                     shm_path);
    }
    return Py_BuildValue(
        "{s:l,s:N,s:O,s:O,s:l,s:K,s:s,s:O,s:O,s:K}", "num_workers", workers, "prefetch_factor",
        /* None: off (OUTOFCUDA_PREFETCH_FACTOR=off), torch's own default */
        cfg->prefetch_factor > 0 ? PyLong_FromLong(cfg->prefetch_factor)
                                 : (Py_IncRef(Py_None), Py_None),
        "persistent_workers", workers > 0 ? Py_True : Py_False, "pin_memory",
        (cfg->pin_memory && cuda_available) ? Py_True : Py_False, "cpus", cpus, "shm_bytes",
        shm_total, "shm_warning", warning, "shm_present", shm_ok ? Py_True : Py_False, "shm_enough",
        shm_enough ? Py_True : Py_False, "shm_min_bytes", shm_min);
}

/* ---- model memory format ---- */

/* _api_memory_format(has_4d, has_5d, channels_last=None) -> (format or None,
 * reason). channels_last True/False overrides OUTOFCUDA_CHANNELS_LAST for one
 * call. "mixed" asks the caller to convert each weight by its rank:
 * Module.to() with one format raises on weights of the other rank. */
static PyObject *py_memory_format(PyObject *self, PyObject *args)
{
    PyObject *override = Py_None;
    int has4, has5, wanted;
    (void)self;
    if (!PyArg_ParseTuple(args, "pp|O", &has4, &has5, &override))
        return NULL;
    if (override != Py_None && override != Py_True && override != Py_False) {
        PyErr_SetString(PyExc_TypeError, "channels_last must be True, False or None");
        return NULL;
    }
    wanted = override == Py_None ? oc_config_get()->channels_last : override == Py_True;
    if (!wanted)
        return Py_BuildValue("(Os)", Py_None,
                             override == Py_None ? "OUTOFCUDA_CHANNELS_LAST=0"
                                                 : "channels_last=False");
    if (has4 && has5)
        return Py_BuildValue("(ss)", "mixed", "4-D weights channels_last, 5-D channels_last_3d");
    if (has4)
        return Py_BuildValue("(ss)", "channels_last", "the model has 4-D weights");
    if (has5)
        return Py_BuildValue("(ss)", "channels_last_3d", "the model has 5-D weights");
    return Py_BuildValue("(Os)", Py_None, "no 4-D or 5-D weights: the layout does not matter");
}

/* ---- memory report ---- */

static double gb(unsigned long long bytes)
{
    /* GiB rounded to the MiB, the product's `total_gb: 80.0` for an 80 GiB card. */
    return (double)(long long)((double)bytes / OC_GIB * 1000.0 + 0.5) / 1000.0;
}

/* The processes holding memory on NVML device `index`, largest first, as
 * [{pid, name, used_gb, this_process}]; None where NVML cannot list them. */
static PyObject *process_dicts(int index)
{
    oc_gpu_proc *procs;
    unsigned int me = (unsigned int)getpid();
    int n = oc_nvml_process_list(index, &procs);
    PyObject *list;
    if (n < 0)
        Py_RETURN_NONE;
    oc_nvml_sort_procs(procs, n);
    list = PyList_New(0);
    for (int i = 0; list != NULL && i < n; i++) {
        char name[256];
        PyObject *pname, *used, *d;
        pname = oc_proc_name(procs[i].pid, name, sizeof name) == 0
                    ? PyUnicode_DecodeUTF8(name, (Py_ssize_t)strlen(name), "replace")
                    : (Py_INCREF(Py_None), Py_None);
        used = procs[i].used == OC_NVML_NOT_AVAILABLE ? (Py_INCREF(Py_None), Py_None)
                                                      : PyFloat_FromDouble(gb(procs[i].used));
        d = (pname && used)
                ? Py_BuildValue("{s:I,s:O,s:O,s:O}", "pid", procs[i].pid, "name", pname, "used_gb",
                                used, "this_process", procs[i].pid == me ? Py_True : Py_False)
                : NULL;
        Py_XDECREF(pname);
        Py_XDECREF(used);
        if (d == NULL || PyList_Append(list, d) < 0)
            Py_CLEAR(list);
        Py_XDECREF(d);
    }
    free(procs);
    return list;
}

/* _api_memory_report() -> {"cuda:N": {...}}; {} without a GPU or NVML. */
static PyObject *py_memory_report(PyObject *self, PyObject *unused)
{
    int map[OC_NVML_MAX_DEVICES], n;
    PyObject *report = PyDict_New();
    (void)self;
    (void)unused;
    if (report == NULL)
        return NULL;
    n = oc_nvml_visible_map(map, OC_NVML_MAX_DEVICES);
    for (int t = 0; report != NULL && t < n; t++) {
        oc_gpu_info g;
        oc_torch_mem m;
        char key[32];
        PyObject *d, *procs;
        if (oc_nvml_device_info(map[t], &g) != 0)
            continue;
        oc_api_torch_stats(t, &m);
        snprintf(key, sizeof key, "cuda:%d", t);
        d = Py_BuildValue("{s:s,s:d,s:d,s:d,s:d,s:d,s:d,s:i}", "name", g.name, "total_gb",
                          gb(g.total), "allocated_gb", gb((unsigned long long)m.allocated),
                          "reserved_gb", gb((unsigned long long)m.reserved), "free_gb", gb(g.free),
                          "peak_allocated_gb", gb((unsigned long long)m.peak_allocated), "used_gb",
                          gb(g.used), "nvml_index", map[t]);
        procs = d ? process_dicts(map[t]) : NULL;
        if (procs == NULL || PyDict_SetItemString(d, "processes", procs) < 0 ||
            PyDict_SetItemString(report, key, d) < 0)
            Py_CLEAR(report);
        Py_XDECREF(procs);
        Py_XDECREF(d);
    }
    return report;
}

/* _api_clear_cache() -> int: bytes torch's allocator handed back. */
static PyObject *py_clear_cache(PyObject *self, PyObject *unused)
{
    long long released;
    (void)self;
    (void)unused;
    if (oc_api_clear_cache(&released) < 0)
        return NULL;
    return PyLong_FromLongLong(released);
}

/* Pops the last item of a list (new ref), or NULL when it is empty. */
static PyObject *list_pop(PyObject *list)
{
    Py_ssize_t n = PyList_Size(list);
    PyObject *item;
    if (n <= 0)
        return NULL;
    item = PyList_GetItem(list, n - 1);
    Py_XINCREF(item);
    if (PyList_SetSlice(list, n - 1, n, NULL) < 0) {
        Py_XDECREF(item);
        return NULL;
    }
    return item;
}

/* Autograd node types seen without a `variable` (all but AccumulateGrad):
 * a failed look-up builds an exception that every node of every step would
 * pay, so a type is asked once. */
static PyObject *no_variable_types;

/* One autograd node: records the leaf it accumulates into (first time only)
 * and sets its gradient aside, then pushes the nodes it leads to. Counts the
 * gradients set aside in *aside. */
static int visit_node(PyObject *node, PyObject *saved, PyObject *stack, long *aside)
{
    PyObject *type = PyObject_Type(node), *var = NULL, *next;
    Py_ssize_t n;
    int known = type && no_variable_types ? PySet_Contains(no_variable_types, type) : 0;
    if (type == NULL || known < 0) {
        Py_XDECREF(type);
        return -1;
    }
    if (!known) {
        var = PyObject_GetAttrString(node, "variable");
        if (var == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
                Py_DECREF(type);
                return -1;
            }
            OC_CLEAR_ABSENT(); /* not an AccumulateGrad node */
            if (no_variable_types == NULL)
                no_variable_types = PySet_New(NULL);
            if (no_variable_types == NULL || PySet_Add(no_variable_types, type) < 0) {
                Py_DECREF(type);
                return -1;
            }
        }
    }
    Py_DECREF(type);
    if (var != NULL) {
        PyObject *key = PyLong_FromVoidPtr(var);
        int have = key ? PyDict_Contains(saved, key) : -1, rc = have < 0 ? -1 : 0;
        if (have == 0) {
            PyObject *grad = PyObject_GetAttrString(var, "grad");
            PyObject *entry = grad ? PyTuple_Pack(2, var, grad) : NULL;
            rc = entry ? PyDict_SetItem(saved, key, entry) : -1;
            if (rc == 0 && grad != Py_None) {
                rc = PyObject_SetAttrString(var, "grad", Py_None);
                *aside += rc == 0;
            }
            Py_XDECREF(entry);
            Py_XDECREF(grad);
        }
        Py_XDECREF(key);
        Py_DECREF(var);
        if (rc < 0)
            return -1;
    }
    next = PyObject_GetAttrString(node, "next_functions");
    if (next == NULL || !PyTuple_Check(next)) {
        Py_XDECREF(next);
        return next == NULL ? -1 : 0;
    }
    n = PyTuple_Size(next);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = PyTuple_GetItem(next, i); /* borrowed */
        PyObject *fn = pair && PyTuple_Check(pair) && PyTuple_Size(pair) > 0
                           ? PyTuple_GetItem(pair, 0)
                           : NULL; /* borrowed */
        if (fn != NULL && fn != Py_None && PyList_Append(stack, fn) < 0) {
            Py_DECREF(next);
            return -1;
        }
    }
    Py_DECREF(next);
    return 0;
}

/* _grad_set_aside(loss, saved) -> int: every leaf that backward() of `loss`
 * will accumulate a gradient into, put in `saved` (id -> (leaf, its gradient
 * at entry)) unless already there, with that gradient set aside (.grad =
 * None) so this attempt's gradient builds up alone; returns how many
 * gradients were set aside (0: nothing to add back). auto_microbatch undoes
 * or adds them; the walk is in C because every step, OOM or not, makes it. */
static PyObject *py_grad_set_aside(PyObject *self, PyObject *args)
{
    PyObject *loss, *saved, *stack, *seen, *node;
    long aside = 0;
    int rc = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "OO!:_grad_set_aside", &loss, &PyDict_Type, &saved))
        return NULL;
    node = PyObject_GetAttrString(loss, "grad_fn");
    if (node == NULL) {
        if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
            OC_CLEAR_RECORDED(); /* raised again as the TypeError below */
            PyErr_SetString(PyExc_TypeError, "_grad_set_aside: loss must be a tensor");
        }
        return NULL;
    }
    stack = PyList_New(0);
    seen = PySet_New(NULL);
    if (stack == NULL || seen == NULL || PyList_Append(stack, node) < 0)
        rc = -1;
    Py_DECREF(node);
    while (rc == 0 && (node = list_pop(stack)) != NULL) {
        int was = node == Py_None ? 1 : PySet_Contains(seen, node);
        if (was == 0)
            rc = PySet_Add(seen, node) < 0 ? -1 : visit_node(node, saved, stack, &aside);
        else if (was < 0)
            rc = -1;
        Py_DECREF(node);
    }
    if (rc == 0 && PyErr_Occurred())
        rc = -1;
    Py_XDECREF(stack);
    Py_XDECREF(seen);
    if (rc < 0)
        return NULL;
    return PyLong_FromLong(aside);
}

/* auto_microbatch counts its splits here, where the exit summary reads them
 * (oc_api_microbatch_splits). */
static long long microbatch_splits;

long long oc_api_microbatch_splits(void)
{
    return microbatch_splits;
}

static PyObject *py_microbatch_split(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyLong_FromLongLong(++microbatch_splits);
}

OC_EDGE_VARARGS(py_grad_set_aside)
OC_EDGE_NOARGS(py_microbatch_split)
OC_EDGE_O(py_autocast_dtype)
OC_EDGE_KEYWORDS(py_loader_plan)
OC_EDGE_VARARGS(py_memory_format)
OC_EDGE_NOARGS(py_memory_report)
OC_EDGE_NOARGS(py_clear_cache)

PyMethodDef oc_api_methods[] = {
    OC_METHOD(
        "_grad_set_aside", py_grad_set_aside,
        "_grad_set_aside(loss, saved, /)\n--\n\nSets aside the gradient of every leaf backward() "
        "of loss reaches, recording it in saved (id -> (leaf, gradient at entry))."),
    OC_METHOD("_microbatch_split", py_microbatch_split,
              "_microbatch_split()\n--\n\nCounts one auto_microbatch split; returns the process's "
              "total."),
    OC_METHOD("_api_autocast_dtype", py_autocast_dtype,
              "_api_autocast_dtype(device_type, /)\n--\n\n(dtype name or None, reason) for "
              "torch.autocast."),
    OC_METHOD("_api_loader_plan", py_loader_plan,
              "_api_loader_plan(cuda_available, num_workers=-1, shm_path='/dev/shm', "
              "shm_min_bytes=...)\n--\n\n"
              "DataLoader arguments outofcuda proposes."),
    OC_METHOD(
        "_api_memory_format", py_memory_format,
        "_api_memory_format(has_4d, has_5d, channels_last=None, /)\n--\n\n(memory format or None, "
        "reason)."),
    OC_METHOD("_api_memory_report", py_memory_report,
              "_api_memory_report()\n--\n\nPer-device memory figures; never initialises CUDA."),
    OC_METHOD(
        "_api_clear_cache", py_clear_cache,
        "_api_clear_cache()\n--\n\ngc.collect() if configured, empty_cache(); bytes released."),
    {NULL, NULL, 0, NULL},
};
