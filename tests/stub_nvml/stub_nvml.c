/* stub_nvml.c - a stand-in for the NVIDIA driver's libnvidia-ml.so.1, for
 * tests on machines without a GPU. Every answer comes from the file named by
 * STUB_NVML_CONFIG, read at nvmlInit; tests load it only through
 * LD_LIBRARY_PATH. One directive a line ('#' starts a comment):
 *
 *   driver 550.54.15
 *   stride 32                       bytes per entry written by ..._v3 (16, 24, 32)
 *   error nvmlDeviceGetMemoryInfo 999   that function returns 999 (every device)
 *   error nvmlDeviceGetMemoryInfo@1 999 ... on device 1 only
 *   device name=NVIDIA_A100 uuid=GPU-... cc=8.0 total=BYTES used=BYTES util=GPU,MEM
 *   proc DEVICE PID BYTES           a process holding memory on device DEVICE
 *                                   (PID "self": the caller, "parent": its parent)
 *   mig MIG-UUID DEVICE             a MIG instance of device DEVICE
 *   utilseq DEVICE GPU[,MEM] ... [+|hang]
 *                                   utilisation served one value per call on
 *                                   DEVICE (MEM: 0 when left out), so a test
 *                                   knows exactly which samples a sampler saw;
 *                                   after the last: NOT_SUPPORTED, or with "+"
 *                                   the last value for ever, or with "hang" a
 *                                   call that never returns (a stuck driver)
 *                                   once it has created "<config file>.hanging"
 *
 * '_' in a device name stands for a space. The file is read again when it is
 * replaced (a new inode), so a test can change memory use while a process
 * watches: write a new file and rename it over the old one (a utilisation
 * sequence then starts again). Built with -DSTUB_LEGACY it exports
 * only the unsuffixed entry points of old drivers; -DSTUB_NO_MEMORY leaves out
 * nvmlDeviceGetMemoryInfo, -DSTUB_NO_CC nvmlDeviceGetCudaComputeCapability. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))
#define MAX_DEVICES 16
#define MAX_PROCS 4096
#define MAX_ERRORS 32
#define MAX_MIGS 16
#define MAX_UTIL_SEQ 256

enum {
    OK = 0,
    ERR_UNINITIALIZED = 1,
    ERR_INVALID_ARGUMENT = 2,
    ERR_NOT_SUPPORTED = 3,
    ERR_INSUFFICIENT_SIZE = 7,
    ERR_NOT_FOUND = 6,
};

typedef struct {
    unsigned long long total, free, used;
} stub_memory;
typedef struct {
    unsigned int gpu, memory;
} stub_util;

typedef struct {
    int index;
    char name[96], uuid[96];
    int cc_major, cc_minor;
    unsigned long long total, used;
    unsigned int util_gpu, util_mem;
    /* utilseq: n_seq values (0: the fixed util= figures), next_seq the next to serve */
    unsigned int seq_gpu[MAX_UTIL_SEQ], seq_mem[MAX_UTIL_SEQ];
    int n_seq, next_seq;
    enum { SEQ_FAIL, SEQ_REPEAT, SEQ_HANG } seq_end;
} stub_device;
typedef struct {
    int device;
    unsigned int pid;
    unsigned long long used;
} stub_proc;
typedef struct {
    char function[128];
    int device; /* -1: every device */
    int code;
} stub_error;
typedef struct {
    char uuid[96];
    int parent;
} stub_mig;

static struct {
    int loaded;
    char driver[80];
    int stride;
    int ndev, nproc, nerr, nmig;
    stub_device dev[MAX_DEVICES];
    stub_proc proc[MAX_PROCS];
    stub_error err[MAX_ERRORS];
    stub_mig mig[MAX_MIGS];
} st;

static ino_t loaded_inode;

/* "utilseq DEVICE v v ... [+|hang]": devices not yet declared are ignored. */
static void parse_utilseq(char *line)
{
    char *tok, *save = NULL;
    stub_device *d;
    strtok_r(line, " \t\n", &save);
    tok = strtok_r(NULL, " \t\n", &save);
    if (tok == NULL || atoi(tok) < 0 || atoi(tok) >= st.ndev)
        return;
    d = &st.dev[atoi(tok)];
    while ((tok = strtok_r(NULL, " \t\n", &save)) != NULL) {
        if (strcmp(tok, "+") == 0) {
            d->seq_end = SEQ_REPEAT;
        } else if (strcmp(tok, "hang") == 0) {
            d->seq_end = SEQ_HANG;
        } else if (d->n_seq < MAX_UTIL_SEQ) {
            d->seq_mem[d->n_seq] = 0;
            sscanf(tok, "%u,%u", &d->seq_gpu[d->n_seq], &d->seq_mem[d->n_seq]);
            d->n_seq++;
        }
    }
}

static void load_config(void)
{
    const char *path = getenv("STUB_NVML_CONFIG");
    char line[4096];
    struct stat info;
    FILE *f;
    memset(&st, 0, sizeof st);
    loaded_inode = (path && stat(path, &info) == 0) ? info.st_ino : 0;
    st.stride = 24;
    strcpy(st.driver, "550.54.15");
    f = path ? fopen(path, "r") : NULL;
    st.loaded = 1;
    if (f == NULL)
        return;
    while (fgets(line, sizeof line, f)) {
        char word[64] = "", a[128] = "";
        long long x = 0, y = 0;
        if (sscanf(line, "%63s", word) != 1 || word[0] == '#')
            continue;
        if (strcmp(word, "driver") == 0) {
            sscanf(line, "%*s %79s", st.driver);
        } else if (strcmp(word, "stride") == 0) {
            sscanf(line, "%*s %d", &st.stride);
        } else if (strcmp(word, "error") == 0 && st.nerr < MAX_ERRORS) {
            stub_error *e = &st.err[st.nerr];
            char *at;
            if (sscanf(line, "%*s %127s %lld", a, &x) != 2)
                continue;
            at = strchr(a, '@');
            e->device = at ? atoi(at + 1) : -1;
            if (at)
                *at = '\0';
            snprintf(e->function, sizeof e->function, "%s", a);
            e->code = (int)x;
            st.nerr++;
        } else if (strcmp(word, "proc") == 0 && st.nproc < MAX_PROCS) {
            char pid[32];
            if (sscanf(line, "%*s %lld %31s %lld", &x, pid, &y) == 3) {
                st.proc[st.nproc].device = (int)x;
                st.proc[st.nproc].pid = strcmp(pid, "self") == 0     ? (unsigned int)getpid()
                                        : strcmp(pid, "parent") == 0 ? (unsigned int)getppid()
                                                                     : (unsigned int)atoll(pid);
                st.proc[st.nproc].used = (unsigned long long)y;
                st.nproc++;
            }
        } else if (strcmp(word, "mig") == 0 && st.nmig < MAX_MIGS) {
            if (sscanf(line, "%*s %95s %lld", st.mig[st.nmig].uuid, &x) == 2) {
                st.mig[st.nmig].parent = (int)x;
                st.nmig++;
            }
        } else if (strcmp(word, "utilseq") == 0) {
            parse_utilseq(line);
        } else if (strcmp(word, "device") == 0 && st.ndev < MAX_DEVICES) {
            stub_device *d = &st.dev[st.ndev];
            char *tok, *save = NULL;
            d->index = st.ndev;
            for (tok = strtok_r(line, " \t\n", &save); tok; tok = strtok_r(NULL, " \t\n", &save)) {
                if (strncmp(tok, "name=", 5) == 0) {
                    snprintf(d->name, sizeof d->name, "%s", tok + 5);
                    for (char *p = d->name; *p; p++)
                        if (*p == '_')
                            *p = ' ';
                } else if (strncmp(tok, "uuid=", 5) == 0) {
                    snprintf(d->uuid, sizeof d->uuid, "%s", tok + 5);
                } else if (strncmp(tok, "cc=", 3) == 0) {
                    sscanf(tok + 3, "%d.%d", &d->cc_major, &d->cc_minor);
                } else if (strncmp(tok, "total=", 6) == 0) {
                    d->total = strtoull(tok + 6, NULL, 10);
                } else if (strncmp(tok, "used=", 5) == 0) {
                    d->used = strtoull(tok + 5, NULL, 10);
                } else if (strncmp(tok, "util=", 5) == 0) {
                    sscanf(tok + 5, "%u,%u", &d->util_gpu, &d->util_mem);
                }
            }
            st.ndev++;
        }
    }
    fclose(f);
}

/* Reads the file again if it was replaced since: device records keep their
 * places, so handles stay valid. */
static void refresh(void)
{
    const char *path = getenv("STUB_NVML_CONFIG");
    struct stat info;
    if (st.loaded && path && stat(path, &info) == 0 && info.st_ino != loaded_inode)
        load_config();
}

/* The error the test chose for `function` on device `index` (-1: none given), or 0. */
static int chosen(const char *function, int index)
{
    for (int i = 0; i < st.nerr; i++)
        if (strcmp(st.err[i].function, function) == 0 &&
            (st.err[i].device < 0 || st.err[i].device == index))
            return st.err[i].code;
    return 0;
}

/* A handle is a pointer to the device record (MIG handles point into st.mig). */
static stub_device *device_of(void *handle)
{
    stub_device *d = handle;
    if (!st.loaded || d < st.dev || d >= st.dev + st.ndev)
        return NULL;
    return d;
}

static int do_init(const char *function)
{
    load_config();
    return chosen(function, -1);
}

static int do_count(const char *function, unsigned int *n)
{
    int rc = chosen(function, -1);
    if (rc)
        return rc;
    if (!st.loaded)
        return ERR_UNINITIALIZED;
    *n = (unsigned int)st.ndev;
    return OK;
}

static int do_handle(const char *function, unsigned int index, void **out)
{
    int rc = chosen(function, (int)index);
    if (rc)
        return rc;
    if (!st.loaded)
        return ERR_UNINITIALIZED;
    if (index >= (unsigned int)st.ndev)
        return ERR_INVALID_ARGUMENT;
    *out = &st.dev[index];
    return OK;
}

/* Writes the processes of a device as entries of `stride` bytes, the way the
 * driver does: INSUFFICIENT_SIZE with the needed count when *count is short,
 * and nothing written past count entries. */
static int do_procs(const char *function, void *handle, unsigned int *count, void *out, int stride)
{
    stub_device *d;
    unsigned int n = 0, k = 0;
    int rc;
    refresh();
    d = device_of(handle);
    if (d == NULL || count == NULL)
        return ERR_INVALID_ARGUMENT;
    rc = chosen(function, d->index);
    if (rc)
        return rc;
    for (int i = 0; i < st.nproc; i++)
        n += st.proc[i].device == d->index;
    if (*count < n) {
        *count = n;
        return ERR_INSUFFICIENT_SIZE;
    }
    for (int i = 0; i < st.nproc; i++) {
        unsigned char *e = (unsigned char *)out + (size_t)k * (size_t)stride;
        unsigned int none = 0xFFFFFFFFu, zero = 0;
        unsigned long long protected_bytes = 0;
        if (st.proc[i].device != d->index)
            continue;
        memcpy(e, &st.proc[i].pid, 4);
        memcpy(e + 4, &zero, 4);
        memcpy(e + 8, &st.proc[i].used, 8);
        if (stride >= 24) {
            memcpy(e + 16, &none, 4); /* gpuInstanceId: not in MIG mode */
            memcpy(e + 20, &none, 4);
        }
        if (stride >= 32)
            memcpy(e + 24, &protected_bytes, 8);
        k++;
    }
    *count = n;
    return OK;
}

static int do_simple(const char *function, void *handle, stub_device **d)
{
    *d = device_of(handle);
    if (*d == NULL)
        return ERR_INVALID_ARGUMENT;
    return chosen(function, (*d)->index);
}

/* The three entry points exported under one name or the other: the legacy
 * driver's plain names, or the _v2 ones. */
#ifdef STUB_LEGACY
#define NAMED(name) name
#else
#define NAMED(name) name##_v2
#endif
#define TEXT(name) TEXT_(name)
#define TEXT_(name) #name
EXPORT int NAMED(nvmlInit)(void)
{
    return do_init(TEXT(NAMED(nvmlInit)));
}
EXPORT int NAMED(nvmlDeviceGetCount)(unsigned int *n)
{
    return do_count(TEXT(NAMED(nvmlDeviceGetCount)), n);
}
EXPORT int NAMED(nvmlDeviceGetHandleByIndex)(unsigned int i, void **h)
{
    return do_handle(TEXT(NAMED(nvmlDeviceGetHandleByIndex)), i, h);
}
#ifndef STUB_LEGACY
EXPORT int nvmlDeviceGetComputeRunningProcesses_v3(void *h, unsigned int *c, void *out)
{
    return do_procs("nvmlDeviceGetComputeRunningProcesses_v3", h, c, out, st.stride);
}
EXPORT int nvmlDeviceGetComputeRunningProcesses_v2(void *h, unsigned int *c, void *out)
{
    return do_procs("nvmlDeviceGetComputeRunningProcesses_v2", h, c, out, 24);
}
#endif

EXPORT int nvmlShutdown(void)
{
    return OK;
}

EXPORT int nvmlDeviceGetComputeRunningProcesses(void *h, unsigned int *c, void *out)
{
    return do_procs("nvmlDeviceGetComputeRunningProcesses", h, c, out, 16);
}

/* Copies a string answer the way the driver does: all of it, or nothing and
 * INSUFFICIENT_SIZE when the caller's buffer is short. */
static int copy_out(const char *value, char *buf, unsigned int len)
{
    if (strlen(value) + 1 > len)
        return ERR_INSUFFICIENT_SIZE;
    strcpy(buf, value);
    return OK;
}

EXPORT int nvmlSystemGetDriverVersion(char *buf, unsigned int len)
{
    int rc = chosen("nvmlSystemGetDriverVersion", -1);
    return rc ? rc : copy_out(st.driver, buf, len);
}

EXPORT int nvmlDeviceGetName(void *h, char *buf, unsigned int len)
{
    stub_device *d;
    int rc = do_simple("nvmlDeviceGetName", h, &d);
    return rc ? rc : copy_out(d->name, buf, len);
}

EXPORT int nvmlDeviceGetUUID(void *h, char *buf, unsigned int len)
{
    stub_device *d;
    int rc = do_simple("nvmlDeviceGetUUID", h, &d);
    return rc ? rc : copy_out(d->uuid, buf, len);
}

#ifndef STUB_NO_MEMORY
EXPORT int nvmlDeviceGetMemoryInfo(void *h, stub_memory *m)
{
    stub_device *d;
    int rc;
    refresh();
    rc = do_simple("nvmlDeviceGetMemoryInfo", h, &d);
    if (rc)
        return rc;
    m->total = d->total;
    m->used = d->used;
    m->free = d->total > d->used ? d->total - d->used : 0;
    return OK;
}
#endif

#ifndef STUB_NO_CC
EXPORT int nvmlDeviceGetCudaComputeCapability(void *h, int *major, int *minor)
{
    stub_device *d;
    int rc = do_simple("nvmlDeviceGetCudaComputeCapability", h, &d);
    if (rc)
        return rc;
    *major = d->cc_major;
    *minor = d->cc_minor;
    return OK;
}
#endif

/* Leaves "<config file>.hanging" for the test to wait on, then never returns. */
static void hang(void)
{
    char mark[4200];
    FILE *f;
    snprintf(mark, sizeof mark, "%s.hanging", getenv("STUB_NVML_CONFIG"));
    f = fopen(mark, "w");
    if (f)
        fclose(f);
    for (;;)
        pause();
}

EXPORT int nvmlDeviceGetUtilizationRates(void *h, stub_util *u)
{
    stub_device *d;
    int k, rc = do_simple("nvmlDeviceGetUtilizationRates", h, &d);
    if (rc)
        return rc;
    if (d->n_seq == 0) {
        u->gpu = d->util_gpu;
        u->memory = d->util_mem;
        return OK;
    }
    k = d->next_seq;
    if (k >= d->n_seq) {
        if (d->seq_end == SEQ_HANG)
            hang();
        if (d->seq_end != SEQ_REPEAT)
            return ERR_NOT_SUPPORTED;
        k = d->n_seq - 1;
    } else {
        d->next_seq++;
    }
    u->gpu = d->seq_gpu[k];
    u->memory = d->seq_mem[k];
    return OK;
}

EXPORT int nvmlDeviceGetIndex(void *h, unsigned int *index)
{
    stub_device *d;
    int rc = do_simple("nvmlDeviceGetIndex", h, &d);
    if (rc)
        return rc;
    *index = (unsigned int)d->index;
    return OK;
}

/* MIG handles point into st.mig; their parent is a device record. */
EXPORT int nvmlDeviceGetHandleByUUID(const char *uuid, void **h)
{
    int rc = chosen("nvmlDeviceGetHandleByUUID", -1);
    if (rc)
        return rc;
    for (int i = 0; i < st.ndev; i++)
        if (strcmp(st.dev[i].uuid, uuid) == 0) {
            *h = &st.dev[i];
            return OK;
        }
    for (int i = 0; i < st.nmig; i++)
        if (strcmp(st.mig[i].uuid, uuid) == 0) {
            *h = &st.mig[i];
            return OK;
        }
    return ERR_NOT_FOUND;
}

EXPORT int nvmlDeviceGetDeviceHandleFromMigDeviceHandle(void *mig, void **parent)
{
    stub_mig *m = mig;
    int rc = chosen("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", -1);
    if (rc)
        return rc;
    if (m < st.mig || m >= st.mig + st.nmig || m->parent < 0 || m->parent >= st.ndev)
        return ERR_INVALID_ARGUMENT;
    *parent = &st.dev[m->parent];
    return OK;
}
