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

typedef int nvml_return;
typedef void *nvml_device;
typedef struct {
    unsigned long long total, free, used;
} nvml_memory;
/* nvmlProcessInfo_t as the _v2/_v3 entry points fill it. */
typedef struct {
    unsigned int pid;
    unsigned long long used;
    unsigned int gpu_instance_id, compute_instance_id;
} nvml_process_v2;
/* nvmlProcessInfo_v1_t for the unsuffixed entry point of old drivers. */
typedef struct {
    unsigned int pid;
    unsigned long long used;
} nvml_process_v1;

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
    nvml_return (*procs_v2)(nvml_device, unsigned int *, nvml_process_v2 *);
    nvml_return (*procs_v1)(nvml_device, unsigned int *, nvml_process_v1 *);
} nv;

static pthread_once_t nv_once = PTHREAD_ONCE_INIT;

/* Looks a symbol up, preferring the newest suffix. Returns NULL when none. */
static void *sym(const char *const *names)
{
    for (; *names; names++) {
        void *p = dlsym(nv.lib, *names);
        if (p != NULL)
            return p;
    }
    return NULL;
}

static void nv_load(void)
{
    static const char *const n_init[] = {"nvmlInit_v2", "nvmlInit", NULL};
    static const char *const n_count[] = {"nvmlDeviceGetCount_v2", "nvmlDeviceGetCount", NULL};
    static const char *const n_handle[] = {"nvmlDeviceGetHandleByIndex_v2",
                                           "nvmlDeviceGetHandleByIndex", NULL};
    static const char *const n_name[] = {"nvmlDeviceGetName", NULL};
    static const char *const n_uuid[] = {"nvmlDeviceGetUUID", NULL};
    static const char *const n_mem[] = {"nvmlDeviceGetMemoryInfo", NULL};
    static const char *const n_cc[] = {"nvmlDeviceGetCudaComputeCapability", NULL};
    static const char *const n_drv[] = {"nvmlSystemGetDriverVersion", NULL};
    static const char *const n_p2[] = {"nvmlDeviceGetComputeRunningProcesses_v3",
                                       "nvmlDeviceGetComputeRunningProcesses_v2", NULL};
    static const char *const n_p1[] = {"nvmlDeviceGetComputeRunningProcesses", NULL};
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
    *(void **)&nv.init = sym(n_init);
    *(void **)&nv.count = sym(n_count);
    *(void **)&nv.handle = sym(n_handle);
    *(void **)&nv.name = sym(n_name);
    *(void **)&nv.uuid = sym(n_uuid);
    *(void **)&nv.memory = sym(n_mem);
    *(void **)&nv.cc = sym(n_cc);
    *(void **)&nv.driver = sym(n_drv);
    *(void **)&nv.procs_v2 = sym(n_p2);
    *(void **)&nv.procs_v1 = sym(n_p1);
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

int oc_nvml_driver_version(char *buf, size_t sz)
{
    buf[0] = '\0';
    if (!oc_nvml_available(NULL, 0) || nv.driver == NULL)
        return -1;
    return nv.driver(buf, (unsigned int)sz) == 0 ? 0 : -1;
}

int oc_nvml_processes(int index, oc_gpu_proc *out, int max)
{
    nvml_device dev;
    unsigned int n = 64;
    if (!oc_nvml_available(NULL, 0) || nv.handle((unsigned int)index, &dev) != 0)
        return -1;
    if (nv.procs_v2 != NULL) {
        nvml_process_v2 buf[64];
        if (nv.procs_v2(dev, &n, buf) != 0)
            return -1;
        for (unsigned int i = 0; i < n && (int)i < max; i++) {
            out[i].pid = buf[i].pid;
            out[i].used = buf[i].used;
        }
    } else if (nv.procs_v1 != NULL) {
        nvml_process_v1 buf[64];
        if (nv.procs_v1(dev, &n, buf) != 0)
            return -1;
        for (unsigned int i = 0; i < n && (int)i < max; i++) {
            out[i].pid = buf[i].pid;
            out[i].used = buf[i].used;
        }
    } else {
        return -1;
    }
    return (int)n < max ? (int)n : max;
}

/* ---- CUDA's device numbering in NVML's terms ---- */

/* Writes the NVML index of each device CUDA shows this process, in torch's
 * order, into map. Returns how many, or -1 without NVML. CUDA_VISIBLE_DEVICES
 * as indices or GPU-UUID prefixes is honoured; CUDA stops at the first entry
 * it cannot resolve, and so does this. (CUDA's default FASTEST_FIRST order
 * equals NVML's PCI order on machines with one GPU model.) */
int oc_nvml_visible_map(int *map, int max)
{
    const char *vis = getenv("CUDA_VISIBLE_DEVICES");
    int n = oc_nvml_device_count(), count = 0;
    if (n < 0)
        return -1;
    if (vis == NULL) {
        for (int i = 0; i < n && i < max; i++)
            map[count++] = i;
        return count;
    }
    while (*vis && count < max) {
        char entry[100];
        size_t len = strcspn(vis, ",");
        size_t a = 0, b = len;
        int found = -1;
        while (a < b && isspace((unsigned char)vis[a]))
            a++;
        while (b > a && isspace((unsigned char)vis[b - 1]))
            b--;
        if (b - a == 0 || b - a >= sizeof entry)
            break;
        memcpy(entry, vis + a, b - a);
        entry[b - a] = '\0';
        if (isdigit((unsigned char)entry[0])) {
            char *end;
            long x = strtol(entry, &end, 10);
            if (*end == '\0' && x >= 0 && x < n)
                found = (int)x;
        } else if (strncmp(entry, "GPU-", 4) == 0) {
            for (int i = 0; i < n && found < 0; i++) {
                oc_gpu_info g;
                if (oc_nvml_device_info(i, &g) == 0 && strncmp(g.uuid, entry, strlen(entry)) == 0)
                    found = i;
            }
        }
        if (found < 0)
            break;
        map[count++] = found;
        vis += len + (vis[len] == ',' ? 1 : 0);
    }
    return count;
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
    oc_nvml_driver_version(driver, sizeof driver);
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

/* nvml_processes(index) -> list of (pid, used_bytes); [] without NVML. */
static PyObject *py_nvml_processes(PyObject *self, PyObject *arg)
{
    oc_gpu_proc procs[64];
    long index = PyLong_AsLong(arg);
    PyObject *list;
    int n;
    (void)self;
    if (index == -1 && PyErr_Occurred())
        return NULL;
    list = PyList_New(0);
    if (list == NULL)
        return NULL;
    n = (index >= 0 && index < 4096) ? oc_nvml_processes((int)index, procs, 64) : -1;
    for (int i = 0; i < n; i++) {
        PyObject *t = Py_BuildValue("(IK)", procs[i].pid, procs[i].used);
        if (t == NULL || PyList_Append(list, t) < 0) {
            Py_XDECREF(t);
            Py_DECREF(list);
            return NULL;
        }
        Py_DECREF(t);
    }
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

PyMethodDef oc_nvml_methods[] = {
    {"nvml_index", py_nvml_index, METH_O,
     "nvml_index(torch_index)\n--\n\nNVML's index of torch's cuda:N (CUDA_VISIBLE_DEVICES "
     "applied), or None."},
    {"nvml_devices", py_nvml_devices, METH_NOARGS,
     "nvml_devices()\n--\n\n(devices, reason): every GPU NVML reports, without a CUDA context."},
    {"nvml_processes", py_nvml_processes, METH_O,
     "nvml_processes(index)\n--\n\nProcesses holding memory on GPU `index`: [(pid, bytes)]."},
    {NULL, NULL, 0, NULL},
};

/* ---- utilisation (looked up on first use, apart from the table above) ---- */

/* nvmlUtilization_t */
typedef struct {
    unsigned int gpu, memory;
} nvml_utilization;

static nvml_return (*nv_utilization)(nvml_device, nvml_utilization *);
static pthread_once_t nv_utilization_once = PTHREAD_ONCE_INIT;

/* Optional: drivers before R270 and some virtual GPUs lack it. */
static void nv_utilization_load(void)
{
    static const char *const n_util[] = {"nvmlDeviceGetUtilizationRates", NULL};
    if (oc_nvml_available(NULL, 0))
        *(void **)&nv_utilization = sym(n_util);
}

int oc_nvml_utilization(int index, unsigned *gpu, unsigned *mem)
{
    nvml_device dev;
    nvml_utilization u;
    pthread_once(&nv_utilization_once, nv_utilization_load);
    if (nv_utilization == NULL || index < 0 || nv.handle((unsigned int)index, &dev) != 0 ||
        nv_utilization(dev, &u) != 0)
        return -1;
    *gpu = u.gpu;
    *mem = u.memory;
    return 0;
}
