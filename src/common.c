/* common.c - the shared ground under every engine file: warnings and the
 * recorded error, the configuration snapshot, what is armed for CUDA's start,
 * interrupts set aside, and small CPython helpers (sys.modules lookups,
 * attribute chains, UTF-8 copies). Nothing here calls up into the watcher,
 * the bridge or the features. */
#include "oc.h"

#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

extern char **environ;

/* The steps of the CUDA-init callback: armed at import by the file that owns
 * each step, run and marked by bridge.c's callback, shown by report.c; here,
 * below all of them. One bit per oc_cuda_step in each mask. */
static struct {
    unsigned armed;       /* runs when CUDA starts (an interrupted step stays armed) */
    unsigned done;        /* ran to the end */
    unsigned interrupted; /* its last run was interrupted */
} cuda_steps;

void oc_cuda_step_arm(oc_cuda_step step)
{
    cuda_steps.armed |= 1u << step;
}

unsigned oc_cuda_steps_armed(void)
{
    return cuda_steps.armed;
}

void oc_cuda_steps_set_armed(unsigned steps)
{
    cuda_steps.armed = steps;
}

void oc_cuda_step_ran(oc_cuda_step step, int interrupted)
{
    unsigned bit = 1u << step;
    if (interrupted) {
        cuda_steps.interrupted |= bit;
        return;
    }
    cuda_steps.armed &= ~bit;
    cuda_steps.interrupted &= ~bit;
    cuda_steps.done |= bit;
}

oc_step_state oc_cuda_step_state(oc_cuda_step step)
{
    unsigned bit = 1u << step;
    if (cuda_steps.done & bit)
        return OC_STEP_IS_DONE;
    if (!(cuda_steps.armed & bit))
        return OC_STEP_IS_OFF;
    return cuda_steps.interrupted & bit ? OC_STEP_IS_INTERRUPTED : OC_STEP_IS_QUEUED;
}

static const char *env_getenv(const char *name, void *ctx)
{
    (void)ctx;
    return oc_env(name);
}

int oc_disabled_by_env(void)
{
    return oc_parse_bool(oc_env("OUTOFCUDA_DISABLE")) == 1;
}

/* A KeyboardInterrupt or SystemExit that arrives while outofcuda runs torch's
 * or the program's code is the user's, not an error of outofcuda's: it is set
 * aside here, never swallowed, and raised again by oc_raise_interrupt at the
 * edge where control goes back to the program, in the thread it arrived in
 * (a SystemExit in a thread ends that thread, not the program). It waits in
 * the thread's own state (PyThreadState_GetDict(), as watcher.c's guard):
 * no table to fill, and no thread id that a later thread could reuse. */
static const char interrupt_key[] = "outofcuda.interrupt";

/* An exit outranks a Ctrl-C; between two of a kind the first stays. */
static int outranks(PyObject *value, PyObject *kept_value)
{
    return PyObject_IsInstance(value, PyExc_SystemExit) == 1 &&
           PyObject_IsInstance(kept_value, PyExc_SystemExit) != 1;
}

/* Keeps the interrupt (its tuple, borrowed) in the thread's state
 * (d, borrowed): 0, or -1 without room. Where one already waits, the one
 * that outranks the other is kept and the other becomes the end of its
 * __context__ chain, as an exception raised while another was handled: no
 * interrupt that reached outofcuda is lost, however many arrive. */
static int stash_interrupt(PyObject *d, PyObject *kept)
{
    PyObject *waiting = PyDict_GetItemString(d, interrupt_key); /* borrowed */
    PyObject *win = kept, *lose = waiting, *end, *next;
    int depth = 0;
    if (waiting != NULL && !outranks(PyTuple_GetItem(kept, 1), PyTuple_GetItem(waiting, 1))) {
        win = waiting;
        lose = kept;
    }
    lose = lose != NULL ? PyTuple_GetItem(lose, 1) : NULL;
    /* The chain's end: a bounded walk, since a chain may be a cycle. */
    end = PyTuple_GetItem(win, 1);
    while (lose != NULL && end != lose && PyExceptionInstance_Check(end) &&
           (next = PyException_GetContext(end)) != NULL && depth++ < 64) {
        Py_DECREF(next); /* still held by end */
        end = next;
    }
    if (lose != NULL && end != lose && PyExceptionInstance_Check(end) &&
        PyExceptionInstance_Check(lose)) {
        Py_INCREF(lose);
        PyException_SetContext(end, lose); /* steals */
    }
    return win == kept ? PyDict_SetItemString(d, interrupt_key, kept) : 0;
}

static int keep_interrupt(void)
{
    PyObject *d, *type, *value, *tb, *kept;
    if (!PyErr_ExceptionMatches(PyExc_KeyboardInterrupt) &&
        !PyErr_ExceptionMatches(PyExc_SystemExit))
        return 0;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL)
        PyException_SetTraceback(value, tb);
    d = PyThreadState_GetDict(); /* borrowed; NULL only without a thread state */
    kept =
        d != NULL ? Py_BuildValue("(OOO)", type, value ? value : Py_None, tb ? tb : Py_None) : NULL;
    if (kept == NULL || stash_interrupt(d, kept) < 0) {
        /* No memory to keep it: it stays the current exception, which the
         * caller then raises or clears as an error of its own. */
        Py_XDECREF(kept);
        PyErr_Restore(type, value, tb);
        return 0;
    }
    Py_DECREF(kept);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    return 1;
}

int oc_interrupt_waiting(void)
{
    PyObject *d = PyThreadState_GetDict();
    return d != NULL && PyDict_GetItemString(d, interrupt_key) != NULL;
}

PyObject *oc_interrupt_take(void)
{
    PyObject *d = PyThreadState_GetDict();
    PyObject *kept = d != NULL ? PyDict_GetItemString(d, interrupt_key) : NULL; /* borrowed */
    if (kept == NULL)
        return NULL;
    Py_INCREF(kept);
    (void)PyDict_DelItemString(d, interrupt_key); /* present: read above */
    return kept;
}

/* Raises what oc_interrupt_take gave (the reference is stolen): -1. */
static int interrupt_raise(PyObject *taken)
{
    PyObject *type = PyTuple_GetItem(taken, 0), *value = PyTuple_GetItem(taken, 1);
    PyObject *tb = PyTuple_GetItem(taken, 2);
    Py_XINCREF(type);
    if (value != Py_None)
        Py_XINCREF(value);
    if (tb != Py_None)
        Py_XINCREF(tb);
    Py_DECREF(taken);
    /* An exception already propagating (torch's own import error) gives way
     * to the interrupt, as it would without outofcuda. */
    PyErr_Restore(type, value != Py_None ? value : NULL, tb != Py_None ? tb : NULL);
    return -1;
}

int oc_interrupt_put_back(PyObject *taken)
{
    PyObject *d = PyThreadState_GetDict();
    if (d != NULL && stash_interrupt(d, taken) == 0) {
        Py_DECREF(taken);
        return 0;
    }
    return interrupt_raise(taken); /* no room to keep it: raised now, never lost */
}

int oc_raise_interrupt(void)
{
    PyObject *taken = oc_interrupt_take();
    return taken != NULL ? interrupt_raise(taken) : 0;
}

/* The edge's leave step for a function that returns an object (oc.h). */
PyObject *oc_leave(PyObject *result)
{
    if (oc_raise_interrupt() == 0)
        return result;
    Py_XDECREF(result);
    return NULL;
}

/* Clears the current exception, which outofcuda swallows so that nothing it
 * does can fail the program. With OUTOFCUDA_DEBUG=1 (read once) each one is
 * first printed to stderr, where, why and what, as psutil's PSUTIL_DEBUG
 * does: "outofcuda debug: bridge.c:312 set_flag: RuntimeError: ...", with
 * " (absent)" or " (recorded)" after the function where the error is an
 * expected answer. Never raises. The clears below and those of the functions
 * it calls (oc_stderr_write, oc_utf8) are its own: traced, they would call
 * it again. */
void oc_clear_at(const char *file, int line, const char *func, const char *why)
{
    static int debug = -1;
    PyObject *type, *value, *tb, *name = NULL, *text = NULL;
    const char *base;
    if (!PyErr_Occurred() || keep_interrupt())
        return;
    if (debug < 0)
        debug = oc_parse_bool(oc_env("OUTOFCUDA_DEBUG")) == 1;
    if (!debug) {
        PyErr_Clear();
        return;
    }
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (type != NULL)
        name = PyObject_GetAttrString(type, "__name__");
    if (value != NULL)
        text = PyObject_Str(value);
    /* A failing str() is its own "?" below; a Ctrl-C raised in it is the
     * program's, set aside as any other. */
    if (PyErr_Occurred() && !keep_interrupt())
        PyErr_Clear();
    base = strrchr(file, '/');
    oc_stderr_printf("outofcuda debug: %s:%d %s%s%s%s: %s: %s\n", base ? base + 1 : file, line,
                     func, why ? " (" : "", why ? why : "", why ? ")" : "",
                     name ? oc_utf8(name, (char[64]){0}, 64) : "?",
                     text ? oc_utf8(text, (char[400]){0}, 400) : "?");
    Py_XDECREF(name);
    Py_XDECREF(text);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    PyErr_Clear(); /* printed above */
}

/* text with the rank label (oc_rank_label) before every line that starts
 * in it: malloc'd, or NULL when there is no label (or no memory: text goes
 * as is). *at_start: whether the stream is at a line's start, carried from
 * one call to the next (a line may be written in pieces). */
char *oc_labelled(const char *text, int *at_start)
{
    const char *label = oc_rank_label(), *p;
    size_t ll = strlen(label), lines = 1;
    char *out, *o;
    if (ll == 0)
        return NULL;
    for (p = text; *p; p++)
        lines += *p == '\n';
    out = malloc(strlen(text) + lines * ll + 1);
    if (out == NULL)
        return NULL;
    for (p = text, o = out; *p; p++) {
        if (*at_start && *p != '\n') { /* an empty line stays empty */
            memcpy(o, label, ll);
            o += ll;
        }
        *o++ = *p;
        *at_start = *p == '\n';
    }
    *o = '\0';
    return out;
}

/* Writes text (UTF-8; other bytes as \xNN) through sys.stderr and nowhere
 * else, each line labelled with the rank under torchrun. PySys_WriteStderr and C's stderr fall back to file descriptor 2, which
 * a program started with stderr closed has handed to one of its own files:
 * with sys.stderr None or closed nothing is written. Never raises; a
 * Ctrl-C raised by the write is kept (oc_clear_at). */
void oc_stderr_write(const char *text)
{
    static int at_line_start = 1; /* under the GIL */
    PyObject *exc_type, *exc_value, *exc_tb, *err, *closed, *str, *res;
    int is_closed;
    char *labelled = oc_labelled(text, &at_line_start);
    text = labelled ? labelled : text;
    PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
    err = PySys_GetObject("stderr"); /* borrowed */
    if (err != NULL && err != Py_None) {
        Py_INCREF(err);
        closed = PyObject_GetAttrString(err, "closed");
        is_closed = closed != NULL && PyObject_IsTrue(closed) == 1;
        Py_XDECREF(closed);
        if (PyErr_Occurred() && !keep_interrupt())
            PyErr_Clear(); /* a stream without `closed` is open */
        str = is_closed ? NULL
                        : PyUnicode_DecodeUTF8(text, (Py_ssize_t)strlen(text), "backslashreplace");
        res = str ? PyObject_CallMethod(err, "write", "O", str) : NULL;
        Py_XDECREF(res);
        Py_XDECREF(str);
        Py_DECREF(err);
        if (PyErr_Occurred() && !keep_interrupt())
            PyErr_Clear(); /* a stream that fails to write gets nothing */
    }
    PyErr_Restore(exc_type, exc_value, exc_tb);
    free(labelled);
}

void oc_stderr_printf(const char *fmt, ...)
{
    char buf[1200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    oc_stderr_write(buf);
}

/* importlib's own frames, frozen or from the standard library. */
static int is_bootstrap(PyObject *filename)
{
    PyObject *b = PyUnicode_AsUTF8String(filename);
    const char *t = b ? PyBytes_AsString(b) : NULL;
    int res =
        t == NULL || strncmp(t, "<frozen importlib", 17) == 0 || strstr(t, "/importlib/") != NULL;
    Py_XDECREF(b);
    return res;
}

/* The program's line that led here: the innermost Python frame outside
 * importlib's bootstrap (an `import torch` warns from the line that imports).
 * *file is a new reference, or NULL where no Python code runs (start-up). */
static void program_location(PyObject **file, int *line)
{
    PyObject *sys_mod = PyImport_AddModule("sys"); /* borrowed */
    PyObject *frame = sys_mod ? PyObject_CallMethod(sys_mod, "_getframe", NULL) : NULL;
    *file = NULL;
    *line = 0;
    while (frame != NULL && frame != Py_None) {
        PyObject *code = PyObject_GetAttrString(frame, "f_code");
        PyObject *name = code ? PyObject_GetAttrString(code, "co_filename") : NULL;
        PyObject *lineno = PyObject_GetAttrString(frame, "f_lineno"), *back;
        Py_XDECREF(code);
        if (name != NULL && PyUnicode_Check(name) && lineno != NULL && !is_bootstrap(name)) {
            *file = name;
            *line = (int)PyLong_AsLong(lineno);
            Py_DECREF(lineno);
            break;
        }
        Py_XDECREF(name);
        Py_XDECREF(lineno);
        back = PyObject_GetAttrString(frame, "f_back");
        Py_DECREF(frame);
        frame = back;
    }
    Py_XDECREF(frame);
    OC_CLEAR_ABSENT(); /* no frame to name, the warning names outofcuda */
}

void oc_warn(const char *msg)
{
    PyObject *exc_type, *exc_value, *exc_tb, *text = NULL, *utf8 = NULL, *file;
    const char *label = oc_rank_label();
    size_t label_len = strlen(label);
    char where[512], *labelled = malloc(label_len + strlen(msg) + 1);
    int line;
    /* Keep whatever exception is being handled: a warning must not replace it. */
    PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
    /* The label is part of the warning's text; the fallback below writes
     * through oc_stderr_write, which labels on its own. */
    if (labelled != NULL) {
        snprintf(labelled, label_len + strlen(msg) + 1, "%s%s", label, msg);
        text = PyUnicode_DecodeUTF8(labelled, (Py_ssize_t)strlen(labelled), "backslashreplace");
    }
    free(labelled);
    if (text != NULL)
        utf8 = PyUnicode_AsUTF8String(text);
    Py_XDECREF(text);
    program_location(&file, &line);
    if (utf8 == NULL || PyErr_WarnExplicit(PyExc_UserWarning, PyBytes_AsString(utf8),
                                           file ? oc_utf8(file, where, sizeof where) : "outofcuda",
                                           line, "outofcuda", NULL) < 0) {
        /* -W error turned the warning into an exception; outofcuda must not
         * raise from an import, so the message goes to stderr instead. */
        OC_CLEAR_RECORDED(); /* the message goes to stderr below; a Ctrl-C is kept */
        oc_stderr_printf("%.1000s\n", utf8 != NULL ? PyBytes_AsString(utf8) + label_len
                                                   : "outofcuda: a warning could not be shown");
    }
    Py_XDECREF(utf8);
    Py_XDECREF(file);
    PyErr_Restore(exc_type, exc_value, exc_tb);
}

/* What went wrong inside outofcuda first (a str), or NULL: status()["error"]. */
static PyObject *error;

PyObject *oc_error(void)
{
    return error;
}

void oc_set_error(const char *where)
{
    PyObject *type, *value, *tb, *text;
    if (PyErr_Occurred() && keep_interrupt())
        return;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    text = value ? PyUnicode_FromFormat("%s: %S", where, value) : PyUnicode_FromString(where);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    if (text == NULL) {
        OC_CLEAR();
        return;
    }
    if (error == NULL) {
        char buf[600];
        error = text;
        snprintf(buf, sizeof buf, "outofcuda: %s (outofcuda.status() has the details)",
                 oc_utf8(text, (char[512]){0}, 512));
        oc_warn(buf);
    } else {
        Py_DECREF(text);
    }
}

/* The configuration, read once from the environment on first use. */
static oc_config cfg;
static int config_loaded;

const oc_config *oc_config_get(void)
{
    if (!config_loaded) {
        oc_config_load(&cfg, env_getenv, NULL);
        oc_config_check_names(&cfg, environ);
        config_loaded = 1;
        for (int i = 0; i < cfg.n_warnings; i++)
            oc_warn(cfg.warnings[i]);
    }
    return &cfg;
}

const oc_config *oc_config_if_loaded(void)
{
    return config_loaded ? &cfg : NULL;
}

PyObject *oc_advice_texts(const oc_advice_item *items, int n)
{
    PyObject *list = PyList_New(0);
    for (int i = 0; list != NULL && i < n; i++) {
        PyObject *s = PyUnicode_FromString(items[i].text);
        if (s == NULL || PyList_Append(list, s) < 0)
            Py_CLEAR(list);
        Py_XDECREF(s);
    }
    return list;
}

PyObject *oc_none_or_ll(long long x)
{
    if (x < 0)
        Py_RETURN_NONE;
    return PyLong_FromLongLong(x);
}

PyObject *oc_sys_module(const char *name)
{
    PyObject *key = PyUnicode_FromString(name);
    PyObject *mod = key ? PyImport_GetModule(key) : NULL;
    Py_XDECREF(key);
    if (mod == NULL)
        OC_CLEAR(); /* not imported sets nothing: only a real error is here */
    return mod;
}

PyObject *oc_getattr_chain(PyObject *obj, const char *dotted)
{
    char part[128];
    PyObject *cur = obj;
    Py_INCREF(cur);
    while (*dotted) {
        const char *dot = strchr(dotted, '.');
        size_t n = dot ? (size_t)(dot - dotted) : strlen(dotted);
        PyObject *next;
        if (n >= sizeof part) {
            Py_DECREF(cur);
            return NULL;
        }
        memcpy(part, dotted, n);
        part[n] = '\0';
        next = PyObject_GetAttrString(cur, part);
        Py_DECREF(cur);
        if (next == NULL) {
            OC_CLEAR_ABSENT(); /* the chain ends here (NULL) */
            return NULL;
        }
        cur = next;
        dotted += n + (dot ? 1 : 0);
    }
    return cur;
}

int oc_call_bool(PyObject *owner, const char *name, int value)
{
    PyObject *fn, *res;
    fn = PyObject_GetAttrString(owner, name);
    if (fn == NULL) {
        OC_CLEAR_ABSENT(); /* the caller's 0 means missing */
        return 0;
    }
    res = PyObject_CallFunctionObjArgs(fn, value ? Py_True : Py_False, NULL);
    Py_DECREF(fn);
    if (res == NULL)
        return -1;
    Py_DECREF(res);
    return 1;
}

PyObject *oc_call_quiet_at(PyObject *owner, const char *name, const char *a, const char *b,
                           const char *file, int line, const char *func)
{
    PyObject *fn = PyObject_GetAttrString(owner, name), *r = NULL;
    if (fn != NULL)
        r = a ? PyObject_CallFunction(fn, "ss", a, b) : PyObject_CallObject(fn, NULL);
    Py_XDECREF(fn);
    oc_clear_at(file, line, func, NULL);
    return r;
}

const char *oc_utf8(PyObject *str, char *buf, size_t sz)
{
    PyObject *bytes;
    const char *text;
    size_t n;
    buf[0] = '\0';
    if (str == NULL)
        return buf;
    bytes = PyUnicode_AsUTF8String(str);
    if (bytes == NULL) {
        PyErr_Clear(); /* an unencodable text copies as "" (oc_clear_at uses this) */
        return buf;
    }
    text = PyBytes_AsString(bytes);
    n = oc_utf8_fit(text, strlen(text), sz - 1);
    memcpy(buf, text, n);
    buf[n] = '\0';
    Py_DECREF(bytes);
    return buf;
}

void oc_appendf(oc_text *t, const char *fmt, ...)
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

size_t oc_utf8_fit(const char *s, size_t len, size_t max)
{
    if (len <= max)
        return len;
    /* Back over the continuation bytes (10xxxxxx) of the character cut. */
    while (max > 0 && ((unsigned char)s[max] & 0xc0) == 0x80)
        max--;
    return max;
}

PyObject *oc_arg_bytes(PyObject *arg, const char *message)
{
    if (!PyUnicode_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, message);
        return NULL;
    }
    return PyUnicode_AsEncodedString(arg, "utf-8", "surrogateescape");
}

long oc_torch_version(PyObject *torch)
{
    PyObject *v = oc_getattr_chain(torch, "__version__");
    PyObject *s = v ? PyObject_Str(v) : NULL;
    char buf[64];
    long ver = oc_torch_version_number(oc_utf8(s, buf, sizeof buf));
    Py_XDECREF(s);
    Py_XDECREF(v);
    OC_CLEAR();
    return ver;
}

int oc_resolve_file_path(const char *path, char *dir, size_t dirsz, char *out, size_t outsz)
{
    char real[PATH_MAX];
    struct stat st;
    const char *slash = strrchr(path, '/');
    const char *base = slash ? slash + 1 : path;
    out[0] = '\0';
    if (slash == NULL)
        snprintf(dir, dirsz, ".");
    else if (slash == path)
        snprintf(dir, dirsz, "/");
    else
        snprintf(dir, dirsz, "%.*s", (int)(slash - path), path);
    if (realpath(dir, real) == NULL || stat(real, &st) != 0 || !S_ISDIR(st.st_mode))
        return -1;
    if (snprintf(out, outsz, "%s/%s", strcmp(real, "/") ? real : "", base) >= (int)outsz) {
        out[0] = '\0';
        return -2;
    }
    return 0;
}

int oc_register_at_exit(PyMethodDef *def, int *registered)
{
    PyObject *atexit_mod, *fn, *r;
    if (*registered)
        return 0;
    atexit_mod = PyImport_ImportModule("atexit");
    fn = atexit_mod ? PyCFunction_NewEx(def, NULL, NULL) : NULL;
    r = fn ? PyObject_CallMethod(atexit_mod, "register", "O", fn) : NULL;
    Py_XDECREF(fn);
    Py_XDECREF(atexit_mod);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    *registered = 1;
    return 0;
}

/* *used names the setter tried. */
int oc_alloc_call_setter(PyObject *c_mod, const char *conf, const char **used)
{
    static const char *const setters[] = {"_cuda_cudaCachingAllocator_set_allocator_settings",
                                          "_accelerator_setAllocatorSettings"};
    *used = NULL;
    for (size_t i = 0; c_mod != NULL && i < 2; i++) {
        PyObject *fn = PyObject_GetAttrString(c_mod, setters[i]), *r;
        if (fn == NULL) {
            OC_CLEAR_ABSENT(); /* the next setter is tried */
            continue;
        }
        *used = setters[i];
        r = PyObject_CallFunction(fn, "s", conf);
        Py_DECREF(fn);
        if (r == NULL)
            return -1;
        Py_DECREF(r);
        return 1;
    }
    return 0;
}
