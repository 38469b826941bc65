/* oom.c - what outofcuda does when CUDA runs out of memory: torch's OOM
 * observer records the figures at the moment of failure and optionally dumps
 * an allocator snapshot; the chained sys.excepthook / threading.excepthook
 * print the report for an uncaught OOM, and IPython's custom exception
 * handler does for a cell, then releases the failed cell's frames;
 * oc_oom_advise (advice.c) ranks the actions that fit the figures. A report
 * is an oom_report, gathered, ranked and written here (last_oom()'s dict is
 * made from it), so a hook prints it without importing any Python of
 * outofcuda (outofcuda/oom.py only wraps these functions). Observer and
 * hooks are set when CUDA initialises (from torch's lazy-init queue), never
 * at import: until then, and for good on a CPU-only build, the process looks
 * as without outofcuda. */
#include "oc.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* Entries kept by the allocator's history ring: the figure PyTorch's own
 * memory tutorial uses; the default (sys.maxsize) grows without bound and
 * each entry holds a stack trace of several KB of host memory. */
#define SNAPSHOT_MAX_ENTRIES 100000

/* One OOM as the observer saw it; seq 0: none yet, and nothing else
 * here is read. */
typedef struct {
    unsigned long seq;
    double when;
    long device;
    unsigned long long request, limit, device_free;
    PyObject *stats;      /* torch.cuda.memory_stats(device) at the OOM, or NULL */
    int autocast;         /* 1 on, 0 off, -1 unknown */
    int snapshot_written; /* the snapshot file was written for this OOM */
    char snapshot_error[300];
} oc_oom_seen;

/* OOMs kept, GPU n's last in slot n % OOMS_KEPT: eight GPUs running out
 * together (DataParallel's threads) each keep their own. */
#define OOMS_KEPT 8

/* The handler's state: the hooks it chains to, the observer, the snapshot
 * file and the last OOM seen on each GPU (seen[newest] the newest). */
static struct {
    PyObject *prev_sys_hook, *prev_thread_hook, *type;
    /* The observer: attached (or to be) with observer_state saying when, or
     * none with observer_none saying why (static storage). */
    const char *observer_state, *observer_none;
    char snapshot_path[PATH_MAX]; /* OUTOFCUDA_OOM_SNAPSHOT made absolute, "" off */
    oc_oom_seen seen[OOMS_KEPT];
    int newest;
} oom;

/* A report's room for ranked actions and notes, the bytes of an OOM's
 * message it keeps, the characters of it and other processes it shows. */
#define ADVICE_MAX 12
#define NOTES_MAX 4
#define MESSAGE_MAX 399
#define MESSAGE_SHOWN 160
#define OTHERS_SHOWN 6

typedef struct {
    unsigned int pid;
    long long used; /* -1: unknown */
    char name[64];  /* "": unknown */
} oom_proc;

/* What the IPython handler did with a failed cell's frames ("cell_frames"). */
typedef enum { FRAMES_NOT_A_CELL, FRAMES_RELEASED, FRAMES_KEPT, FRAMES_INTERRUPTED } oom_frames;
static const char *const frames_word[] = {"", "released", "kept", "interrupted"};

/* One report, gathered (build_report) or read back from its dict
 * (report_from_dict). Byte counts and the device are -1 where unknown,
 * texts "" where there is none (an allocator string that is set may be
 * empty: has_allocator), fraction < 0 when none is set, autocast -1 when
 * unknown; a note is an advice item's text. report_clear releases it. */
typedef struct {
    double when, fraction;
    int from_observer, nvml, has_allocator, expandable, no_expandable_here, autocast;
    long long device, request, total, free_b, limit, allocated, reserved, peak, fragmentation,
        inactive, num_ooms;
    char message[4 * MESSAGE_SHOWN + 1], device_name[96], allocator[OC_ALLOC_CONF_MAX],
        snapshot[PATH_MAX];
    oom_proc *procs; /* n_procs of them (malloc'd), most memory first */
    int n_procs, n_notes, n_advice;
    oc_advice_item notes[NOTES_MAX], advice[ADVICE_MAX];
    oom_frames frames;
} oom_report;

static void report_clear(oom_report *r)
{
    free(r->procs);
    r->procs = NULL;
}

/* Copies the current exception's text into buf and clears it. A Ctrl-C or
 * an exit() is the program's: set aside for the edge to raise, not text;
 * then returns 1, else 0. */
static int take_error(char *buf, size_t sz, const char *what)
{
    PyObject *type, *value, *tb, *s = NULL;
    char text[240];
    if (PyErr_ExceptionMatches(PyExc_KeyboardInterrupt) ||
        PyErr_ExceptionMatches(PyExc_SystemExit)) {
        OC_CLEAR();
        snprintf(buf, sz, "%s: interrupted", what);
        return 1;
    }
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    s = value ? PyObject_Str(value) : NULL;
    OC_CLEAR();
    snprintf(buf, sz, "%s: %s", what, oc_utf8(s, text, sizeof text));
    Py_XDECREF(s);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    return 0;
}

/* Returns 1, 0 or -1 (unknown) for "is autocast on for CUDA in this thread". */
static int autocast_enabled(PyObject *torch)
{
    PyObject *r = PyObject_CallMethod(torch, "is_autocast_enabled", "s", "cuda");
    int on;
    if (r == NULL) {
        /* Before 2.4 the function took no argument and meant CUDA. */
        OC_CLEAR();
        r = PyObject_CallMethod(torch, "is_autocast_enabled", NULL);
    }
    if (r == NULL) {
        OC_CLEAR();
        return -1;
    }
    on = PyObject_IsTrue(r);
    Py_DECREF(r);
    if (on < 0)
        OC_CLEAR();
    return on;
}

/* Writes the allocator history to oom.snapshot_path; records in seen
 * whether it did. */
static void dump_snapshot(PyObject *torch, oc_oom_seen *seen)
{
    PyObject *mem = oc_getattr_chain(torch, "cuda.memory");
    PyObject *r = mem ? PyObject_CallMethod(mem, "_dump_snapshot", "s", oom.snapshot_path) : NULL;
    if (r == NULL) {
        if (PyErr_Occurred())
            take_error(seen->snapshot_error, sizeof seen->snapshot_error, "dumping the snapshot");
        else
            snprintf(seen->snapshot_error, sizeof seen->snapshot_error,
                     "this torch has no torch.cuda.memory._dump_snapshot");
    } else {
        seen->snapshot_written = 1;
    }
    Py_XDECREF(r);
    Py_XDECREF(mem);
}

/* Starts the allocator history for OUTOFCUDA_OOM_SNAPSHOT. Returns 0 or -1
 * with an exception set. 2.1+ takes enabled="all"/max_entries; 2.0 took a
 * bool and trace_alloc_* keywords. */
static int start_history(PyObject *torch)
{
    PyObject *fn = oc_getattr_chain(torch, "cuda.memory._record_memory_history");
    PyObject *args = NULL, *kw = NULL, *r = NULL;
    if (fn == NULL) {
        PyErr_SetString(PyExc_AttributeError, "torch.cuda.memory._record_memory_history");
        return -1;
    }
    args = Py_BuildValue("(s)", "all");
    kw = Py_BuildValue("{s:i}", "max_entries", SNAPSHOT_MAX_ENTRIES);
    r = (args && kw) ? PyObject_Call(fn, args, kw) : NULL;
    if (r == NULL && PyErr_ExceptionMatches(PyExc_TypeError)) {
        OC_CLEAR();
        Py_CLEAR(args);
        Py_CLEAR(kw);
        args = Py_BuildValue("(O)", Py_True);
        kw = Py_BuildValue("{s:i,s:O}", "trace_alloc_max_entries", SNAPSHOT_MAX_ENTRIES,
                           "trace_alloc_record_context", Py_True);
        r = (args && kw) ? PyObject_Call(fn, args, kw) : NULL;
    }
    Py_XDECREF(args);
    Py_XDECREF(kw);
    Py_DECREF(fn);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* Reads OUTOFCUDA_OOM_SNAPSHOT into oom.snapshot_path (absolute). The value is a
 * file path and nothing else; a bad one gets one warning and is ignored. */
static void read_snapshot_env(void)
{
    const char *v = oc_env("OUTOFCUDA_OOM_SNAPSHOT"), *base, *slash;
    char dir[PATH_MAX], why[PATH_MAX + 64] = "", msg[OC_WARN_LEN + PATH_MAX];
    struct stat st;
    int resolved;
    oom.snapshot_path[0] = '\0';
    /* An off word is off, as for every setting, never a file named "0". */
    if (v == NULL || v[0] == '\0' || oc_parse_off(v))
        return;
    slash = strrchr(v, '/');
    base = slash ? slash + 1 : v;
    if (strlen(v) >= sizeof dir - 1 || *base == '\0' || strcmp(base, ".") == 0 ||
        strcmp(base, "..") == 0)
        snprintf(why, sizeof why, "it must name a file to write (for example /tmp/oom.pickle)");
    else if ((resolved = oc_resolve_file_path(v, dir, sizeof dir, oom.snapshot_path,
                                              sizeof oom.snapshot_path)) == -1)
        snprintf(why, sizeof why, "its directory %.200s does not exist", dir);
    else if (resolved != 0 || (stat(oom.snapshot_path, &st) == 0 && S_ISDIR(st.st_mode)))
        snprintf(why, sizeof why, "it must name a file, not a directory");
    if (why[0] == '\0')
        return;
    snprintf(msg, sizeof msg, "outofcuda: OUTOFCUDA_OOM_SNAPSHOT=%.200s ignored: %s", v, why);
    oom.snapshot_path[0] = '\0';
    oc_warn(msg);
}

/* ---- the ranked actions (the rules and their ranking: advice.c) ---- */

/* Ranks the actions that fit r's figures (advice.c) into r->advice;
 * device_limit: the device's memory as the observer saw it, where NVML
 * gave no total. */
static void rank(oom_report *r, int exhausted, unsigned long long device_limit)
{
    oc_oom_figures f;
    memset(&f, 0, sizeof f);
#define KNOWN(v) ((v) > 0 ? (unsigned long long)(v) : 0)
    f.request = KNOWN(r->request);
    f.total = r->total > 0 ? (unsigned long long)r->total : device_limit;
    f.limit = KNOWN(r->limit);
    f.allocated = KNOWN(r->allocated);
    f.reserved = KNOWN(r->reserved);
    f.inactive_split = KNOWN(r->inactive);
#undef KNOWN
    f.fraction = r->fraction > 0.0 ? r->fraction : 0.0;
    f.expandable = r->expandable;
    f.no_expandable_here = r->no_expandable_here;
    f.autocast = r->autocast;
    f.exhausted = exhausted;
    for (; f.n_others < r->n_procs && f.n_others < OC_OOM_OTHERS_MAX; f.n_others++) {
        f.others[f.n_others].pid = r->procs[f.n_others].pid;
        f.others[f.n_others].used = (unsigned long long)r->procs[f.n_others].used;
        snprintf(f.others[f.n_others].name, sizeof f.others[0].name, "%s",
                 r->procs[f.n_others].name);
    }
    r->n_advice = oc_oom_advise(&f, r->advice, ADVICE_MAX);
}

/* A byte count passed to _oom_advice: 0 (unknown) for None or what is not
 * an int. */
static unsigned long long arg_bytes(PyObject *v)
{
    unsigned long long x = v && PyLong_Check(v) ? PyLong_AsUnsignedLongLong(v) : 0;
    if (PyErr_Occurred())
        x = 0;
    OC_CLEAR();
    return x;
}

/* (pid, name or None, bytes) of another process into p, its name escaped.
 * 0, or -1 with an exception set. */
static int arg_process(PyObject *item, oom_proc *p)
{
    PyObject *t = PySequence_Tuple(item);
    const char *name = "";
    unsigned long long used = 0;
    int ok = t && PyArg_ParseTuple(t, "IzK", &p->pid, &name, &used);
    if (ok) {
        snprintf(p->name, sizeof p->name, "%s", name ? name : "");
        oc_escape_controls(p->name, sizeof p->name);
        p->used = (long long)used;
    }
    Py_XDECREF(t);
    return ok ? 0 : -1;
}

/* _oom_advice(**figures) -> list of str, most useful first, ranked as a
 * report's are (rank). Keywords (all optional; None = unknown): request,
 * total, limit, allocated, reserved, inactive_split (bytes), fraction
 * (float), expandable, no_expandable_here, autocast, exhausted (bool),
 * others (list of (pid, name, bytes)). */
static PyObject *py_oom_advice(PyObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {
        "request",        "total",    "limit",      "allocated",          "reserved",
        "inactive_split", "fraction", "expandable", "no_expandable_here", "autocast",
        "exhausted",      "others",   NULL};
    PyObject *v[12] = {NULL}, *texts = NULL;
    oom_report r = {0};
    long long *bytes[] = {&r.request, &r.total, &r.limit, &r.allocated, &r.reserved, &r.inactive};
    int flag[4];
    Py_ssize_t n;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|$OOOOOOOOOOOO:_oom_advice", kwlist, &v[0], &v[1],
                                     &v[2], &v[3], &v[4], &v[5], &v[6], &v[7], &v[8], &v[9], &v[10],
                                     &v[11]))
        return NULL;
    for (int i = 0; i < 4; i++) {
        flag[i] = v[7 + i] == NULL || v[7 + i] == Py_None ? -1 : PyObject_IsTrue(v[7 + i]);
        if (PyErr_Occurred())
            return NULL;
    }
    for (int i = 0; i < 6; i++)
        *bytes[i] = (long long)arg_bytes(v[i]);
    r.fraction = v[6] && v[6] != Py_None ? PyFloat_AsDouble(v[6]) : 0.0;
    r.expandable = flag[0] == 1;
    r.no_expandable_here = flag[1] == 1;
    r.autocast = flag[2];
    n = v[11] && v[11] != Py_None && !PyErr_Occurred() ? PySequence_Size(v[11]) : 0;
    n = n < OC_OOM_OTHERS_MAX ? n : OC_OOM_OTHERS_MAX;
    r.procs = n > 0 ? calloc((size_t)n, sizeof *r.procs) : NULL;
    while (r.procs && r.n_procs < n) {
        PyObject *item = PySequence_GetItem(v[11], r.n_procs);
        int rc = item ? arg_process(item, &r.procs[r.n_procs]) : -1;
        Py_XDECREF(item);
        if (rc < 0)
            break;
        r.n_procs++;
    }
    if (n > 0 && r.procs == NULL)
        PyErr_NoMemory();
    if (!PyErr_Occurred()) {
        rank(&r, flag[3] == 1, 0);
        texts = oc_advice_texts(r.advice, r.n_advice);
    }
    report_clear(&r);
    return texts;
}

/* ---- the whole report, figures and ranked advice ---- */

/* How long after the observer fired an exception may still use its figures. */
#define OBSERVER_WINDOW_S 30.0

/* Request size and device index from torch's OOM message ("Tried to
 * allocate 2.00 GiB", "GPU 0"); -1 where absent. */
static void from_message(const char *text, long long *request, long *device)
{
    static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    const char *p = text ? strstr(text, "Tried to allocate ") : NULL;
    *request = -1;
    *device = -1;
    if (p != NULL) {
        char *end;
        double x = strtod(p + 18, &end);
        if (end != p + 18 && *end == ' ') {
            for (int i = 4; i >= 0; i--) {
                size_t n = strlen(units[i]);
                if (strncmp(end + 1, units[i], n) == 0) {
                    double bytes = x * (double)(1ull << (10 * i));
                    /* Text from the program's exception: inf or 1e300
                     * would not fit (undefined behaviour), so unknown. */
                    if (bytes >= 0.0 && bytes < 9.0e18)
                        *request = (long long)bytes;
                    break;
                }
            }
        }
    }
    p = text ? strstr(text, "GPU ") : NULL;
    if (p != NULL && p[4] >= '0' && p[4] <= '9')
        *device = strtol(p + 4, NULL, 10);
}

/* A figure (new ref): an int, or None when negative (unknown). */
static PyObject *figure(long long v)
{
    if (v < 0)
        Py_RETURN_NONE;
    return PyLong_FromLongLong(v);
}

/* stats[key] as a number, or -1. */
static long long stat_of(PyObject *stats, const char *key)
{
    PyObject *v = stats && PyDict_Check(stats) ? PyDict_GetItemString(stats, key) : NULL;
    long long x = v && PyLong_Check(v) ? PyLong_AsLongLong(v) : -1;
    if (PyErr_Occurred())
        x = -1;
    OC_CLEAR();
    return x;
}

/* Strips "GPU-" and compares case-insensitively. */
static int same_uuid(const char *a, const char *b)
{
    if (strncasecmp(a, "gpu-", 4) == 0)
        a += 4;
    if (strncasecmp(b, "gpu-", 4) == 0)
        b += 4;
    return *a != '\0' && strcasecmp(a, b) == 0;
}

/* NVML's index of torch's cuda:device: by UUID once CUDA is up (torch
 * knows it then), else through CUDA_VISIBLE_DEVICES. -1 when unmatched. */
static int nvml_index_of(PyObject *cuda, long device, int cuda_up, oc_gpu_info *info)
{
    int n = oc_nvml_device_count(), index = -1;
    if (cuda_up) {
        PyObject *props = PyObject_CallMethod(cuda, "get_device_properties", "l", device);
        PyObject *uuid = props ? PyObject_GetAttrString(props, "uuid") : NULL;
        PyObject *s = uuid ? PyObject_Str(uuid) : NULL;
        char want[96] = "";
        oc_utf8(s, want, sizeof want);
        OC_CLEAR();
        Py_XDECREF(s);
        Py_XDECREF(uuid);
        Py_XDECREF(props);
        for (int i = 0; want[0] && i < n && index < 0; i++) {
            if (oc_nvml_device_info(i, info) == 0 && same_uuid(info->uuid, want))
                index = i;
        }
    }
    if (index < 0 && device >= 0)
        index = oc_nvml_index((int)device);
    if (index >= 0 && oc_nvml_device_info(index, info) != 0)
        index = -1;
    return index;
}

/* The fraction outofcuda set (its record), or 0 when none. */
static double fraction_set(void)
{
    const oc_record *r = oc_record_get(OC_OPT_FRACTION);
    if (r->state != OC_REC_APPLIED || r->kind != OC_VAL_FRACTION)
        return 0.0;
    /* Recorded as 0 < f <= 1; anything else reads as none. */
    return r->fraction > 0.0 ? r->fraction : 0.0;
}

/* The allocator string in effect as outofcuda knows it: what it handed to
 * torch, else the variable this torch reads (an empty one counts as set).
 * Returns 0 when neither is there. */
static int allocator_config(PyObject *torch, char *buf, size_t sz)
{
    const oc_record *r = oc_record_get(OC_OPT_ALLOCATOR);
    const char *value = NULL;
    if (r->kind == OC_VAL_TEXT)
        value = r->text;
    else
        oc_alloc_user_var(oc_torch_version(torch), &value);
    snprintf(buf, sz, "%s", value ? value : "");
    return value != NULL;
}

/* Adds a note to r (dropped when NOTES_MAX are there). */
static void add_note(oom_report *r, const char *text)
{
    if (r->n_notes < NOTES_MAX)
        snprintf(r->notes[r->n_notes++].text, sizeof r->notes[0].text, "%s", text);
}

/* Reports built in this process, for the test door: a retry that succeeds
 * builds none. */
static unsigned long reports_built;

/* The first line of an OOM's message, stripped, its first MESSAGE_MAX bytes
 * (cut between characters) into r->message; the type's name when blank. */
static void gather_message(oom_report *r, const char *text)
{
    const char *p = text;
    size_t len;
    while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')
        p++;
    len = strcspn(p, "\n");
    while (len > 0 && (p[len - 1] == ' ' || p[len - 1] == '\t' || p[len - 1] == '\r'))
        len--;
    if (*p == '\0') {
        p = "OutOfMemoryError";
        len = strlen(p);
    }
    len = oc_utf8_fit(p, len, MESSAGE_MAX);
    memcpy(r->message, p, len);
    r->message[len] = '\0';
}

/* The device and request from the message (text, or NULL), and the
 * observer's OOM of that GPU (else the newest) into *seen, copied whole
 * before anything calls into torch, where another thread's OOM may replace
 * it: one report never mixes two OOMs. The observer's figures are used when
 * recent and of the same GPU and size; then its stats are returned (new
 * ref, or NULL). */
static PyObject *gather_seen(oom_report *r, const char *text, oc_oom_seen *seen)
{
    long device;
    from_message(text, &r->request, &device);
    r->device = device;
    *seen = oom.seen[device >= 0 ? device % OOMS_KEPT : oom.newest];
    r->from_observer = seen->seq > 0 && (double)time(NULL) - seen->when <= OBSERVER_WINDOW_S &&
                       (device < 0 || device == seen->device) &&
                       (r->request < 0 || llabs(r->request - (long long)seen->request) <=
                                              (long long)(seen->request / 100));
    if (!r->from_observer)
        return NULL;
    r->device = seen->device;
    r->request = (long long)seen->request;
    Py_XINCREF(seen->stats);
    return seen->stats;
}

/* This process's allocator figures from stats (the observer's, a reference
 * this takes) or torch.cuda.memory_stats now; a note when CUDA has not
 * started. Returns whether CUDA is up. */
static int gather_allocator(oom_report *r, PyObject *cuda, PyObject *stats)
{
    PyObject *v = PyObject_CallMethod(cuda, "is_initialized", NULL);
    int cuda_up = v != NULL && PyObject_IsTrue(v) == 1;
    Py_XDECREF(v);
    OC_CLEAR();
    if (r->device < 0 && cuda_up) {
        v = PyObject_CallMethod(cuda, "current_device", NULL);
        r->device = v ? PyLong_AsLong(v) : -1;
        Py_XDECREF(v);
        OC_CLEAR();
    }
    if (stats == NULL && cuda_up && r->device >= 0) {
        stats = PyObject_CallMethod(cuda, "memory_stats", "L", r->device);
        OC_CLEAR();
    } else if (stats == NULL) {
        add_note(r, "CUDA is not initialised in this process: no allocator figures");
    }
    r->allocated = stat_of(stats, "allocated_bytes.all.current");
    r->reserved = stat_of(stats, "reserved_bytes.all.current");
    r->peak = stat_of(stats, "allocated_bytes.all.peak");
    r->inactive = stat_of(stats, "inactive_split_bytes.all.current");
    r->num_ooms = stat_of(stats, "num_ooms");
    r->fragmentation = r->reserved < 0 || r->allocated < 0 ? -1
                       : r->reserved > r->allocated        ? r->reserved - r->allocated
                                                           : 0;
    Py_XDECREF(stats);
    return cuda_up;
}

/* The device's totals and the other processes on it from NVML, or a note
 * saying why not (then the free bytes the observer saw, if it did). 0, or
 * -1 with an exception set. */
static int gather_nvml(oom_report *r, PyObject *cuda, int cuda_up, const oc_oom_seen *seen)
{
    oc_gpu_info info;
    oc_gpu_proc *procs = NULL;
    char why[200] = "", note[OC_ADVICE_LEN];
    int index = -1, n;
    memset(&info, 0, sizeof info);
    if (r->device >= 0 && oc_nvml_available(why, sizeof why))
        index = nvml_index_of(cuda, (long)r->device, cuda_up, &info);
    if (index < 0) {
        snprintf(note, sizeof note, "NVML: %s: no device totals or other processes",
                 why[0] ? why : "this GPU could not be matched");
        add_note(r, note);
        r->free_b = r->from_observer ? (long long)seen->device_free : -1;
        r->total = -1;
        return 0;
    }
    r->nvml = 1;
    snprintf(r->device_name, sizeof r->device_name, "%s", info.name);
    r->total = (long long)info.total;
    r->free_b = (long long)info.free;
    n = oc_nvml_process_list(index, &procs);
    r->procs = n > 0 ? calloc((size_t)n, sizeof *r->procs) : NULL;
    oc_nvml_sort_procs(procs, n);
    for (int i = 0; r->procs != NULL && i < n; i++) {
        oom_proc *p = &r->procs[r->n_procs];
        if (procs[i].pid == (unsigned int)getpid())
            continue;
        p->pid = procs[i].pid;
        p->used = procs[i].used == OC_NVML_NOT_AVAILABLE ? 0 : (long long)procs[i].used;
        oc_proc_name(p->pid, p->name, sizeof p->name);
        r->n_procs++;
    }
    free(procs);
    return n > 0 && r->procs == NULL ? (PyErr_NoMemory(), -1) : 0;
}

/* The settings in effect: allocator string, fraction (and the cap it made,
 * for the observer's OOM), autocast, and the snapshot written for it. */
static void gather_settings(oom_report *r, PyObject *torch, const oc_oom_seen *seen)
{
    double fraction = fraction_set();
    r->has_allocator = allocator_config(torch, r->allocator, sizeof r->allocator);
    r->expandable = oc_alloc_expandable(r->allocator);
    r->no_expandable_here = oc_platform_no_expandable() != NULL;
    r->fraction = fraction > 0.0 ? fraction : -1.0;
    r->limit = r->from_observer && fraction > 0.0 ? (long long)seen->limit : -1;
    r->autocast =
        r->from_observer && seen->autocast >= 0 ? seen->autocast : autocast_enabled(torch);
    if (r->from_observer && seen->snapshot_written)
        snprintf(r->snapshot, sizeof r->snapshot, "%s", oom.snapshot_path);
    if (r->from_observer && seen->snapshot_error[0])
        add_note(r, seen->snapshot_error);
}

/* dict[key] = v, taking v's reference (NULL: the error that made it). 0, or
 * -1 with an exception set; psutil's pydict_add. */
static int pydict_add(PyObject *dict, const char *key, PyObject *v)
{
    int rc = v ? PyDict_SetItemString(dict, key, v) : -1;
    Py_XDECREF(v);
    return rc;
}

/* text as a str (new ref), or None where it is not there. */
static PyObject *text_or_none(const char *text, int there)
{
    if (!there)
        Py_RETURN_NONE;
    return PyUnicode_DecodeUTF8(text, (Py_ssize_t)strlen(text), "surrogatepass");
}

/* The other processes as a list of {pid, name, used_bytes} (new ref). */
static PyObject *procs_list(const oom_report *r)
{
    PyObject *list = PyList_New(0);
    for (int i = 0; list != NULL && i < r->n_procs; i++) {
        const oom_proc *p = &r->procs[i];
        PyObject *d =
            Py_BuildValue("{s:I,s:s,s:L}", "pid", p->pid, "name", p->name, "used_bytes", p->used);
        if (d == NULL || PyList_Append(list, d) < 0)
            Py_CLEAR(list);
        Py_XDECREF(d);
    }
    return list;
}

/* The dict last_oom() returns for r (new ref), or NULL with an exception set. */
static PyObject *report_dict(const oom_report *r)
{
    PyObject *d = PyDict_New();
    if (d == NULL || pydict_add(d, "time", PyFloat_FromDouble(r->when)) ||
        pydict_add(d, "source", text_or_none(r->from_observer ? "observer" : "exception", 1)) ||
        pydict_add(d, "message", text_or_none(r->message, r->message[0] != '\0')) ||
        pydict_add(d, "device", figure(r->device)) ||
        pydict_add(d, "device_name", text_or_none(r->device_name, r->nvml)) ||
        pydict_add(d, "request_bytes", figure(r->request)) ||
        pydict_add(d, "total_bytes", figure(r->total)) ||
        pydict_add(d, "free_bytes", figure(r->free_b)) ||
        pydict_add(d, "limit_bytes", figure(r->limit)) ||
        pydict_add(d, "allocated_bytes", figure(r->allocated)) ||
        pydict_add(d, "reserved_bytes", figure(r->reserved)) ||
        pydict_add(d, "peak_allocated_bytes", figure(r->peak)) ||
        pydict_add(d, "fragmentation_bytes", figure(r->fragmentation)) ||
        pydict_add(d, "inactive_split_bytes", figure(r->inactive)) ||
        pydict_add(d, "num_ooms", figure(r->num_ooms)) ||
        pydict_add(d, "other_processes", procs_list(r)) ||
        pydict_add(d, "allocator_config", text_or_none(r->allocator, r->has_allocator)) ||
        pydict_add(d, "expandable_segments", PyBool_FromLong(r->expandable)) ||
        pydict_add(d, "memory_fraction",
                   r->fraction < 0.0 ? figure(-1) : PyFloat_FromDouble(r->fraction)) ||
        pydict_add(d, "autocast", r->autocast < 0 ? figure(-1) : PyBool_FromLong(r->autocast)) ||
        pydict_add(d, "snapshot", text_or_none(r->snapshot, r->snapshot[0] != '\0')) ||
        pydict_add(d, "advice", oc_advice_texts(r->advice, r->n_advice)) ||
        pydict_add(d, "notes", oc_advice_texts(r->notes, r->n_notes)) ||
        pydict_add(d, "cell_frames", text_or_none(frames_word[r->frames], r->frames)))
        Py_CLEAR(d);
    return d;
}

/* The report of the OOM whose message is py_text (a str; NULL: the
 * observer's last) gathered and ranked into r (report_clear it), and as
 * the dict last_oom() returns (new ref); in *seq the observer's sequence
 * number it used (0: none). NULL with an exception set. */
static PyObject *build_report(PyObject *py_text, int exhausted, unsigned long *seq, oom_report *r)
{
    oc_oom_seen seen;
    PyObject *py_utf8 = NULL, *torch, *cuda, *report = NULL;
    const char *text = NULL;
    memset(r, 0, sizeof *r);
    *seq = 0;
    /* surrogatepass: the message keeps what str(exc) held */
    py_utf8 = py_text ? PyUnicode_AsEncodedString(py_text, "utf-8", "surrogatepass") : NULL;
    if (py_text != NULL && py_utf8 == NULL)
        return NULL;
    text = py_utf8 ? PyBytes_AsString(py_utf8) : NULL;
    /* A hook runs with torch imported; a caller from Python imports it as
     * `import torch` would. */
    torch = oc_sys_module("torch");
    torch = torch ? torch : PyImport_ImportModule("torch");
    cuda = torch ? PyObject_GetAttrString(torch, "cuda") : NULL;
    if (cuda != NULL) {
        PyObject *stats = gather_seen(r, text, &seen);
        if (text != NULL)
            gather_message(r, text);
        if (gather_nvml(r, cuda, gather_allocator(r, cuda, stats), &seen) == 0) {
            gather_settings(r, torch, &seen);
            rank(r, exhausted, r->from_observer ? seen.limit : 0);
            r->when = (double)time(NULL);
            report = report_dict(r);
        }
    }
    Py_XDECREF(cuda);
    Py_XDECREF(torch);
    Py_XDECREF(py_utf8);
    if (report != NULL) {
        *seq = r->from_observer ? seen.seq : 0;
        reports_built++;
    }
    return report;
}

/* ---- a report's dict read back, and its text ---- */

/* str(o) as UTF-8 (surrogates kept) into buf, cut between characters; ""
 * with an exception set where it cannot be made. */
static void str_into(PyObject *o, char *buf, size_t sz)
{
    PyObject *s = PyObject_Str(o);
    PyObject *b = s ? PyUnicode_AsEncodedString(s, "utf-8", "surrogatepass") : NULL;
    const char *p = b ? PyBytes_AsString(b) : "";
    size_t n = oc_utf8_fit(p, strlen(p), sz - 1);
    memcpy(buf, p, n);
    buf[n] = '\0';
    Py_XDECREF(b);
    Py_XDECREF(s);
}

/* map[key] read back into at: a text of `size` bytes ("" for None), or for
 * size 0 a byte count (-1 for None, TypeError for what is not an int). 0,
 * or -1 with an exception set (KeyError where it is missing). */
static int read_field(PyObject *map, const char *key, void *at, size_t size)
{
    PyObject *v = PyMapping_GetItemString(map, key);
    int there = v != NULL && v != Py_None;
    if (size > 0) {
        *(char *)at = '\0';
        if (there)
            str_into(v, at, size);
    } else if (there && !PyLong_Check(v)) {
        PyErr_SetString(PyExc_TypeError, "a report's byte count must be an int or None");
    } else {
        *(long long *)at = there ? (long long)PyLong_AsUnsignedLongLong(v) : -1;
    }
    Py_XDECREF(v);
    return PyErr_Occurred() ? -1 : 0;
}

/* str() of each of report[key]'s items into items (the first max): how
 * many, or -1 with an exception set. */
static int read_texts(PyObject *report, const char *key, oc_advice_item *items, int max)
{
    PyObject *list = PyMapping_GetItemString(report, key);
    PyObject *it = list ? PyObject_GetIter(list) : NULL, *item;
    int n = 0;
    while (it != NULL && !PyErr_Occurred() && (item = PyIter_Next(it)) != NULL) {
        if (n < max)
            str_into(item, items[n++].text, sizeof items[0].text);
        Py_DECREF(item);
    }
    Py_XDECREF(it);
    Py_XDECREF(list);
    return PyErr_Occurred() ? -1 : n;
}

/* The other processes the text shows (the first OTHERS_SHOWN). */
static int read_procs(PyObject *report, oom_report *r)
{
    PyObject *list = PyMapping_GetItemString(report, "other_processes");
    Py_ssize_t n = list ? PySequence_Size(list) : -1;
    int rc = n < 0 ? -1 : 0;
    n = n < OTHERS_SHOWN ? n : OTHERS_SHOWN;
    r->procs = n > 0 ? calloc((size_t)n, sizeof *r->procs) : NULL;
    if (n > 0 && r->procs == NULL)
        rc = (PyErr_NoMemory(), -1);
    for (Py_ssize_t i = 0; rc == 0 && i < n; i++) {
        oom_proc *p = &r->procs[i];
        PyObject *e = PySequence_GetItem(list, i);
        PyObject *pid = e ? PyMapping_GetItemString(e, "pid") : NULL;
        p->pid = pid ? (unsigned int)PyLong_AsUnsignedLong(pid) : 0;
        if (pid == NULL || PyErr_Occurred() || read_field(e, "name", p->name, sizeof p->name) ||
            read_field(e, "used_bytes", &p->used, 0))
            rc = -1;
        r->n_procs += rc == 0;
        Py_XDECREF(pid);
        Py_XDECREF(e);
    }
    Py_XDECREF(list);
    return rc;
}

/* A report's dict (last_oom()'s, or one made like it) read back into r
 * (report_clear it): the keys its text shows. 0, or -1 with an exception
 * set (TypeError for what is not a report, KeyError for a key it lacks). */
static int report_from_dict(PyObject *report, oom_report *r)
{
    PyObject *v;
    memset(r, 0, sizeof *r);
    if (!PyDict_Check(report) || PyDict_GetItemString(report, "advice") == NULL) {
        PyErr_SetString(PyExc_TypeError,
                        "format_report expects the dict that outofcuda.last_oom() returns");
        return -1;
    }
    if (read_field(report, "device", &r->device, 0) ||
        read_field(report, "device_name", r->device_name, sizeof r->device_name) ||
        read_field(report, "message", r->message, sizeof r->message) ||
        read_field(report, "request_bytes", &r->request, 0) ||
        read_field(report, "total_bytes", &r->total, 0) ||
        read_field(report, "free_bytes", &r->free_b, 0) ||
        read_field(report, "allocated_bytes", &r->allocated, 0) ||
        read_field(report, "reserved_bytes", &r->reserved, 0) ||
        read_field(report, "peak_allocated_bytes", &r->peak, 0) ||
        read_field(report, "fragmentation_bytes", &r->fragmentation, 0) ||
        read_field(report, "inactive_split_bytes", &r->inactive, 0) || read_procs(report, r) ||
        read_field(report, "allocator_config", r->allocator, sizeof r->allocator) ||
        read_field(report, "limit_bytes", &r->limit, 0) ||
        read_field(report, "snapshot", r->snapshot, sizeof r->snapshot) ||
        (r->n_notes = read_texts(report, "notes", r->notes, NOTES_MAX)) < 0 ||
        (r->n_advice = read_texts(report, "advice", r->advice, ADVICE_MAX)) < 0 ||
        (v = PyMapping_GetItemString(report, "memory_fraction")) == NULL)
        return -1;
    r->fraction = v == Py_None ? -1.0 : PyFloat_AsDouble(v);
    Py_DECREF(v);
    /* borrowed; a report made before the key was there has none */
    v = PyDict_GetItemString(report, "cell_frames");
    for (int i = 1; v != NULL && PyUnicode_Check(v) && i <= FRAMES_INTERRUPTED; i++) {
        if (PyUnicode_CompareWithASCIIString(v, frames_word[i]) == 0)
            r->frames = (oom_frames)i;
    }
    return PyErr_Occurred() ? -1 : 0;
}

/* A byte count as the report writes it (oc_fmt_bytes; "unknown"), in buf. */
static const char *bytes_text(long long n, char *buf, size_t sz)
{
    if (n < 0)
        return "unknown";
    oc_fmt_bytes((unsigned long long)n, buf, sz);
    return buf;
}

/* The bytes of the first `chars` characters of UTF-8 text s. */
static int utf8_prefix(const char *s, int chars)
{
    int n = 0;
    for (; s[n] != '\0'; n++) {
        if (((unsigned char)s[n] & 0xC0) != 0x80 && chars-- == 0)
            break;
    }
    return n;
}

/* The header and the figures' lines. */
static void figure_lines(oc_text *t, const oom_report *r)
{
    char b1[48], b2[48], b3[48];
    snprintf(b1, sizeof b1, "%lld", r->device);
    oc_appendf(t, "outofcuda: CUDA out of memory on cuda:%s", r->device < 0 ? "?" : b1);
    if (r->device_name[0])
        oc_appendf(t, " (%s)", r->device_name);
    if (r->message[0])
        oc_appendf(t, "\n  error              %.*s", utf8_prefix(r->message, MESSAGE_SHOWN),
                   r->message);
    oc_appendf(t, "\n  requested          %s", bytes_text(r->request, b1, sizeof b1));
    if (r->total >= 0)
        oc_appendf(t, "\n  device             %s total, %s free (NVML)",
                   bytes_text(r->total, b1, sizeof b1), bytes_text(r->free_b, b2, sizeof b2));
    else if (r->free_b >= 0)
        oc_appendf(t, "\n  device             %s free (CUDA)",
                   bytes_text(r->free_b, b2, sizeof b2));
    else
        oc_appendf(t, "\n  device             unknown");
    oc_appendf(t, "\n  this process       allocated %s, reserved %s, peak allocated %s",
               bytes_text(r->allocated, b1, sizeof b1), bytes_text(r->reserved, b2, sizeof b2),
               bytes_text(r->peak, b3, sizeof b3));
    oc_appendf(t, "\n  fragmentation      %s reserved but unallocated, %s in inactive split blocks",
               bytes_text(r->fragmentation, b1, sizeof b1), bytes_text(r->inactive, b2, sizeof b2));
}

/* The lines of the other processes and the settings in effect. */
static void setting_lines(oc_text *t, const oom_report *r)
{
    char b[48];
    if (r->n_procs == 0 && r->total >= 0)
        oc_appendf(t, "\n  other processes    none");
    for (int i = 0; i < r->n_procs && i < OTHERS_SHOWN; i++)
        oc_appendf(t, "%spid %u (%s) %s", i ? ", " : "\n  other processes    ", r->procs[i].pid,
                   r->procs[i].name[0] ? r->procs[i].name : "?",
                   bytes_text(r->procs[i].used, b, sizeof b));
    oc_appendf(t, "\n  allocator          %s", r->allocator[0] ? r->allocator : "PyTorch defaults");
    if (r->fraction < 0.0)
        oc_appendf(t, "\n  memory fraction    none");
    else
        oc_appendf(t, "\n  memory fraction    %.2f", r->fraction);
    if (r->limit > 0)
        oc_appendf(t, " (cap %s)", bytes_text(r->limit, b, sizeof b));
    if (r->snapshot[0])
        oc_appendf(t, "\n  snapshot           %s (open it at https://pytorch.org/memory_viz)",
                   r->snapshot);
}

/* The notes, what was done with a notebook cell's frames, the ranked actions. */
static void item_lines(oc_text *t, const oom_report *r)
{
    for (int i = 0; i < r->n_notes; i++)
        oc_appendf(t, "\n  note               %s", r->notes[i].text);
    if (r->frames == FRAMES_RELEASED)
        oc_appendf(t, "\n  cell frames        released, so %%debug has no traceback "
                      "(%%env OUTOFCUDA_OOM_KEEP_FRAMES=1 keeps them)");
    else if (r->frames == FRAMES_KEPT)
        oc_appendf(t, "\n  cell frames        kept for %%debug (OUTOFCUDA_OOM_KEEP_FRAMES=1): they "
                      "hold the cell's tensors until the next error");
    else if (r->frames == FRAMES_INTERRUPTED)
        oc_appendf(t, "\n  cell frames        kept: a Ctrl-C came before their release");
    oc_appendf(t, "\n  what to try, most useful first:");
    for (int i = 0; i < r->n_advice; i++)
        oc_appendf(t, "\n    %d. %s", i + 1, r->advice[i].text);
}

/* The text of a report (new ref), as printed before the traceback of an
 * uncaught OOM; NULL with an exception set. */
static PyObject *render_report(const oom_report *r)
{
    /* Each field at most once, the labels and numbers well under 4 KiB. */
    oc_text t = {PyMem_Malloc(sizeof *r + 4096), 0, sizeof *r + 4096};
    PyObject *text;
    if (t.buf == NULL)
        return PyErr_NoMemory();
    figure_lines(&t, r);
    setting_lines(&t, r);
    item_lines(&t, r);
    text = PyUnicode_DecodeUTF8(t.buf, (Py_ssize_t)t.len, "surrogatepass");
    PyMem_Free(t.buf);
    return text;
}

/* _oom_format(report) -> str: the text of a report's dict. */
static PyObject *py_oom_format(PyObject *self, PyObject *report)
{
    oom_report r;
    PyObject *text = report_from_dict(report, &r) == 0 ? render_report(&r) : NULL;
    (void)self;
    report_clear(&r);
    return text;
}

/* ---- the report last_oom() returns ---- */

/* The last report, built at an uncaught OOM, by auto_microbatch when it
 * gives up, or when last_oom() is asked after an OOM nothing reported yet;
 * and the text of an OOM a retry may survive, whose report is built only if
 * last_oom() asks. Touched under the GIL only; a build runs torch's Python,
 * where another thread may come in, so what it keeps is compared again after
 * (the newest observer figures win, a newer pending text stays). */
static struct {
    PyObject *report;  /* the dict, or NULL before any */
    unsigned long seq; /* the observer's sequence number it was built from */
    PyObject *pending; /* str, or NULL */
} last;

/* Keeps report (a new reference is taken) as last_oom()'s, built from the
 * observer's OOM seq. */
static void keep_report(PyObject *report, unsigned long seq)
{
    PyObject *old = last.report;
    Py_INCREF(report);
    last.report = report;
    last.seq = seq > last.seq ? seq : last.seq;
    Py_XDECREF(old);
}

/* The text a report reads for exc, into *text (new ref): str(exc), or its
 * type's name when that is blank; NULL for no exception (NULL or None).
 * Returns 0, or -1 with an exception set. */
static int exc_text(PyObject *exc, PyObject **text)
{
    PyObject *s, *stripped;
    Py_ssize_t n;
    *text = NULL;
    if (exc == NULL || exc == Py_None)
        return 0;
    s = PyObject_Str(exc);
    stripped = s ? PyObject_CallMethod(s, "strip", NULL) : NULL;
    n = stripped ? PyObject_Length(stripped) : -1;
    Py_XDECREF(stripped);
    if (n == 0) {
        Py_DECREF(s);
        s = PyObject_GetAttrString((PyObject *)Py_TYPE(exc), "__name__");
    } else if (n < 0) {
        Py_CLEAR(s);
    }
    *text = s;
    return s ? 0 : -1;
}

/* The report of exc (NULL or None: the observer's last OOM): the one exc
 * carries as outofcuda_report unless refresh (read back into r when
 * read_back), else one built now into r, kept for last_oom() and attached
 * to exc. New ref, or NULL with an exception set; report_clear(r) after. */
static PyObject *record_report(PyObject *exc, int exhausted, int refresh, oom_report *r,
                               int read_back)
{
    PyObject *report, *text;
    unsigned long seq;
    memset(r, 0, sizeof *r);
    if (exc == Py_None)
        exc = NULL;
    if (exc != NULL && !refresh) {
        report = PyObject_GetAttrString(exc, "outofcuda_report");
        if (report == NULL && !PyErr_ExceptionMatches(PyExc_AttributeError))
            return NULL;
        OC_CLEAR_ABSENT(); /* an exception that carries no report yet */
        if (report != NULL && PyDict_Check(report)) {
            if (read_back && report_from_dict(report, r) < 0)
                Py_CLEAR(report);
            return report;
        }
        Py_XDECREF(report);
    }
    if (exc_text(exc, &text) < 0)
        return NULL;
    report = build_report(text, exhausted, &seq, r);
    Py_XDECREF(text);
    if (report == NULL)
        return NULL;
    keep_report(report, seq);
    Py_CLEAR(last.pending);
    if (exc != NULL && PyObject_SetAttrString(exc, "outofcuda_report", report) < 0) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            Py_CLEAR(report);
        else
            OC_CLEAR_ABSENT(); /* an exception that takes no attribute */
    }
    return report;
}

/* _oom_record(exc=None, exhausted=False, refresh=False) -> dict: the report
 * of exc (record_report); exhausted: auto_microbatch split down to its
 * smallest size. */
static PyObject *py_oom_record(PyObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"exc", "exhausted", "refresh", NULL};
    PyObject *exc = Py_None, *report;
    oom_report r;
    int exhausted = 0, refresh = 0;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|Opp:_oom_record", kwlist, &exc, &exhausted,
                                     &refresh))
        return NULL;
    report = record_report(exc, exhausted, refresh, &r, 0);
    report_clear(&r);
    return report;
}

/* _oom_note(exc) -> None: an OOM a retry may survive; only its text is kept,
 * and its report is built if last_oom() asks. */
static PyObject *py_oom_note(PyObject *self, PyObject *exc)
{
    PyObject *text, *old;
    (void)self;
    if (exc_text(exc, &text) < 0)
        return NULL;
    old = last.pending;
    last.pending = text;
    Py_XDECREF(old);
    Py_RETURN_NONE;
}

/* _oom_last() -> dict or None: the report of the last CUDA OOM; built now
 * for one the observer saw after the last report, or one a retry survived. */
static PyObject *py_oom_last(PyObject *self, PyObject *unused)
{
    unsigned long observed = oom.seen[oom.newest].seq, seq;
    PyObject *pending = last.pending, *report;
    oom_report r;
    (void)self;
    (void)unused;
    if ((observed == 0 || observed <= last.seq) && pending == NULL) {
        report = last.report ? last.report : Py_None;
        Py_INCREF(report);
        return report;
    }
    Py_XINCREF(pending);
    report = build_report(pending, 0, &seq, &r);
    report_clear(&r);
    if (report != NULL) {
        /* An observer's OOM too old for its figures is reported all the same. */
        keep_report(report, seq || pending ? seq : observed);
        if (last.pending == pending)
            Py_CLEAR(last.pending);
    }
    Py_XDECREF(pending);
    return report;
}

/* _testing.oom_reports_built() -> int: reports built in this process. */
static PyObject *py_testing_reports_built(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyLong_FromUnsignedLong(reports_built);
}

/* _is_oom(exc) -> bool: exc means the GPU ran out of memory
 * (oc_oom_kind_of). */
static PyObject *py_is_oom(PyObject *self, PyObject *exc)
{
    (void)self;
    return PyBool_FromLong(oc_oom_kind_of((PyObject *)Py_TYPE(exc), exc) != OC_OOM_NONE);
}

/* ---- the uncaught-exception path ---- */

/* After an uncaught OOM: collect garbage when configured, then give the
 * cache back (a thread's OOM leaves the process running, and so does a
 * notebook cell's), so the blocks the collection freed go back too. */
static void oom_relief(void)
{
    long long released;
    if (oc_api_clear_cache(&released) < 0)
        OC_CLEAR();
}

oc_oom_kind oc_oom_kind_of(PyObject *type, PyObject *exc)
{
    static const char *const types[] = {"cuda.OutOfMemoryError", "OutOfMemoryError"};
    static const char *const texts[] = {"CUDA out of memory", "CUBLAS_STATUS_ALLOC_FAILED"};
    PyObject *torch, *text;
    oc_oom_kind kind = OC_OOM_NONE;
    if (type == NULL || !PyType_Check(type))
        return OC_OOM_NONE;
    torch = oc_sys_module("torch");
    for (int i = 0; torch != NULL && i < 2 && kind == OC_OOM_NONE; i++) {
        PyObject *t = oc_getattr_chain(torch, types[i]);
        if (t != NULL && PyType_Check(t) && PyObject_IsSubclass(type, t) == 1)
            kind = OC_OOM_TYPE;
        Py_XDECREF(t);
        OC_CLEAR_ABSENT(); /* a torch without that type is answered by the other */
    }
    Py_XDECREF(torch);
    if (kind != OC_OOM_NONE || exc == NULL || type != PyExc_RuntimeError)
        return kind;
    text = PyObject_Str(exc);
    for (int i = 0; text != NULL && i < 2 && kind == OC_OOM_NONE; i++) {
        PyObject *needle = PyUnicode_FromString(texts[i]);
        if (needle != NULL && PySequence_Contains(text, needle) == 1)
            kind = OC_OOM_TEXT;
        Py_XDECREF(needle);
    }
    Py_XDECREF(text);
    OC_CLEAR();
    return kind;
}

/* The hooks report torch's OOM type only: a text-only one has no observer
 * figures to report. */
static int is_oom(PyObject *type)
{
    return oc_oom_kind_of(type, NULL) == OC_OOM_TYPE;
}

/* The fallback when the report cannot be built: one line. */
static void print_summary(void)
{
    PyObject *cuda = PyImport_ImportModule("torch.cuda");
    PyObject *alloc = cuda ? oc_call_quiet(cuda, "memory_allocated", NULL, NULL) : NULL;
    PyObject *reserved = alloc ? oc_call_quiet(cuda, "memory_reserved", NULL, NULL) : NULL;
    OC_CLEAR();
    oc_stderr_printf("outofcuda: CUDA out of memory (allocated %.2f GiB, reserved %.2f GiB "
                     "by this process).\n",
                     alloc ? PyLong_AsDouble(alloc) / OC_GIB : 0.0,
                     reserved ? PyLong_AsDouble(reserved) / OC_GIB : 0.0);
    OC_CLEAR();
    Py_XDECREF(alloc);
    Py_XDECREF(reserved);
    Py_XDECREF(cuda);
}

/* Prints outofcuda's report for `value` (kept for last_oom() and attached to
 * it), in one write through sys.stderr, the stream's own error handler for
 * what it cannot encode; the one-line summary where it cannot be built.
 * frames: what a notebook cell's handler does with the cell's frames. */
static void print_report(PyObject *value, oom_frames frames)
{
    oom_report r;
    PyObject *report = record_report(value, 0, 0, &r, 1), *text = NULL, *block, *utf8, *err;
    r.frames = frames; /* and last_oom() says it */
    if (report != NULL &&
        (!frames || !pydict_add(report, "cell_frames", PyUnicode_FromString(frames_word[frames]))))
        text = render_report(&r);
    report_clear(&r);
    block = text ? PyUnicode_FromFormat("%U\n\n", text) : NULL;
    utf8 = block ? PyUnicode_AsEncodedString(block, "utf-8", "backslashreplace") : NULL;
    OC_CLEAR();
    if (utf8 != NULL)
        oc_stderr_write(PyBytes_AsString(utf8));
    else
        print_summary();
    err = PySys_GetObject("stderr"); /* borrowed; flushed as the program's writes would be */
    Py_XDECREF(err && err != Py_None ? PyObject_CallMethod(err, "flush", NULL) : NULL);
    OC_CLEAR();
    Py_XDECREF(utf8);
    Py_XDECREF(block);
    Py_XDECREF(text);
    Py_XDECREF(report);
}

static PyObject *py_excepthook(PyObject *self, PyObject *args)
{
    PyObject *type, *value, *tb;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOO", &type, &value, &tb))
        return NULL;
    if (is_oom(type)) {
        print_report(value, FRAMES_NOT_A_CELL);
        oom_relief();
    }
    if (oom.prev_sys_hook != NULL)
        return PyObject_CallObject(oom.prev_sys_hook, args);
    Py_RETURN_NONE;
}

static PyObject *py_threading_excepthook(PyObject *self, PyObject *hook_args)
{
    PyObject *type = PyObject_GetAttrString(hook_args, "exc_type"), *value;
    (void)self;
    OC_CLEAR();
    if (is_oom(type)) {
        value = PyObject_GetAttrString(hook_args, "exc_value");
        OC_CLEAR();
        print_report(value ? value : Py_None, FRAMES_NOT_A_CELL);
        oom_relief();
        Py_XDECREF(value);
    }
    Py_XDECREF(type);
    if (oom.prev_thread_hook != NULL)
        return PyObject_CallFunctionObjArgs(oom.prev_thread_hook, hook_args, NULL);
    Py_RETURN_NONE;
}

OC_EDGE_VARARGS(py_excepthook)
OC_EDGE_O(py_threading_excepthook)
static PyMethodDef sys_hook_def = OC_METHOD(
    "outofcuda_excepthook", py_excepthook, "outofcuda's OOM handler; chains to the previous hook.");
static PyMethodDef thread_hook_def =
    OC_METHOD("outofcuda_threading_excepthook", py_threading_excepthook,
              "outofcuda's OOM handler; chains to the previous hook.");

/* ---- IPython and Jupyter: a cell that runs out of memory ----
 *
 * IPython shows a cell's exception with its own showtraceback() and never
 * calls sys.excepthook; its hook for that is one custom exception handler
 * per shell (InteractiveShell.set_custom_exc). After a failed cell IPython
 * keeps sys.last_type/last_value/last_traceback (and last_exc on 3.12+): the
 * failed frames and every tensor they hold stay alive, and users restart the
 * kernel (pytorch issues 27600, 37726; ipython issue 11572). The handler
 * shows IPython's traceback as IPython would, then the report, then releases
 * what the failed cell holds and empties the cache. */

/* What was decided for IPython, a stable code in status(): "pending" (CUDA
 * has not started), "no_shell", "set" ("replaced": oc_oom_ipython),
 * "user_handler_kept" (the shell had a custom exception handler: left alone), "failed". */
static const char *ipython_state = "pending";
/* Weak references to the shell last decided for (one decision per shell)
 * and to its CustomTB made of our handler (set_custom_exc makes a new one). */
static PyObject *ipython_decided, *ipython_custom_tb;
/* The OOM the handler reported last, compared by identity only (never
 * dereferenced): the at-exit report skips it. */
static const PyObject *ipython_reported;

/* o.name (new ref, NULL when absent, no exception), releasing o: one step
 * along a traceback or an exception chain. */
static PyObject *follow(PyObject *o, const char *name)
{
    PyObject *next = PyObject_GetAttrString(o, name);
    if (next == NULL)
        OC_CLEAR();
    Py_DECREF(o);
    return next;
}

/* 1 when tb entry t's frame is a generator's or coroutine's (CO_GENERATOR,
 * CO_COROUTINE, CO_ASYNC_GENERATOR) that ran on after the error passed: it
 * caught it and may be suspended, and clear() closes a suspended generator
 * (3.13+ refuses). One the error left stopped where the error passed. */
static int went_on(PyObject *t, PyObject *frame)
{
    PyObject *flags = oc_getattr_chain(frame, "f_code.co_flags");
    PyObject *at = oc_getattr_chain(frame, "f_lasti"), *passed = oc_getattr_chain(t, "tb_lasti");
    int on = flags && at && passed && (PyLong_AsLong(flags) & 0x2a0) &&
             PyObject_RichCompareBool(at, passed, Py_NE) == 1;
    OC_CLEAR();
    Py_XDECREF(flags);
    Py_XDECREF(at);
    Py_XDECREF(passed);
    return on;
}

/* Clears the locals of every frame of tb that has finished, as
 * traceback.clear_frames does (an executing frame refuses and is skipped;
 * so is a generator's that went on running).
 * Before 3.13 a frame whose f_locals was read (IPython's verbose
 * traceback, a debugger) keeps a snapshot dict of its locals that clear()
 * leaves alone; reading f_locals again syncs it with the cleared frame. */
static void clear_frames(PyObject *tb)
{
    PyObject *t = tb;
    Py_XINCREF(t);
    while (t != NULL && t != Py_None) {
        PyObject *frame = PyObject_GetAttrString(t, "tb_frame");
        PyObject *r =
            frame && !went_on(t, frame) ? PyObject_CallMethod(frame, "clear", NULL) : NULL;
        PyObject *locals = r ? PyObject_GetAttrString(frame, "f_locals") : NULL;
        if (r == NULL)
            OC_CLEAR_ABSENT(); /* the frame still runs (the handler's caller) */
        OC_CLEAR();
        Py_XDECREF(locals);
        Py_XDECREF(r);
        Py_XDECREF(frame);
        t = follow(t, "tb_next");
    }
    Py_XDECREF(t);
}

/* Drops sys.last_type, last_value, last_traceback and last_exc where they
 * hold `value` (IPython sets them for %debug and %tb). */
static void drop_last_exception(PyObject *value)
{
    static const char *const names[] = {"last_type", "last_value", "last_traceback", "last_exc"};
    if (PySys_GetObject("last_value") != value && PySys_GetObject("last_exc") != value)
        return;
    for (int i = 0; i < 4; i++) {
        if (PySys_SetObject(names[i], NULL) < 0) /* deletes; an absent name is no error */
            OC_CLEAR();
    }
}

/* Releases what the failed cell holds: the locals of the frames of the
 * OOM's traceback and of the exceptions chained to it (an OOM raised while
 * handling another), and IPython's references to it. */
static void release_cell(PyObject *value, PyObject *tb)
{
    PyObject *e = value;
    clear_frames(tb);
    Py_INCREF(e);
    /* A chain is short; the bound stops a cycle of contexts. */
    for (int depth = 0; depth < 32 && e != NULL && e != Py_None; depth++) {
        PyObject *etb = PyObject_GetAttrString(e, "__traceback__");
        PyObject *cause = etb ? PyObject_GetAttrString(e, "__cause__") : NULL;
        OC_CLEAR();
        if (etb != tb)
            clear_frames(etb);
        Py_XDECREF(etb);
        if (cause != NULL && cause != Py_None) {
            Py_DECREF(e);
            e = cause;
        } else {
            Py_XDECREF(cause);
            e = follow(e, "__context__");
        }
    }
    Py_XDECREF(e);
    drop_last_exception(value);
}

/* OUTOFCUDA_OOM_KEEP_FRAMES, read when a cell fails so that `%env` sets it in
 * a running kernel; a value that is not a boolean word counts as the one read
 * at start-up (which warned about it). */
static int keep_frames(void)
{
    int b = oc_parse_bool(oc_env("OUTOFCUDA_OOM_KEEP_FRAMES"));
    return b >= 0 ? b : oc_config_get()->oom_keep_frames;
}

/* A Ctrl-C (or exit()) set aside while the handler ran, shown as IPython's
 * showtraceback shows one during its display: raised, or re-sent as the
 * handler returns, it would reach IPython's catch-all, which unregisters it. */
static void show_interrupt(PyObject *shell)
{
    char line[300];
    PyObject *taken = oc_interrupt_take();
    PyObject *text = taken ? PyObject_CallMethod(shell, "get_exception_only", "(O)", taken) : NULL;
    if (text != NULL)
        oc_stderr_printf("\n%s\n", oc_utf8(text, line, sizeof line));
    OC_CLEAR();
    Py_XDECREF(text);
    Py_XDECREF(taken);
}

/* The custom exception handler: (shell, etype, value, tb, tb_offset=None),
 * called by IPython for torch's OOM type only. Returns None: IPython adds
 * nothing of its own. A failing showtraceback is IPython's to report (its
 * wrapper then shows the original traceback). A Ctrl-C stops what is left
 * of the handler's work and is shown, never raised (show_interrupt). */
static PyObject *py_ipython_handler(PyObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"shell", "etype", "value", "tb", "tb_offset", NULL};
    PyObject *shell, *type, *value, *tb, *offset = Py_None, *r;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOO|O:outofcuda_ipython_handler", kwlist, &shell,
                                     &type, &value, &tb, &offset))
        return NULL;
    /* showtraceback(exc_tuple, filename, tb_offset): IPython's order */
    r = PyObject_CallMethod(shell, "showtraceback", "(OOO)OO", type, value, tb, Py_None, offset);
    if (r == NULL && !PyErr_ExceptionMatches(PyExc_KeyboardInterrupt) &&
        !PyErr_ExceptionMatches(PyExc_SystemExit))
        return NULL;
    Py_XDECREF(r);
    OC_CLEAR(); /* an interrupt: set aside */
    if (is_oom(type)) {
        /* Decided before the report says it: a Ctrl-C during the report does
         * not leave it saying "released" of frames still held. */
        oom_frames frames = keep_frames()            ? FRAMES_KEPT
                            : oc_interrupt_waiting() ? FRAMES_INTERRUPTED
                                                     : FRAMES_RELEASED;
        ipython_reported = value;
        print_report(value, frames);
        if (frames == FRAMES_RELEASED)
            release_cell(value, tb);
        if (!oc_interrupt_waiting())
            oom_relief();
    }
    show_interrupt(shell);
    Py_RETURN_NONE;
}

OC_EDGE_KEYWORDS(py_ipython_handler)
static PyMethodDef ipython_handler_def = OC_METHOD(
    "outofcuda_ipython_handler", py_ipython_handler,
    "outofcuda's handler of a CUDA OOM in an IPython cell: IPython's traceback, the report, "
    "then the failed cell's memory back.");

/* atexit, registered with the handler. `ipython script.py` runs the file
 * outside any cell (safe_execfile): IPython shows an uncaught exception with
 * showtraceback and exits, and no custom handler sees it. An OOM shown that
 * way and not reported by the handler gets its report here, after IPython's
 * traceback as a cell's does. Never raises. */
static PyObject *py_ipython_at_exit(PyObject *self, PyObject *unused)
{
    PyObject *value = PySys_GetObject("last_value");
    (void)self;
    (void)unused;
    if (value == NULL || value == Py_None || value == ipython_reported)
        Py_RETURN_NONE;
    Py_INCREF(value);
    if (is_oom((PyObject *)Py_TYPE(value)))
        print_report(value, FRAMES_NOT_A_CELL);
    Py_DECREF(value);
    Py_RETURN_NONE;
}

static int ipython_at_exit_registered;
OC_EDGE_NOARGS(py_ipython_at_exit)
static PyMethodDef ipython_at_exit_def =
    OC_METHOD("outofcuda_ipython_at_exit", py_ipython_at_exit,
              "outofcuda's report of an OOM IPython showed outside a cell (ipython script.py).");

/* The running IPython shell (new ref), or NULL: IPython's own get_ipython,
 * asked only where IPython is imported already. */
static PyObject *ipython_shell(void)
{
    PyObject *mod = oc_sys_module("IPython.core.getipython");
    PyObject *shell = mod ? oc_call_quiet(mod, "get_ipython", NULL, NULL) : NULL;
    Py_XDECREF(mod);
    if (shell == Py_None)
        Py_CLEAR(shell);
    return shell;
}

/* Sets the handler on the running IPython shell once per shell, unless the
 * shell has a custom exception handler already (there is one per shell: the
 * user's stays). Called when CUDA initialises and when the observer sees an
 * OOM, for a shell started after CUDA (IPython.embed()). */
static void ipython_install(void)
{
    PyObject *shell = ipython_shell(), *decided, *custom = NULL, *fn = NULL, *types = NULL;
    PyObject *r = NULL, *custom_tb;
    Py_ssize_t n;
    if (shell == NULL) {
        if (ipython_decided == NULL)
            ipython_state = "no_shell";
        return;
    }
    decided = ipython_decided ? PyObject_CallObject(ipython_decided, NULL) : NULL;
    OC_CLEAR();
    Py_XDECREF(decided);
    if (decided == shell) {
        Py_DECREF(shell);
        return;
    }
    custom = PyObject_GetAttrString(shell, "custom_exceptions");
    n = custom != NULL && PyTuple_Check(custom) ? PyTuple_Size(custom) : -1;
    if (n > 0) {
        ipython_state = "user_handler_kept";
    } else if (n == 0 && oom.type != NULL) {
        fn = PyCFunction_NewEx(&ipython_handler_def, NULL, NULL);
        types = fn ? PyTuple_Pack(1, oom.type) : NULL;
        r = types ? PyObject_CallMethod(shell, "set_custom_exc", "OO", types, fn) : NULL;
        ipython_state = r != NULL ? "set" : "failed";
        if (r != NULL && oc_register_at_exit(&ipython_at_exit_def, &ipython_at_exit_registered) < 0)
            OC_CLEAR(); /* the shell's handler stands; only ipython script.py's report is lost */
        custom_tb = r ? PyObject_GetAttrString(shell, "CustomTB") : NULL;
        Py_XDECREF(ipython_custom_tb);
        ipython_custom_tb = custom_tb ? PyWeakref_NewRef(custom_tb, NULL) : NULL;
        Py_XDECREF(custom_tb);
    } else {
        ipython_state = "failed";
    }
    OC_CLEAR();
    Py_XDECREF(r);
    Py_XDECREF(types);
    Py_XDECREF(fn);
    Py_XDECREF(custom);
    Py_XDECREF(ipython_decided);
    ipython_decided = PyWeakref_NewRef(shell, NULL);
    OC_CLEAR();
    Py_DECREF(shell);
}

/* What was decided for IPython, and for "set" whether the shell's handler
 * is still ours, read from the shell when status() asks: a program that calls
 * set_custom_exc replaces it, and so does IPython after a handler raised. */
const char *oc_oom_ipython(void)
{
    PyObject *mine, *custom;
    int ours;
    if (strcmp(ipython_state, "set") != 0 || ipython_custom_tb == NULL)
        return ipython_state;
    mine = PyObject_CallObject(ipython_custom_tb, NULL); /* None once the shell let it go */
    custom = mine ? oc_getattr_chain(mine, "__self__.CustomTB") : NULL;
    ours = mine == NULL || custom == mine;
    OC_CLEAR();
    Py_XDECREF(custom);
    Py_XDECREF(mine);
    return ours ? ipython_state : "replaced";
}

/* The handler's record: queued at import, applied once its hooks are set
 * when CUDA initialises; `hooks` (static text) says which hooks are set. */
static void record_status(oc_rec_state state, const char *hooks)
{
    char observer[400];
    const char *none = oom.observer_state ? NULL : oom.observer_none;
    oc_record_set(OC_OPT_OOM, state, OC_CODE_AT_CUDA_INIT,
                  "once CUDA initialises, on a CUDA OOM: record the figures (observer), print a "
                  "report and ranked actions before the traceback of an uncaught one, then empty "
                  "the cache");
    snprintf(observer, sizeof observer, "%s%s%s", oom.observer_state ? oom.observer_state : "none",
             none ? ": " : "", none ? none : "");
    oc_record_oom(hooks, observer, oom.snapshot_path);
}

/* Sets `name` (an attribute of `owner`) to a new hook made from `def`,
 * keeping the current one in *prev to chain to. Returns 1 when set. */
static int chain_hook(PyObject *owner, const char *name, PyMethodDef *def, PyObject **prev)
{
    PyObject *current = PyObject_GetAttrString(owner, name);
    PyObject *hook = current ? PyCFunction_NewEx(def, NULL, NULL) : NULL;
    if (hook == NULL || PyObject_SetAttrString(owner, name, hook) < 0) {
        Py_XDECREF(hook);
        Py_XDECREF(current);
        OC_CLEAR();
        return 0;
    }
    Py_DECREF(hook);
    *prev = current;
    return 1;
}

/* Runs once, at CUDA initialisation (py_at_cuda_init). A hook the program set
 * earlier is chained, not replaced: it still receives every exception with
 * the same arguments, after the report. sys.excepthook is left alone while an
 * interactive console built on the `code` module runs (it sets sys.ps1): its
 * showtraceback writes through the console only while sys.excepthook is
 * sys.__excepthook__, so any other hook would take its output away. */
static void install_hooks(void)
{
    int sys_set = 0, thread_set = 0, console = PySys_GetObject("ps1") != NULL;
    PyObject *sys = PyImport_ImportModule("sys"), *threading;
    if (sys != NULL && !console)
        sys_set = chain_hook(sys, "excepthook", &sys_hook_def, &oom.prev_sys_hook);
    /* threading is imported by torch already; this only looks it up. */
    threading = PyImport_ImportModule("threading");
    if (threading != NULL)
        thread_set = chain_hook(threading, "excepthook", &thread_hook_def, &oom.prev_thread_hook);
    OC_CLEAR();
    Py_XDECREF(threading);
    Py_XDECREF(sys);
    ipython_install();
    record_status(OC_REC_APPLIED,
                  sys_set && thread_set ? "sys.excepthook + threading.excepthook"
                  : thread_set
                      ? (console ? "threading.excepthook (sys.excepthook left to the "
                                   "interactive console)"
                                 : "threading.excepthook (sys.excepthook could not be set)")
                  : sys_set ? "sys.excepthook (threading.excepthook could not be set)"
                            : "none: the exception hooks could not be set");
}

/* torch's OOM observer: (device, alloc, device_limit, device_free). Runs in
 * the allocating thread after the allocator dropped its lock and before the
 * error is raised, so the figures are those of the failure. Raises no error
 * of its own: an exception here would replace the OutOfMemoryError. A Ctrl-C
 * or exit() that arrives meanwhile (a long snapshot dump) is the program's:
 * the edge raises it, and torch's observer wrapper carries it out of the
 * allocation in the OutOfMemoryError's place, as it does for any observer
 * that raises. */
static PyObject *py_oom_observer(PyObject *self, PyObject *args)
{
    /* Gathered apart and published whole: the calls into torch let other
     * threads run, and their OOMs' observers publish theirs meanwhile. */
    oc_oom_seen now, *slot;
    PyObject *torch, *cuda, *old, *type, *value, *tb;
    (void)self;
    memset(&now, 0, sizeof now);
    PyErr_Fetch(&type, &value, &tb);
    if (!PyArg_ParseTuple(args, "lKKK", &now.device, &now.request, &now.limit, &now.device_free)) {
        OC_CLEAR();
        goto done;
    }
    oc_summary_note_oom();
    now.when = (double)time(NULL);
    torch = oc_sys_module("torch");
    cuda = torch ? PyObject_GetAttrString(torch, "cuda") : NULL;
    now.stats = cuda ? PyObject_CallMethod(cuda, "memory_stats", "l", now.device) : NULL;
    OC_CLEAR();
    now.autocast = torch ? autocast_enabled(torch) : -1;
    if (torch && oom.snapshot_path[0])
        dump_snapshot(torch, &now);
    Py_XDECREF(cuda);
    Py_XDECREF(torch);
    /* No call into Python from here to the copy. */
    now.seq = oom.seen[oom.newest].seq + 1;
    oom.newest = (int)((unsigned long)now.device % OOMS_KEPT);
    slot = &oom.seen[oom.newest];
    old = slot->stats;
    *slot = now;
    Py_XDECREF(old);
    /* A shell started after CUDA (IPython.embed()) gets the handler before
     * the OOM reaches it. */
    ipython_install();
done:
    OC_CLEAR();
    PyErr_Restore(type, value, tb);
    Py_RETURN_NONE;
}

OC_EDGE_VARARGS(py_oom_observer)
static PyMethodDef observer_def = OC_METHOD("outofcuda_oom_observer", py_oom_observer,
                                            "outofcuda's CUDA OOM observer (records the figures).");

/* Step of bridge.c's one CUDA-init callback (its rules apply, and it
 * completes at most once: a second observer or our own hook chained behind
 * itself would print every report twice). An interrupted run stops before
 * the hooks and runs again; an observer it attached stays attached. torch
 * 2.0 crashed when the observer was attached before CUDA initialised, hence
 * the deferral. */
void oc_oom_at_cuda_init(PyObject *torch)
{
    PyObject *attach = NULL, *obs = NULL, *r = NULL;
    int attached = oom.observer_state != NULL && strcmp(oom.observer_state, "attached") == 0;
    if (!attached && oom.snapshot_path[0] && start_history(torch) < 0) {
        char msg[400];
        if (take_error(msg, sizeof msg,
                       "OUTOFCUDA_OOM_SNAPSHOT: recording the allocator history "
                       "failed; no snapshot will be written"))
            return; /* an interrupt, set aside: the step runs again */
        oom.snapshot_path[0] = '\0';
        oc_warn(msg);
    }
    attach = attached ? NULL : oc_getattr_chain(torch, "_C._cuda_attach_out_of_memory_observer");
    obs = attach ? PyCFunction_NewEx(&observer_def, NULL, NULL) : NULL;
    r = obs ? PyObject_CallFunctionObjArgs(attach, obs, NULL) : NULL;
    /* attached (by an interrupted run) stays; an interrupt is set aside by
     * OC_CLEAR and the step runs again */
    if (r == NULL && !attached && !PyErr_ExceptionMatches(PyExc_KeyboardInterrupt) &&
        !PyErr_ExceptionMatches(PyExc_SystemExit)) {
        oc_set_error("attaching the CUDA OOM observer");
        oom.observer_state = NULL;
        oom.observer_none = "attaching it at CUDA initialisation failed";
    } else if (r != NULL) {
        oom.observer_state = "attached";
    }
    OC_CLEAR();
    Py_XDECREF(r);
    Py_XDECREF(obs);
    Py_XDECREF(attach);
    if (!oc_interrupt_waiting())
        install_hooks();
}

void oc_oom_install(PyObject *torch, const char *no_queue)
{
    PyObject *attach;
    oom.type = oc_getattr_chain(torch, "cuda.OutOfMemoryError");
    if (oom.type == NULL) {
        OC_CLEAR();
        oc_record_set(OC_OPT_OOM, OC_REC_SKIPPED, OC_CODE_NO_OOM_TYPE,
                      "this torch has no torch.cuda.OutOfMemoryError");
        return;
    }
    read_snapshot_env();
    attach = oc_getattr_chain(torch, "_C._cuda_attach_out_of_memory_observer");
    OC_CLEAR();
    /* Every CUDA (and ROCm) build has the observer; a CPU-only build has no
     * CUDA to report on. */
    oom.observer_state = attach == NULL || no_queue ? NULL : "attached when CUDA initialises";
    oom.observer_none = attach == NULL ? "this torch build has no CUDA OOM observer" : no_queue;
    Py_XDECREF(attach);
    if (oom.observer_state == NULL) {
        if (oom.snapshot_path[0]) {
            char msg[OC_WARN_LEN];
            snprintf(msg, sizeof msg,
                     "outofcuda: OUTOFCUDA_OOM_SNAPSHOT is set but no snapshot "
                     "can be written (%s)",
                     oom.observer_none);
            oom.snapshot_path[0] = '\0';
            oc_warn(msg);
        }
        /* Nothing will ever run at CUDA initialisation: Python's exception
         * hooks stay its own for the life of the process. */
        if (attach == NULL)
            oc_record_set(OC_OPT_OOM, OC_REC_SKIPPED, OC_CODE_NO_OBSERVER,
                          "CPU-only build of torch (no CUDA OOM observer): no CUDA to report on, "
                          "Python's exception hooks left alone");
        else
            oc_record_set(OC_OPT_OOM, OC_REC_SKIPPED, OC_CODE_NO_QUEUE,
                          "%s: Python's exception hooks left alone", oom.observer_none);
        return;
    }
    oc_cuda_step_arm(OC_STEP_OOM);
    record_status(OC_REC_QUEUED, "installed when CUDA initialises");
}

OC_EDGE_O(py_is_oom)
OC_EDGE_KEYWORDS(py_oom_record)
OC_EDGE_O(py_oom_note)
OC_EDGE_NOARGS(py_oom_last)
OC_EDGE_O(py_oom_format)
OC_EDGE_KEYWORDS(py_oom_advice)
OC_EDGE_NOARGS(py_testing_reports_built)

PyMethodDef oc_oom_methods[] = {
    OC_METHOD(
        "_is_oom", py_is_oom,
        "_is_oom(exc, /)\n--\n\nexc means the GPU ran out of memory: torch's OOM type, or the "
        "RuntimeError text older paths raise."),
    OC_METHOD("_oom_record", py_oom_record,
              "_oom_record(exc=None, exhausted=False, refresh=False)\n--\n\nThe report of exc "
              "(None: the observer's last OOM): the one it carries unless refresh, else built "
              "now, kept for last_oom() and attached to exc as outofcuda_report."),
    OC_METHOD("_oom_note", py_oom_note,
              "_oom_note(exc, /)\n--\n\nAn OOM a retry may survive: its report is built if "
              "last_oom() asks."),
    OC_METHOD("_oom_last", py_oom_last,
              "_oom_last()\n--\n\nThe report of the last CUDA OOM in this process, or None."),
    OC_METHOD("_oom_format", py_oom_format,
              "_oom_format(report, /)\n--\n\nThe report's text, as printed before the traceback "
              "of an uncaught OOM."),
    OC_METHOD(
        "_oom_advice", py_oom_advice,
        "_oom_advice(**figures)\n--\n\nRanked actions (list of str) that fit an OOM's figures."),
    OC_METHOD(
        "_oom_observer", py_oom_observer,
        "_oom_observer(device, alloc, device_limit, device_free, /)\n--\n\nThe callable outofcuda "
        "attaches with torch._C._cuda_attach_out_of_memory_observer."),
    {NULL, NULL, 0, NULL},
};

/* Behind the test door (_outofcuda._testing, module.c). */
PyMethodDef oc_oom_testing_methods[] = {
    OC_METHOD("oom_reports_built", py_testing_reports_built,
              "oom_reports_built()\n--\n\nReports built in this process."),
    {NULL, NULL, 0, NULL},
};
