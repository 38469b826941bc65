/* oc.h - the one header every outofcuda C file includes.
 *
 * Two extensions. The boot (outofcuda_hook, boot.c alone) is what the
 * start-up hook loads in every process; the engine (_outofcuda, every other
 * file) is loaded by the boot on `import torch`. Read the files in the order
 * the data flows, each calling only files below it:
 *   boot.c     the finder on sys.meta_path; loads the engine for torch
 *   module.c   the engine's module definition, install(), config()
 *   watcher.c  torch's spec and the loader proxy around its import
 *   bridge.c   what happens when torch has imported: the optimisations,
 *              and the one callback queued for CUDA initialisation
 *   report.c   status dict (the IPython handler read from oom.c) and the verbose table
 *   oom.c      out-of-memory handler and report
 *   monitor.c  the native watchdog thread behind MemoryMonitor
 *   facts.c    verdicts the Python layer asks for instead of parsing again
 *   summary.c  OUTOFCUDA_SUMMARY: input-wait and utilisation sampler, at-exit block
 *   api.c      decisions behind the Python API
 *   knownbugs.c the known-bugs table applied: decided at import, at CUDA's
 *              start and from NVML; the steers, status, the summary's lines
 *   frameworks.c packages that own GPU memory (vLLM, SGLang, ...): table, detection,
 *              and the one outofcuda left GPU memory to
 *   platform.c machines where a default cannot work (expandable segments on WSL)
 *   thread.c   native threads: spawned with signals blocked, monotonic waits,
 *              fork ownership, bounded joins (monitor.c and summary.c)
 *   common.c   the shared ground: warnings and the error, the configuration,
 *              the CUDA-init steps armed, interrupts set aside, small helpers
 *   record.c   the typed record of every optimisation (pure C, no Python)
 *   advice.c   ranked advice: OOM actions and summary hints (pure C, no Python)
 *   nvml.c     NVML loaded with dlopen at run time
 *   config.c   OUTOFCUDA_* environment -> oc_config (pure C, no Python), and the
 *              one escape of outside text for terminals
 *   kbtable.c  the known-bugs table and its lookup (pure C, no Python)
 *   allocconf.c allocator-string parse and merge (pure C, no Python)
 *   settings.c the table of every environment variable read, and oc_env()
 * (tests/test_static.py holds this order against the calls in the code)
 * (below: which file owns each shared function; the pure C part, which test
 * drivers and fuzzers include with OC_PURE_C, is oc_core.h, the edge oc_edge.h)
 */
#ifndef OC_H
#define OC_H

#define OC_VERSION "0.3.0"

/* The two extensions: the boot (boot.c alone) that the start-up hook imports,
 * and the engine (every other file), loaded by the boot on `import torch`. */
#define OC_BOOT_NAME "outofcuda_hook"
#define OC_ENGINE_NAME "_outofcuda"
#define OC_ENGINE_FIND_SPEC "_find_torch_spec" /* engine function the boot's finder calls */
#define OC_ENGINE_INSTALL "install"            /* engine function for a torch already there */

#include "oc_core.h"

#ifndef OC_PURE_C
/* ---- Python part ---- */
#ifndef Py_LIMITED_API
#error "outofcuda builds against the Limited API only"
#endif
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <elf.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

/* OC_ABI3T: the experimental build for PEP 803's abi3t (3.15+, one file for
 * the GIL-enabled and the free-threaded interpreter). PyObject is opaque
 * there, so an object's own fields live in its type's data (a negative
 * basic size) and are reached through PyObject_GetTypeData. */
#ifdef OC_ABI3T
#define OC_OBJECT_HEAD
#define OC_FIELDS(type, obj) ((type *)PyObject_GetTypeData((obj), Py_TYPE(obj)))
#define OC_BASICSIZE(type) (-(int)sizeof(type))
/* The slots both export hooks end with: the ABI they were built for, and
 * the GIL they rely on (the free-threaded interpreter never reads it: the
 * hooks refuse there, through oc_export). */
#define OC_EXPORT_COMMON_SLOTS(abi)                                                                \
    PySlot_DATA(Py_mod_abi, &(abi)), PySlot_DATA(Py_mod_gil, Py_MOD_GIL_USED)
#else
#define OC_OBJECT_HEAD PyObject_HEAD
#define OC_FIELDS(type, obj) ((type *)(obj))
#define OC_BASICSIZE(type) ((int)sizeof(type))
#endif

/* Both extensions are built for the GIL-enabled ABI. A free-threaded
 * interpreter (sys.abiflags holds "t": 3.13t, 3.14t, 3.15t) lays objects out
 * differently and would re-enable the GIL for the whole process to load a
 * module that does not declare Py_mod_gil, so each init refuses there
 * before it touches an object. Hence only calls into the interpreter here,
 * no inline reference counting (Py_DecRef is a function), and a bare
 * PyErr_Clear: neither extension's trace may run before the check. */
#define OC_FREE_THREADED_REFUSAL                                                                   \
    "outofcuda stays out of free-threaded Python: it is built for the GIL-enabled interpreter"
static inline int oc_free_threaded_interpreter(void)
{
    PyObject *flags = PySys_GetObject("abiflags"); /* borrowed; absent on older Windows */
    PyObject *t;
    int r = 0;
    if (flags == NULL)
        return 0;
    t = PyUnicode_FromString("t");
    if (t != NULL)
        r = PyUnicode_Contains(flags, t);
    Py_DecRef(t);
    if (r < 0)
        PyErr_Clear(); /* flags that are not a str mark no free-threaded build */
    return r == 1;
}

#ifdef OC_ABI3T
/* An export hook's answer: its slots, or NULL with the refusal. */
static inline PySlot *oc_export(PySlot *slots)
{
    if (oc_free_threaded_interpreter()) {
        PyErr_SetString(PyExc_ImportError, OC_FREE_THREADED_REFUSAL);
        return NULL;
    }
    return slots;
}
#endif

/* The steps of the one callback on torch's lazy-init queue (bridge.c), in
 * the order it runs them, each with the name status()["cuda_init"] gives it. */
#define OC_CUDA_STEPS(X)                                                                           \
    X(FRAMEWORK, "framework")                                                                      \
    X(TF32, "tf32")                                                                                \
    X(FRACTION, "memory_fraction")                                                                 \
    X(KNOWN_BUGS, "known_bugs")                                                                    \
    X(OOM, "oom_handler")                                                                          \
    X(SUMMARY, "summary")
#define OC_STEP_ENUM(id, name) OC_STEP_##id,
typedef enum { OC_CUDA_STEPS(OC_STEP_ENUM) OC_STEP_COUNT } oc_cuda_step;
#undef OC_STEP_ENUM

/* The engine's state. Each file keeps its own, in file-level statics beside
 * the code that uses it, and what another file needs is behind a function of
 * the lower of the two (a file above tells a file below, or asks it):
 * tests/test_static.py holds that no file names another's variable. The
 * state is process-wide by nature, not per module object: the hook fires
 * once per process whatever imports torch, CUDA starts once per process, and
 * the callbacks torch and the interpreter call (the lazy-init queue, the OOM
 * observer, the exception hooks, atexit) receive no module to find
 * per-module state through. Every such variable is read and written with the
 * GIL held; the native threads (monitor.c's watchdogs, summary.c's sampler)
 * run without it and guard what they share with their own locks, and NVML
 * (nvml.c) is loaded once behind pthread_once. Function-local statics are
 * scratch buffers for one call under the GIL, or a variable read once
 * (OUTOFCUDA_DEBUG). */

/* What is armed for CUDA's start (common.c): one bit per oc_cuda_step, set
 * at import by the file that owns the step, cleared by bridge.c's callback as
 * each step completes (an interrupted step stays armed and runs again when
 * torch runs its queue again), and cleared whole when the callback cannot be
 * queued. */
void oc_cuda_step_arm(oc_cuda_step step); /* the callback runs it when CUDA starts */
unsigned oc_cuda_steps_armed(void);       /* bit i: step i armed */
void oc_cuda_steps_set_armed(unsigned steps);
/* A run of the step ended: completed (done, no longer armed), or
 * interrupted (it stays as the caller left the armed steps). */
void oc_cuda_step_ran(oc_cuda_step step, int interrupted);
/* Where a step stands, with the word status()["cuda_init"] gives it: off
 * (nothing to do when CUDA starts), queued (armed, waiting for CUDA's
 * start), interrupted (its last run was; it runs again when torch next runs
 * its queue), done (it ran to the end). */
#define OC_STEP_STATES(X)                                                                          \
    X(OFF, "off")                                                                                  \
    X(QUEUED, "queued")                                                                            \
    X(INTERRUPTED, "interrupted")                                                                  \
    X(DONE, "done")
#define OC_STEP_STATE_ENUM(id, name) OC_STEP_IS_##id,
typedef enum { OC_STEP_STATES(OC_STEP_STATE_ENUM) OC_STEP_STATE_COUNT } oc_step_state;
#undef OC_STEP_STATE_ENUM
oc_step_state oc_cuda_step_state(oc_cuda_step step);

/* common.c */
const oc_config *oc_config_get(void); /* loads once, emits warnings */
void oc_warn(const char *msg);        /* one warning; never raises */
/* The configuration when it has been loaded, else NULL (loads nothing). */
const oc_config *oc_config_if_loaded(void);
/* Writes through sys.stderr only: nothing when it is None or closed. */
void oc_stderr_write(const char *text);
/* text with the rank label before each line starting in it (malloc'd), or
 * NULL where there is no label; *at_start carries "at a line's start". */
char *oc_labelled(const char *text, int *at_start);
void oc_stderr_printf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void oc_set_error(const char *where); /* keeps the current exception text */
/* The first error oc_set_error kept (a str, borrowed), or NULL. */
PyObject *oc_error(void);
/* Swallows the current exception, leaving a trace under OUTOFCUDA_DEBUG=1
 * that names why (NULL: an error given up); a KeyboardInterrupt or
 * SystemExit is set aside instead. Every exception the engine swallows goes
 * through one of the three macros, each saying why (tests/test_static.py
 * holds it): */
void oc_clear_at(const char *file, int line, const char *func, const char *why);
/* an error outofcuda gives up on so that the program goes on */
#define OC_CLEAR() oc_clear_at(__FILE__, __LINE__, __func__, NULL)
/* absence is the expected answer: a missing attribute, a key already gone */
#define OC_CLEAR_ABSENT() oc_clear_at(__FILE__, __LINE__, __func__, "absent")
/* what it clears is already recorded or reported (a step's reason, stderr) */
#define OC_CLEAR_RECORDED() oc_clear_at(__FILE__, __LINE__, __func__, "recorded")
/* Raises the KeyboardInterrupt or SystemExit that oc_clear_at or
 * oc_set_error set aside in this thread: -1 with it set (it replaces an
 * exception already set), else 0. The edge's leave step (below). */
int oc_raise_interrupt(void);
/* 1 when this thread has a KeyboardInterrupt or SystemExit set aside. */
int oc_interrupt_waiting(void);
/* The interrupt set aside in this thread, taken out of the thread's state
 * so that no edge raises it (new reference), or NULL when none waits. */
PyObject *oc_interrupt_take(void);
/* Sets what oc_interrupt_take gave aside again in this thread (the reference
 * is stolen), for the next edge to raise: 0; or, where it cannot be kept,
 * -1 with it raised now. */
int oc_interrupt_put_back(PyObject *taken);

#include "oc_edge.h"

/* atexit.register() of def's function, once per process for each
 * *registered flag (a forked child inherits both). Returns 0, or -1 with an
 * exception. */
int oc_register_at_exit(PyMethodDef *def, int *registered);
int oc_disabled_by_env(void);
/* What every row says under OUTOFCUDA_DISABLE (the boot says it too). */
#define OC_DISABLED_TEXT "off by OUTOFCUDA_DISABLE: torch imports as without outofcuda"

/* watcher.c */
int oc_watcher_init(PyObject *module); /* from module_exec */
int oc_watcher_install(void);          /* 0 ok, -1 with exception */
int oc_watcher_fire_if_imported(void);
extern PyMethodDef oc_watcher_methods[];

/* bridge.c: called with torch imported. Never raises. */
void oc_bridge_before_torch(PyObject *spec);
void oc_bridge_after_torch(PyObject *torch);
/* An `import torch` failed: restores the user's allocator variable and lets
 * the next attempt prepare afresh (it may load another copy of torch). */
void oc_bridge_import_failed(void);
/* 1 when oc_bridge_before_torch ran for this import attempt. */
int oc_bridge_prepared(void);

/* frameworks.c: packages that size GPU memory and choose code paths from
 * the allocator variable themselves; outofcuda leaves both to them. */
typedef struct {
    const char *package; /* its top-level module */
    const char *name;    /* as people write it */
    const char *owns;    /* what it manages itself */
    const char *evidence;
} oc_framework;
/* The name of the framework this process runs under, or NULL: one whose package is in
 * sys.modules (also while its own import is in progress, as when it imports
 * torch), or torch_memory_saver's library preloaded through LD_PRELOAD
 * (matched by its file name). A package
 * merely installed is not in use. Fills why with what was seen and why
 * outofcuda steps back. Never raises. */
const char *oc_framework_in_use(char *why, size_t whysz);
/* The page that shows framework `name` owns GPU memory, or NULL. */
const char *oc_framework_evidence(const char *name);
/* What outofcuda decided about frameworks at torch's import (at[0]) and
 * when CUDA started (at[1]): OC_FW_UNSET until then (status()'s words in
 * report.c). */
typedef enum { OC_FW_UNSET, OC_FW_NONE, OC_FW_LEFT_TO, OC_FW_OVERRIDE, OC_FW_GONE } oc_fw_code;
typedef struct {
    char left_to[32]; /* the one outofcuda left GPU memory to, "" none */
    char why[600];    /* why it owns GPU memory */
    oc_fw_code at[2];
} oc_framework_choice;
const oc_framework_choice *oc_framework_choice_get(void);
/* GPU memory left to the framework name (why: why it owns it), or to none
 * (NULL: the one it was left to is gone; why is kept). */
void oc_framework_leave_to(const char *name, const char *why);
/* What was decided at torch's import (when 0) or when CUDA started (1). */
void oc_framework_decided(int when, oc_fw_code code);

/* platform.c: where one of outofcuda's defaults cannot work. The allocator
 * defaults for this machine: `defaults` itself, or (when they are
 * outofcuda's own, are_outofcudas, and expandable segments cannot work here)
 * a copy in out without expandable_segments. */
const char *oc_platform_alloc_defaults(const char *defaults, int are_outofcudas, char *out,
                                       size_t outsz);
/* Why expandable segments cannot work here (WSL), so no advice names them;
 * NULL where they can. */
const char *oc_platform_no_expandable(void);
extern PyMethodDef oc_platform_methods[];
/* Behind the test door, _outofcuda._testing (module.c). */
extern PyMethodDef oc_platform_testing_methods[];

/* report.c */
void oc_report_verbose(void);
/* What status() shows of the hook, told by the files that decide it: the
 * finder is on sys.meta_path; the torch callback ran; torch's __version__
 * as str (the report keeps its own reference; NULL: unknown). */
void oc_report_hook_installed(void);
int oc_report_hook_fired(void);     /* returns 1 when it had fired already */
int oc_report_hook_has_fired(void); /* the torch callback ran */
void oc_report_torch_version(PyObject *version);
/* 1 when cuBLAS may use TF32 for float32 matmuls now (torch's new precision
 * API where it has one, else the legacy flag), 0 when not, -1 unreadable. */
int oc_matmul_tf32(PyObject *c_mod);
extern PyMethodDef oc_report_methods[];

/* nvml.c */
typedef struct {
    char name[96];
    int cc_major, cc_minor;
    unsigned long long total, free, used;
    char uuid[96];
} oc_gpu_info;
int oc_nvml_available(char *why, size_t whysz);       /* 1 yes, 0 no (why filled) */
int oc_nvml_device_count(void);                       /* -1 when unavailable */
int oc_nvml_device_info(int index, oc_gpu_info *out); /* 0 ok, -1 */
typedef struct {
    unsigned int pid;
    unsigned long long used;
} oc_gpu_proc;
/* Every process NVML lists on GPU `index`, in *out (malloc'd, free() it);
 * count or -1. used is OC_NVML_NOT_AVAILABLE where the driver cannot tell. */
int oc_nvml_process_list(int index, oc_gpu_proc **out);
/* Sorts such a list most memory first, unknown sizes last, ties by pid. */
void oc_nvml_sort_procs(oc_gpu_proc *procs, int n);
#define OC_NVML_NOT_AVAILABLE 0xFFFFFFFFFFFFFFFFull
int oc_proc_name(unsigned int pid, char *buf, size_t sz); /* /proc name: 0, or -1 */
#define OC_NVML_MAX_DEVICES 64
/* NVML indices of the devices CUDA shows this process, in torch's order
 * (CUDA_VISIBLE_DEVICES as indices, GPU-UUID prefixes or MIG instances,
 * which map to their GPU). Count or -1. */
int oc_nvml_visible_map(int *map, int max);
int oc_nvml_index(int torch_index); /* NVML index of torch's cuda:N, or -1 */
int oc_nvml_min_visible_cc(void);   /* lowest major*10+minor of those, or -1 */
extern PyMethodDef oc_nvml_methods[];
/* Percent of the last sample period the GPU (gpu) and its memory bus (mem)
 * were busy, all processes together. 0 ok, -1 (no NVML or no such figure). */
int oc_nvml_utilization(int index, unsigned *gpu, unsigned *mem);

/* oom.c */
/* With torch imported: prepares the observer and hooks. no_queue is NULL when
 * bridge.c's CUDA-init callback is queued, else why not (a reason). Arms
 * oc_oom_at_cuda_init when it has work. Never raises. */
void oc_oom_install(PyObject *torch, const char *no_queue);
void oc_oom_at_cuda_init(PyObject *torch); /* a step of the CUDA-init callback */
/* What counts as a CUDA OOM: torch's type (torch.cuda.OutOfMemoryError or
 * torch.OutOfMemoryError, from the torch in sys.modules), or a plain
 * RuntimeError whose text older paths raise instead (cuBLAS workspace,
 * torch before 1.13; exc needed for the text). Never raises. */
typedef enum { OC_OOM_NONE, OC_OOM_TYPE, OC_OOM_TEXT } oc_oom_kind;
oc_oom_kind oc_oom_kind_of(PyObject *type, PyObject *exc);
const char *oc_oom_ipython(void); /* status()'s "ipython", read from the shell */
extern PyMethodDef oc_oom_methods[];
extern PyMethodDef oc_oom_testing_methods[]; /* the test door's (module.c) */

/* api.c */
extern PyMethodDef oc_api_methods[];
typedef struct {
    long long allocated, reserved, peak_allocated;
} oc_torch_mem;
/* 1 filled, 0 when torch has not initialised CUDA (nothing is asked then). */
int oc_api_torch_stats(int torch_index, oc_torch_mem *out);
/* gc.collect (if configured) + empty_cache; 0 ok, -1 with an exception set. */
int oc_api_clear_cache(long long *released);
/* The CUDA autocast dtype ("bfloat16" or "float16"): OUTOFCUDA_AMP_DTYPE's,
 * or under auto the compute capability's (8.0 and up: bfloat16; the lowest
 * visible GPU's, from NVML); NULL when auto cannot know it. reason: why, in
 * words. */
const char *oc_amp_cuda_dtype(const oc_config *cfg, char *reason, size_t sz);
/* The num_workers smart_dataloader picks (OUTOFCUDA_NUM_WORKERS capped at the
 * usable cores); *cpus: those cores (affinity mask, cgroup quota). */
long oc_loader_suggestion(long *cpus);
/* The splits auto_microbatch made in this process. */
long long oc_api_microbatch_splits(void);

/* facts.c */
extern PyMethodDef oc_facts_methods[];

/* monitor.c */
extern PyMethodDef oc_monitor_methods[];
/* Behind the test door, _outofcuda._testing (module.c). */
extern PyMethodDef oc_monitor_testing_methods[];

/* small helpers (common.c) */
PyObject *oc_getattr_chain(PyObject *obj, const char *dotted);
/* The texts of n advice items as a new list of str, or NULL. */
PyObject *oc_advice_texts(const oc_advice_item *items, int n);
PyObject *oc_none_or_ll(long long x); /* x, or None when negative (unknown): new ref */
/* sys.modules[name] (new ref), or NULL with no exception: never imports. */
PyObject *oc_sys_module(const char *name);                      /* new ref or NULL, no exception */
int oc_call_bool(PyObject *owner, const char *name, int value); /* 1 called, 0 missing, -1 error */
/* owner.name() or, with a, owner.name(a, b): the result (new ref), or NULL
 * with the error swallowed (a missing attribute included), traced under
 * OUTOFCUDA_DEBUG at the caller's line. */
PyObject *oc_call_quiet_at(PyObject *owner, const char *name, const char *a, const char *b,
                           const char *file, int line, const char *func);
#define oc_call_quiet(owner, name, a, b)                                                           \
    oc_call_quiet_at(owner, name, a, b, __FILE__, __LINE__, __func__)
/* A copy of str into buf, cut where it does not fit between two characters. */
const char *oc_utf8(PyObject *str, char *buf, size_t sz);
/* Text appended to a buffer of cap bytes (buf NULL: none); what does not fit is cut. */
typedef struct {
    char *buf;
    size_t len, cap;
} oc_text;
void oc_appendf(oc_text *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* How many of the len bytes of UTF-8 at s fit in max bytes without cutting
 * a character in two. */
size_t oc_utf8_fit(const char *s, size_t len, size_t max);
/* An API argument that must be a str, as bytes (new ref) with surrogates
 * kept (surrogateescape: a path or a value from the environment), or NULL
 * with TypeError(message) when it is not a str. */
PyObject *oc_arg_bytes(PyObject *arg, const char *message);
/* The imported torch's release (oc_torch_version_number of its __version__);
 * 0 when it has none to read (errors swallowed). */
long oc_torch_version(PyObject *torch);
/* Hands `conf` to torch's runtime allocator setter (the CUDA one up to 2.9.x,
 * the accelerator one from 2.10): 1 done, 0 none, -1 raised (exception set). */
int oc_alloc_call_setter(PyObject *c_mod, const char *conf, const char **used);
/* A file to write later (OUTOFCUDA_OOM_SNAPSHOT, OUTOFCUDA_SUMMARY's .json):
 * its directory, as given, into dir (for messages), resolved now (the working
 * directory may change before the file is written), and the file's absolute
 * path into out. Returns 0; -1 when the directory does not exist; -2 when the
 * path does not fit out (out is "" on failure). */
int oc_resolve_file_path(const char *path, char *dir, size_t dirsz, char *out, size_t outsz);

/* knownbugs.c: decides what it can with torch imported (never reads the
 * cuDNN version: that loads cuDNN), and the rest from the CUDA-init callback,
 * where it also acts. Neither raises nor queues anything. at_import arms
 * the callback's step when it has work (no_queue: why there is no queue, or
 * NULL). */
void oc_known_bugs_at_import(PyObject *torch, const char *no_queue);
void oc_known_bugs_at_cuda_init(PyObject *torch);
PyObject *oc_known_bugs_status(void); /* new list, or NULL with an exception */
/* 1 when OUTOFCUDA_KNOWN_BUGS leaves row `id` on (the steer may act). */
int oc_known_bug_on(const char *id);
/* The exit summary's lines naming the rows that apply and that outofcuda
 * does not avoid, each line starting with prefix; returns the length. */
size_t oc_known_bugs_summary(char *buf, size_t sz, const char *prefix);
extern PyMethodDef oc_known_bugs_methods[];

/* thread.c: one native thread, its lock and its condition variable, owned
 * by the process that made them (pid). */
typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t wake; /* on CLOCK_MONOTONIC */
    pthread_t thread;
    pid_t pid;
} oc_thread;
/* Fresh lock and condition variable, owned by this process (also what a
 * copy inherited through fork() gets, never the parent's). */
void oc_thread_init(oc_thread *t);
void oc_thread_destroy(oc_thread *t);
int oc_thread_inherited(const oc_thread *t); /* 1: made by another process */
/* Starts fn(arg) with every signal blocked, named `name` where the system
 * allows (NULL: unnamed). Returns 0 or an errno. */
int oc_thread_start(oc_thread *t, void *(*fn)(void *), void *arg, const char *name);
/* Sets *stop_requested under t's lock and wakes the thread. */
void oc_thread_request_stop(oc_thread *t, int *stop_requested);
/* Now plus seconds and nanoseconds (clamped to 0..999999999) on
 * CLOCK_MONOTONIC, with no double round trip. */
struct timespec oc_thread_deadline(long long seconds, long nanoseconds);
/* With t's lock held: sleeps until *stop_requested is set or the deadline
 * passes (or the wait fails); returns with the lock held. */
void oc_thread_wait(oc_thread *t, const int *stop_requested, const struct timespec *deadline);
/* Joins thread, waiting at most limit_ms milliseconds where glibc can bound
 * the wait (0: no bound). Returns 1 when joined. Call without the GIL. */
int oc_thread_join(pthread_t thread, long limit_ms);
double oc_thread_now(void); /* CLOCK_MONOTONIC, in seconds */

/* summary.c: OUTOFCUDA_SUMMARY, what the GPU did, printed at exit */
/* What the summary says of torch and its allocator, as bridge.c read them. */
typedef struct {
    int cuda_build, hip_build; /* torch's build: why no GPU was sampled */
    int expandable;            /* the allocator string turns expandable segments on */
} oc_summary_torch;
/* With torch imported: starts the stack sampler when the summary is on, and
 * arms its CUDA-init step where cuda_queue says CUDA's start can be queued;
 * keeps *torch for the block at exit. */
void oc_summary_prepare(int cuda_queue, const oc_summary_torch *torch);
/* One more CUDA OOM torch's observer reported (oom.c), for the summary. */
void oc_summary_note_oom(void);
void oc_summary_at_cuda_init(void); /* a step of the CUDA-init callback */
extern PyMethodDef oc_summary_methods[];

/* 1 when the ELF file at path holds every byte its headers promise: each
 * segment the loader maps, and the section headers, which the linker writes
 * last. A partly written extension (an interrupted install, a full disk) fails
 * this: dlopen would map it past the end of the file, and the first touch of
 * a missing page kills the process with SIGBUS. */
#define OC_INCOMPLETE_FMT "%U is incomplete (a partly written file): reinstall outofcuda"
static inline int oc_elf_complete(const char *path)
{
    Elf64_Ehdr eh;
    Elf64_Phdr ph;
    struct stat st;
    int ok = 0, fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    if (fstat(fd, &st) == 0 && pread(fd, &eh, sizeof eh, 0) == (ssize_t)sizeof eh &&
        memcmp(eh.e_ident, ELFMAG, SELFMAG) == 0 && eh.e_ident[EI_CLASS] == ELFCLASS64 &&
        eh.e_phentsize == sizeof ph) {
        uint64_t size = (uint64_t)st.st_size;
        ok = eh.e_shoff + (uint64_t)eh.e_shnum * eh.e_shentsize <= size;
        for (unsigned i = 0; ok && i < eh.e_phnum; i++) {
            off_t at = (off_t)(eh.e_phoff + (uint64_t)i * sizeof ph);
            ok = pread(fd, &ph, sizeof ph, at) == (ssize_t)sizeof ph &&
                 (ph.p_type != PT_LOAD || ph.p_offset + ph.p_filesz <= size);
        }
    }
    close(fd);
    return ok;
}

/* Both extensions: the sibling extension `to`, loaded by path from the
 * directory of `self` (the module of the extension named `from`): never by
 * name, as the working directory may be on sys.path. `dir/from<suffix>` ->
 * `dir/to<suffix>`; not put in sys.modules. New reference, or NULL with an
 * exception. Here, inline, because the boot links nothing of the engine. */
static inline PyObject *oc_load_sibling(PyObject *self, const char *from, const char *to)
{
    PyObject *file = PyModule_GetFilenameObject(self), *name, *parts, *path = NULL;
    PyObject *util, *spec = NULL, *loader = NULL, *mod = NULL, *res = NULL;
    name = file != NULL ? PyUnicode_FromString(from) : NULL;
    parts = name != NULL ? PyUnicode_RSplit(file, name, 1) : NULL; /* at the last `from` */
    if (parts != NULL && PyList_Size(parts) == 2)
        path =
            PyUnicode_FromFormat("%U%s%U", PyList_GetItem(parts, 0), to, PyList_GetItem(parts, 1));
    else if (parts != NULL)
        PyErr_Format(PyExc_ImportError, "%U is not named %s*", file, from);
    Py_XDECREF(parts);
    Py_XDECREF(name);
    Py_XDECREF(file);
    if (path == NULL)
        return NULL;
    res = PyUnicode_EncodeFSDefault(path);
    if (res == NULL || !oc_elf_complete(PyBytes_AsString(res))) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ImportError, OC_INCOMPLETE_FMT, path);
        Py_XDECREF(res);
        Py_DECREF(path);
        return NULL;
    }
    Py_CLEAR(res);
    util = PyImport_ImportModule("importlib.util");
    if (util != NULL)
        spec = PyObject_CallMethod(util, "spec_from_file_location", "sO", to, path);
    if (spec == Py_None)
        PyErr_Format(PyExc_ImportError, "%U is not a loadable extension", path);
    else if (spec != NULL)
        mod = PyObject_CallMethod(util, "module_from_spec", "O", spec);
    loader = mod ? PyObject_GetAttrString(spec, "loader") : NULL;
    res = loader ? PyObject_CallMethod(loader, "exec_module", "O", mod) : NULL;
    if (res == NULL)
        Py_CLEAR(mod);
    Py_XDECREF(res);
    Py_XDECREF(loader);
    Py_XDECREF(spec);
    Py_XDECREF(util);
    Py_DECREF(path);
    return mod;
}

/* Behind the test door, _outofcuda._testing (module.c). */
extern PyMethodDef oc_summary_testing_methods[];
#endif /* OC_PURE_C */
#endif /* OC_H */
