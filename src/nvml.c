/* nvml.c - NVIDIA's management library, loaded with dlopen at run time so the
 * extension loads on machines with no driver. NVML needs no CUDA context:
 * nothing here can create one. The prototypes are declared by hand. */
#include "oc.h"

#include <ctype.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int nvml_return;
typedef void *nvml_device;
typedef struct {
    unsigned long long total, free, used;
} nvml_memory;
/* The driver returns this when a buffer is too small, with the count needed. */
#define NVML_ERROR_INSUFFICIENT_SIZE 7
/* usedGpuMemory when the driver cannot tell (NVML_VALUE_NOT_AVAILABLE). */
#define NVML_NOT_AVAILABLE OC_NVML_NOT_AVAILABLE
/* Process entries are 16, 24 or 32 bytes depending on the driver branch, not
 * on the entry point's suffix (see oc_nvml_process_list): buffers are sized
 * for the largest. Every layout starts with pid (u32, padded to 8) and
 * usedGpuMemory (u64 at offset 8). */
#define PROC_ENTRY_MAX 32
#define PROC_USED_OFFSET 8
/* At most this many processes are read (2 MiB of buffer). */
#define PROC_CAP_MAX 65536u
/* PID_MAX_LIMIT of 64-bit Linux: no pid is larger. */
#define PID_LIMIT 4194304u
/* Bytes the buffer is filled with before the driver writes into it. */
#define UNTOUCHED 0xA5
/* nvmlUtilization_t */
typedef struct {
    unsigned int gpu, memory;
} nvml_utilization;

typedef nvml_return (*nvml_procs_fn)(nvml_device, unsigned int *, void *);

/* The driver's library: loaded once per process behind pthread_once and
 * read by the native threads without the GIL. */
static struct {
    void *lib;
    int ok;
    char why[200];
    nvml_return (*init)(void);
    nvml_return (*count)(unsigned int *);
    nvml_return (*handle)(unsigned int, nvml_device *);
    nvml_return (*name)(nvml_device, char *, unsigned int);
    nvml_return (*uuid)(nvml_device, char *, unsigned int);
    nvml_return (*memory)(nvml_device, nvml_memory *);
    nvml_return (*cc)(nvml_device, int *, int *);
    nvml_return (*driver)(char *, unsigned int);
    nvml_procs_fn procs[3]; /* _v3, _v2, unsuffixed; NULL where absent */
    nvml_return (*by_uuid)(const char *, nvml_device *);
    nvml_return (*mig_parent)(nvml_device, nvml_device *);
    nvml_return (*get_index)(nvml_device, unsigned int *);
    /* Absent before R270 and on some virtual GPUs. */
    nvml_return (*utilization)(nvml_device, nvml_utilization *);
} nv;

static pthread_once_t nv_once = PTHREAD_ONCE_INIT;

static void nv_load(void)
{
    static const struct {
        void **slot;
        const char *const names[3];
    } syms[] = {
        {(void **)&nv.init, {"nvmlInit_v2", "nvmlInit"}},
        {(void **)&nv.count, {"nvmlDeviceGetCount_v2", "nvmlDeviceGetCount"}},
        {(void **)&nv.handle, {"nvmlDeviceGetHandleByIndex_v2", "nvmlDeviceGetHandleByIndex"}},
        {(void **)&nv.name, {"nvmlDeviceGetName"}},
        {(void **)&nv.uuid, {"nvmlDeviceGetUUID"}},
        {(void **)&nv.memory, {"nvmlDeviceGetMemoryInfo"}},
        {(void **)&nv.cc, {"nvmlDeviceGetCudaComputeCapability"}},
        {(void **)&nv.driver, {"nvmlSystemGetDriverVersion"}},
        {(void **)&nv.procs[0], {"nvmlDeviceGetComputeRunningProcesses_v3"}},
        {(void **)&nv.procs[1], {"nvmlDeviceGetComputeRunningProcesses_v2"}},
        {(void **)&nv.procs[2], {"nvmlDeviceGetComputeRunningProcesses"}},
        {(void **)&nv.by_uuid, {"nvmlDeviceGetHandleByUUID"}},
        {(void **)&nv.mig_parent, {"nvmlDeviceGetDeviceHandleFromMigDeviceHandle"}},
        {(void **)&nv.get_index, {"nvmlDeviceGetIndex"}},
        {(void **)&nv.utilization, {"nvmlDeviceGetUtilizationRates"}},
    };
    const char *err;
    /* Only the copy torch may already hold, or the bare driver soname through
     * the system loader: never a relative path or a directory of ours. */
    nv.lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    if (nv.lib == NULL)
        nv.lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (nv.lib == NULL) {
        err = dlerror();
        snprintf(nv.why, sizeof nv.why, "NVIDIA driver library not found (%s)",
                 err ? err : "libnvidia-ml.so.1");
        return;
    }
    /* Each slot takes the first of its names found: the newest suffix. */
    for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
        for (const char *const *name = syms[i].names; *name && !*syms[i].slot; name++)
            *syms[i].slot = dlsym(nv.lib, *name);
    }
    if (!nv.init || !nv.count || !nv.handle || !nv.memory) {
        snprintf(nv.why, sizeof nv.why, "NVML is missing a required function (driver too old?)");
        return;
    }
    if (nv.init() != 0) {
        snprintf(nv.why, sizeof nv.why, "NVML failed to initialise (no usable GPU or driver)");
        return;
    }
    nv.ok = 1;
}

int oc_nvml_available(char *why, size_t whysz)
{
    pthread_once(&nv_once, nv_load);
    if (!nv.ok && why != NULL && whysz > 0)
        snprintf(why, whysz, "%s", nv.why);
    return nv.ok;
}

int oc_nvml_device_count(void)
{
    unsigned int n = 0;
    if (!oc_nvml_available(NULL, 0) || nv.count(&n) != 0)
        return -1;
    return (int)n;
}

int oc_nvml_device_info(int index, oc_gpu_info *out)
{
    nvml_device dev;
    nvml_memory mem;
    memset(out, 0, sizeof *out);
    out->cc_major = out->cc_minor = -1;
    if (!oc_nvml_available(NULL, 0) || index < 0 || nv.handle((unsigned int)index, &dev) != 0)
        return -1;
    if (nv.name != NULL && nv.name(dev, out->name, sizeof out->name) != 0)
        out->name[0] = '\0';
    oc_escape_controls(out->name, sizeof out->name);
    if (nv.uuid != NULL && nv.uuid(dev, out->uuid, sizeof out->uuid) != 0)
        out->uuid[0] = '\0';
    if (nv.cc != NULL && nv.cc(dev, &out->cc_major, &out->cc_minor) != 0)
        out->cc_major = out->cc_minor = -1;
    if (nv.memory(dev, &mem) == 0) {
        out->total = mem.total;
        out->free = mem.free;
        out->used = mem.used;
    }
    return 0;
}

/* Are n entries `stride` bytes apart believable: a pid Linux can have, and
 * no more memory than the device holds? */
static int entries_plausible(const unsigned char *buf, unsigned int n, size_t stride,
                             unsigned long long total)
{
    for (unsigned int i = 0; i < n; i++) {
        unsigned int pid;
        unsigned long long used;
        memcpy(&pid, buf + i * stride, sizeof pid);
        memcpy(&used, buf + i * stride + PROC_USED_OFFSET, sizeof used);
        if (pid == 0 || pid > PID_LIMIT)
            return 0;
        if (used != NVML_NOT_AVAILABLE && total > 0 && used > total)
            return 0;
    }
    return 1;
}

static int untouched_from(const unsigned char *buf, size_t from, size_t size)
{
    for (size_t o = from; o < size; o++)
        if (buf[o] != UNTOUCHED)
            return 0;
    return 1;
}

static unsigned int live_pids(const unsigned char *buf, unsigned int n, size_t stride)
{
    unsigned int live = 0;
    for (unsigned int i = 0; i < n; i++) {
        unsigned int pid;
        char path[32];
        memcpy(&pid, buf + i * stride, sizeof pid);
        snprintf(path, sizeof path, "/proc/%u", pid);
        live += access(path, F_OK) == 0;
    }
    return live;
}

/* The entry size the driver used for the n entries it wrote into buf (size
 * bytes, filled with UNTOUCHED beforehand), or 0 when no layout reads sensibly.
 * The driver writes exactly n entries, so the smallest believable stride
 * beyond whose entries every byte is still UNTOUCHED is the driver's: a
 * smaller one leaves written bytes after its n-th entry, and a larger one is
 * only reached after this one. A driver that wrote past its entries gets the
 * believable stride with the most live pids (pids of another pid namespace
 * are not visible), 24 bytes (the common layout) on a tie. */
static size_t entry_stride(const unsigned char *buf, unsigned int n, size_t size,
                           unsigned long long total)
{
    static const size_t by_size[] = {16, 24, 32}, by_likelihood[] = {24, 32, 16};
    size_t best = 0;
    unsigned int best_live = 0;
    if (n == 0)
        return PROC_ENTRY_MAX;
    for (int i = 0; i < 3; i++)
        if (entries_plausible(buf, n, by_size[i], total) &&
            untouched_from(buf, n * by_size[i], size))
            return by_size[i];
    for (int i = 0; i < 3; i++) {
        unsigned int live;
        if (!entries_plausible(buf, n, by_likelihood[i], total))
            continue;
        live = live_pids(buf, n, by_likelihood[i]);
        if (best == 0 || live > best_live) {
            best = by_likelihood[i];
            best_live = live;
        }
    }
    return best;
}

/* Reads the processes through one entry point. Count, or -1 when it fails. */
static int read_processes(nvml_procs_fn fn, nvml_device dev, unsigned long long total,
                          oc_gpu_proc **out)
{
    unsigned int cap = 64;
    for (int attempt = 0; attempt < 6; attempt++) {
        /* The count handed over is the capacity in entries of the largest
         * layout, so no driver branch can write past the buffer. */
        size_t size = (size_t)cap * PROC_ENTRY_MAX, stride;
        unsigned char *buf = malloc(size);
        unsigned int n = cap;
        nvml_return rc;
        oc_gpu_proc *list;
        if (buf == NULL)
            return -1;
        memset(buf, UNTOUCHED, size);
        rc = fn(dev, &n, buf);
        if (rc == NVML_ERROR_INSUFFICIENT_SIZE) {
            /* More processes than room: the driver said how many (they may
             * grow before the next call, hence the margin). */
            free(buf);
            if (cap >= PROC_CAP_MAX)
                return -1;
            if (n >= PROC_CAP_MAX / 2)
                cap = PROC_CAP_MAX;
            else
                cap = n > cap ? n + n / 4 + 8 : cap * 2;
            continue;
        }
        if (rc != 0 || n > cap) {
            free(buf);
            return -1;
        }
        stride = entry_stride(buf, n, size, total);
        list = malloc((n ? n : 1) * sizeof *list);
        if (stride == 0 || list == NULL) {
            free(buf);
            free(list);
            return -1;
        }
        for (unsigned int i = 0; i < n; i++) {
            memcpy(&list[i].pid, buf + i * stride, sizeof list[i].pid);
            memcpy(&list[i].used, buf + i * stride + PROC_USED_OFFSET, sizeof list[i].used);
        }
        free(buf);
        *out = list;
        return (int)n;
    }
    return -1;
}

int oc_nvml_process_list(int index, oc_gpu_proc **out)
{
    nvml_device dev;
    nvml_memory mem;
    unsigned long long total = 0;
    *out = NULL;
    if (!oc_nvml_available(NULL, 0) || index < 0 || nv.handle((unsigned int)index, &dev) != 0)
        return -1;
    if (nv.memory(dev, &mem) == 0)
        total = mem.total;
    /* Newest first; an older entry point where a newer one fails (some
     * virtualised drivers answer NOT_SUPPORTED to _v3). */
    for (int i = 0; i < 3; i++) {
        int n = nv.procs[i] ? read_processes(nv.procs[i], dev, total, out) : -1;
        if (n >= 0)
            return n;
    }
    return -1;
}

static int by_used_desc(const void *a, const void *b)
{
    const oc_gpu_proc *x = a, *y = b;
    /* Unknown sizes (NOT_AVAILABLE) last. */
    unsigned long long ux = x->used == OC_NVML_NOT_AVAILABLE ? 0 : x->used;
    unsigned long long uy = y->used == OC_NVML_NOT_AVAILABLE ? 0 : y->used;
    return ux < uy ? 1 : ux > uy ? -1 : (x->pid > y->pid) - (x->pid < y->pid);
}

void oc_nvml_sort_procs(oc_gpu_proc *procs, int n)
{
    if (procs != NULL && n > 1)
        qsort(procs, (size_t)n, sizeof *procs, by_used_desc);
}

int oc_proc_name(unsigned int pid, char *buf, size_t sz)
{
    char path[48];
    size_t len;
    FILE *f;
    buf[0] = '\0';
    snprintf(path, sizeof path, "/proc/%u/comm", pid);
    f = fopen(path, "r");
    if (f == NULL) {
        /* comm can be hidden where cmdline is not (some hardened kernels):
         * take the program's base name from there. */
        char cmd[256];
        const char *base;
        snprintf(path, sizeof path, "/proc/%u/cmdline", pid);
        f = fopen(path, "r");
        if (f == NULL)
            return -1;
        len = fread(cmd, 1, sizeof cmd - 1, f);
        fclose(f);
        cmd[len] = '\0';
        base = strrchr(cmd, '/');
        snprintf(buf, sz, "%s", base ? base + 1 : cmd);
        oc_escape_controls(buf, sz);
        return buf[0] ? 0 : -1;
    }
    if (fgets(buf, (int)sz, f) == NULL)
        buf[0] = '\0';
    fclose(f);
    len = strlen(buf);
    while (len > 0 && (buf[len - 1] == '\n' || buf[len - 1] == '\r'))
        buf[--len] = '\0';
    /* Any process may name itself anything (prctl PR_SET_NAME). */
    oc_escape_controls(buf, sz);
    return buf[0] ? 0 : -1;
}

/* ---- CUDA's device numbering in NVML's terms ---- */

/* NVML index of the GPU whose UUID starts with the len bytes of prefix
 * (CUDA takes unambiguous UUID prefixes), or -1. */
static int uuid_prefix_index(const char *prefix, size_t len, int n)
{
    for (int i = 0; i < n; i++) {
        oc_gpu_info g;
        if (oc_nvml_device_info(i, &g) == 0 && strlen(g.uuid) >= len &&
            strncmp(g.uuid, prefix, len) == 0)
            return i;
    }
    return -1;
}

/* NVML index of the GPU a MIG instance belongs to, or -1. CUDA accepts
 * MIG-<uuid> (R470 and later) and MIG-GPU-<gpu uuid>/<gi>/<ci> (R450). The
 * figures outofcuda reads for it are then the whole GPU's. */
static int mig_parent_index(const char *entry, int n)
{
    nvml_device mig, parent;
    unsigned int index;
    if (strncmp(entry, "MIG-GPU-", 8) == 0) {
        const char *slash = strchr(entry, '/');
        return slash ? uuid_prefix_index(entry + 4, (size_t)(slash - entry - 4), n) : -1;
    }
    if (nv.by_uuid == NULL || nv.mig_parent == NULL || nv.get_index == NULL ||
        nv.by_uuid(entry, &mig) != 0 || nv.mig_parent(mig, &parent) != 0 ||
        nv.get_index(parent, &index) != 0 || index >= (unsigned int)n)
        return -1;
    return (int)index;
}

/* NVML index of one CUDA_VISIBLE_DEVICES entry (blanks trimmed) among n
 * NVML devices; -1 when CUDA cannot resolve it; -2 when NVML cannot be
 * asked (n < 0) and the entry has a form that can name a device. */
static int resolve_entry(const char *entry, int n)
{
    if (isdigit((unsigned char)entry[0])) {
        char *end;
        long x = strtol(entry, &end, 10);
        if (*end != '\0')
            return -1;
        return n < 0 ? -2 : (x < n ? (int)x : -1);
    }
    if (strncmp(entry, "GPU-", 4) == 0)
        return n < 0 ? -2 : uuid_prefix_index(entry, strlen(entry), n);
    if (strncmp(entry, "MIG-", 4) == 0)
        return n < 0 ? -2 : mig_parent_index(entry, n);
    return -1;
}

/* Walks CUDA_VISIBLE_DEVICES (vis) as CUDA does among n NVML devices
 * (n < 0: NVML cannot be asked): each entry that resolves goes into map (-2
 * where NVML cannot say which device), up to max; the walk stops at the
 * first entry CUDA cannot resolve, copied into stop (left as it is when
 * every entry resolved). vis NULL (unset) shows every device in NVML's
 * order. Returns how many entries resolved. */
static int walk_visible(const char *vis, int n, int *map, int max, char *stop, size_t stopsz)
{
    int count = 0;
    for (; vis == NULL && count < n && count < max; count++)
        map[count] = count;
    while (vis != NULL && *vis && count < max) {
        char entry[100];
        size_t len = strcspn(vis, ",");
        size_t a = 0, b = len;
        int found = -1;
        while (a < b && isspace((unsigned char)vis[a]))
            a++;
        while (b > a && isspace((unsigned char)vis[b - 1]))
            b--;
        if (b - a > 0 && b - a < sizeof entry) {
            memcpy(entry, vis + a, b - a);
            entry[b - a] = '\0';
            found = resolve_entry(entry, n);
        }
        if (found == -1) {
            snprintf(stop, stopsz, "%.*s", (int)(b - a), vis + a);
            break;
        }
        map[count++] = found;
        vis += len + (vis[len] == ',' ? 1 : 0);
    }
    return count;
}

/* Writes the NVML index of each device CUDA shows this process, in torch's
 * order, into map. Returns how many, or -1 without NVML. CUDA_VISIBLE_DEVICES
 * as indices, GPU-UUID prefixes or MIG instances (mapped to their GPU) is
 * honoured; CUDA stops at the first entry it cannot resolve, and so does
 * this. (CUDA's default FASTEST_FIRST order equals NVML's PCI order on
 * machines with one GPU model.) */
int oc_nvml_visible_map(int *map, int max)
{
    int n = oc_nvml_device_count();
    char stop[100];
    if (n < 0)
        return -1;
    return walk_visible(oc_env("CUDA_VISIBLE_DEVICES"), n, map, max, stop, sizeof stop);
}

int oc_nvml_index(int torch_index)
{
    int map[OC_NVML_MAX_DEVICES];
    int n = oc_nvml_visible_map(map, OC_NVML_MAX_DEVICES);
    return (torch_index >= 0 && torch_index < n) ? map[torch_index] : -1;
}

/* Lowest compute capability (major*10+minor) among visible GPUs; -1 unknown. */
int oc_nvml_min_visible_cc(void)
{
    int map[OC_NVML_MAX_DEVICES], n = oc_nvml_visible_map(map, OC_NVML_MAX_DEVICES), best = -1;
    for (int i = 0; i < n; i++) {
        oc_gpu_info g;
        if (oc_nvml_device_info(map[i], &g) != 0 || g.cc_major < 0)
            return -1;
        if (best < 0 || g.cc_major * 10 + g.cc_minor < best)
            best = g.cc_major * 10 + g.cc_minor;
    }
    return best;
}

/* nvml_devices() -> (list of dicts, reason or None). Never creates a CUDA
 * context; an empty list with a reason where there is no driver. */
static PyObject *py_nvml_devices(PyObject *self, PyObject *unused)
{
    char why[200], driver[96];
    PyObject *list;
    int n;
    (void)self;
    (void)unused;
    list = PyList_New(0);
    if (list == NULL)
        return NULL;
    if (!oc_nvml_available(why, sizeof why))
        return Py_BuildValue("(Ns)", list, why);
    if (nv.driver == NULL || nv.driver(driver, sizeof driver) != 0)
        driver[0] = '\0';
    n = oc_nvml_device_count();
    for (int i = 0; i < n; i++) {
        oc_gpu_info g;
        PyObject *d;
        if (oc_nvml_device_info(i, &g) != 0)
            continue;
        d = Py_BuildValue("{s:i,s:s,s:s,s:(ii),s:K,s:K,s:K,s:s}", "index", i, "name", g.name,
                          "uuid", g.uuid, "compute_capability", g.cc_major, g.cc_minor, "total",
                          g.total, "free", g.free, "used", g.used, "driver", driver);
        if (d == NULL || PyList_Append(list, d) < 0) {
            Py_XDECREF(d);
            Py_DECREF(list);
            return NULL;
        }
        Py_DECREF(d);
    }
    return Py_BuildValue("(NO)", list, Py_None);
}

/* nvml_processes(index) -> list of (pid, used_bytes), every process NVML
 * lists on that GPU (used 0 where the driver cannot tell); [] without NVML. */
static PyObject *py_nvml_processes(PyObject *self, PyObject *arg)
{
    oc_gpu_proc *procs = NULL;
    long index = PyLong_AsLong(arg);
    PyObject *list;
    int n;
    (void)self;
    if (index == -1 && PyErr_Occurred())
        return NULL;
    n = (index >= 0 && index < 4096) ? oc_nvml_process_list((int)index, &procs) : -1;
    list = PyList_New(n > 0 ? n : 0);
    for (int i = 0; list != NULL && i < n; i++) {
        unsigned long long used = procs[i].used == NVML_NOT_AVAILABLE ? 0 : procs[i].used;
        PyObject *t = Py_BuildValue("(IK)", procs[i].pid, used);
        /* SetItem takes t, even when it fails; a NULL slot is freed with the list. */
        if (t == NULL || PyList_SetItem(list, i, t) < 0)
            Py_CLEAR(list);
    }
    free(procs);
    return list;
}

/* nvml_index(torch_index) -> NVML's index of torch's cuda:N, or None. */
static PyObject *py_nvml_index(PyObject *self, PyObject *arg)
{
    long index = PyLong_AsLong(arg);
    int found;
    (void)self;
    if (index == -1 && PyErr_Occurred())
        return NULL;
    found = (index >= 0 && index < OC_NVML_MAX_DEVICES) ? oc_nvml_index((int)index) : -1;
    if (found < 0)
        Py_RETURN_NONE;
    return PyLong_FromLong(found);
}

/* visible_devices() -> dict: CUDA_VISIBLE_DEVICES read as CUDA reads it.
 * value: the variable or None; devices: NVML's device count or None without
 * NVML; indices: the NVML indices CUDA shows, in torch's order (None
 * without NVML); visible: how many entries resolve (without NVML: how many
 * have a form that can name a device); stop: the entry CUDA stops at, or
 * None. */
static PyObject *py_visible_devices(PyObject *self, PyObject *unused)
{
    const char *vis = oc_env("CUDA_VISIBLE_DEVICES");
    int map[OC_NVML_MAX_DEVICES], n = oc_nvml_device_count(), count;
    char stop[100] = "\1"; /* not an entry: unset, or every entry resolved */
    PyObject *indices, *value, *devices, *stop_obj;
    (void)self;
    (void)unused;
    count = walk_visible(vis, n, map, OC_NVML_MAX_DEVICES, stop, sizeof stop);
    indices = n < 0 ? (Py_INCREF(Py_None), Py_None) : PyList_New(0);
    for (int i = 0; indices != NULL && indices != Py_None && i < count; i++) {
        PyObject *x = PyLong_FromLong(map[i]);
        if (x == NULL || PyList_Append(indices, x) < 0)
            Py_CLEAR(indices);
        Py_XDECREF(x);
    }
    if (indices == NULL)
        return NULL;
    value = vis ? PyUnicode_DecodeUTF8(vis, (Py_ssize_t)strlen(vis), "replace")
                : (Py_INCREF(Py_None), Py_None);
    devices = n < 0 ? (Py_INCREF(Py_None), Py_None) : PyLong_FromLong(n);
    stop_obj = stop[0] == '\1' ? (Py_INCREF(Py_None), Py_None)
                               : PyUnicode_DecodeUTF8(stop, (Py_ssize_t)strlen(stop), "replace");
    if (value == NULL || devices == NULL || stop_obj == NULL) {
        Py_XDECREF(value);
        Py_XDECREF(devices);
        Py_XDECREF(stop_obj);
        Py_DECREF(indices);
        return NULL;
    }
    return Py_BuildValue("{s:N,s:N,s:N,s:i,s:N}", "value", value, "devices", devices, "indices",
                         indices, "visible", count, "stop", stop_obj);
}

OC_EDGE_O(py_nvml_index)
OC_EDGE_NOARGS(py_nvml_devices)
OC_EDGE_O(py_nvml_processes)
OC_EDGE_NOARGS(py_visible_devices)

PyMethodDef oc_nvml_methods[] = {
    OC_METHOD(
        "nvml_index", py_nvml_index,
        "nvml_index(torch_index, /)\n--\n\nNVML's index of torch's cuda:N (CUDA_VISIBLE_DEVICES "
        "applied), or None."),
    OC_METHOD(
        "nvml_devices", py_nvml_devices,
        "nvml_devices()\n--\n\n(devices, reason): every GPU NVML reports, without a CUDA context."),
    OC_METHOD(
        "nvml_processes", py_nvml_processes,
        "nvml_processes(index, /)\n--\n\nProcesses holding memory on GPU `index`: [(pid, bytes)]."),
    OC_METHOD("visible_devices", py_visible_devices,
              "visible_devices()\n--\n\nCUDA_VISIBLE_DEVICES as CUDA reads it: value, devices, "
              "indices, visible, stop."),
    {NULL, NULL, 0, NULL},
};

int oc_nvml_utilization(int index, unsigned *gpu, unsigned *mem)
{
    nvml_device dev;
    nvml_utilization u;
    if (!oc_nvml_available(NULL, 0) || nv.utilization == NULL || index < 0 ||
        nv.handle((unsigned int)index, &dev) != 0 || nv.utilization(dev, &u) != 0)
        return -1;
    *gpu = u.gpu;
    *mem = u.memory;
    return 0;
}
