/* report.c - what outofcuda did: the status() dict and the verbose table. */
#include "oc.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static const char *const opt_names[] = {
    "tf32", "cudnn_benchmark", "cudnn_deterministic", "allocator", "memory_fraction",
    "sdpa", "amp_dtype",       "oom_handler",
};
#define N_OPTS (sizeof opt_names / sizeof opt_names[0])

int oc_result_set(const char *name, int applied, PyObject *value, const char *reason)
{
    PyObject *entry;
    int rc;
    if (oc_g.results == NULL) {
        oc_g.results = PyDict_New();
        if (oc_g.results == NULL)
            return -1;
    }
    entry = Py_BuildValue("{s:O,s:O,s:s}", "applied", applied ? Py_True : Py_False, "value",
                          value ? value : Py_None, "reason", reason);
    if (entry == NULL)
        return -1;
    rc = PyDict_SetItemString(oc_g.results, name, entry);
    Py_DECREF(entry);
    return rc;
}

void oc_result_set_all(const char *reason)
{
    for (size_t i = 0; i < N_OPTS; i++)
        oc_result_set(opt_names[i], 0, NULL, reason);
}

int oc_result_setf(const char *name, int applied, PyObject *value, const char *fmt, ...)
{
    char reason[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(reason, sizeof reason, fmt, ap);
    va_end(ap);
    return oc_result_set(name, applied, value, reason);
}

/* Returns 1 when sys.modules holds a torch that finished importing. Reads
 * sys.modules and the module's dict only: an attribute lookup (including
 * PyImport_GetModule's own look at __spec__) would execute a torch that
 * importlib.util.LazyLoader holds unexecuted. */
static int torch_imported(void)
{
    PyObject *modules = PySys_GetObject("modules"); /* borrowed */
    PyObject *torch = modules && PyDict_Check(modules) ? PyDict_GetItemString(modules, "torch")
                                                       : NULL;                     /* borrowed */
    PyObject *d = torch && PyModule_Check(torch) ? PyModule_GetDict(torch) : NULL; /* borrowed */
    PyObject *spec = d ? PyDict_GetItemString(d, "__spec__") : NULL;               /* borrowed */
    PyObject *initializing = NULL;
    int done = 0;
    if (d != NULL && PyDict_GetItemString(d, "__version__") != NULL) {
        initializing =
            spec && spec != Py_None ? PyObject_GetAttrString(spec, "_initializing") : NULL;
        done = initializing == NULL || PyObject_IsTrue(initializing) != 1;
    }
    PyErr_Clear();
    Py_XDECREF(initializing);
    return done;
}

static const char *pending_reason(void)
{
    if (oc_g.installed && !oc_g.fired && torch_imported())
        return "torch was imported without passing outofcuda's import watcher (a finder ahead "
               "of it on sys.meta_path loaded torch): nothing was applied";
    if (oc_g.installed && !oc_g.fired)
        return "torch has not been imported in this process yet";
    if (oc_disabled_by_env())
        return "outofcuda is disabled (OUTOFCUDA_DISABLE)";
    return "the start-up hook did not run in this process (python -S, or the hook file is "
           "missing: run `outofcuda doctor`)";
}

static PyObject *optimizations(void)
{
    PyObject *d = PyDict_New();
    if (d == NULL)
        return NULL;
    for (size_t i = 0; i < N_OPTS; i++) {
        PyObject *e = oc_g.results ? PyDict_GetItemString(oc_g.results, opt_names[i]) : NULL;
        if (e != NULL) {
            /* A copy, so a caller editing the dict does not edit our record. */
            e = PyDict_Copy(e);
        } else {
            e = Py_BuildValue("{s:O,s:O,s:s}", "applied", Py_False, "value", Py_None, "reason",
                              pending_reason());
        }
        if (e == NULL || PyDict_SetItemString(d, opt_names[i], e) < 0) {
            Py_XDECREF(e);
            Py_DECREF(d);
            return NULL;
        }
        Py_DECREF(e);
    }
    return d;
}

PyObject *oc_status(PyObject *self, PyObject *unused)
{
    PyObject *opts, *warnings, *res, *bugs;
    (void)self;
    (void)unused;
    opts = optimizations();
    if (opts == NULL)
        return NULL;
    warnings = PyList_New(0);
    if (warnings == NULL) {
        Py_DECREF(opts);
        return NULL;
    }
    for (int i = 0; oc_g.config_loaded && i < oc_g.cfg.n_warnings; i++) {
        PyObject *s = PyUnicode_DecodeUTF8(oc_g.cfg.warnings[i],
                                           (Py_ssize_t)strlen(oc_g.cfg.warnings[i]), "replace");
        if (s == NULL || PyList_Append(warnings, s) < 0) {
            Py_XDECREF(s);
            Py_DECREF(opts);
            Py_DECREF(warnings);
            return NULL;
        }
        Py_DECREF(s);
    }
    bugs = oc_known_bugs_status();
    if (bugs == NULL) {
        Py_DECREF(opts);
        Py_DECREF(warnings);
        return NULL;
    }
    res = Py_BuildValue("{s:s,s:{s:O,s:O,s:O},s:O,s:N,s:N,s:N}", "version", OC_VERSION, "hook",
                        "installed", oc_g.installed ? Py_True : Py_False, "fired",
                        oc_g.fired ? Py_True : Py_False, "error", oc_g.error ? oc_g.error : Py_None,
                        "torch", oc_g.torch_version ? oc_g.torch_version : Py_None, "optimizations",
                        opts, "config_warnings", warnings, "known_bugs", bugs);
    return res;
}

/* The verbose table fits 80 columns: name and applied, then the value from
 * column 32 (a dict one key=value a line when the items do not fit on one),
 * then the reason on lines of its own, indented by 6. Nothing is cut off. */
#define TABLE_WIDTH 80
#define VALUE_COL 32
#define REASON_INDENT 6

/* Text of any value for the table: "-" for None, else str(). */
static void value_text(PyObject *v, char *buf, size_t sz)
{
    PyObject *s;
    if (v == NULL || v == Py_None) {
        snprintf(buf, sz, "-");
        return;
    }
    s = PyObject_Str(v);
    if (s == NULL) {
        PyErr_Clear();
        snprintf(buf, sz, "?");
        return;
    }
    oc_utf8(s, buf, sz);
    Py_DECREF(s);
}

/* Writes text to stderr in lines of at most `first` bytes (the first line,
 * after what the caller wrote) and TABLE_WIDTH - indent bytes (the others,
 * indented). A line breaks at its last space, else after its last '/' or
 * ',' (a path, an allocator string), else, for a word longer than the line,
 * at the width but never inside a UTF-8 character. */
static void write_wrapped(const char *text, size_t first, size_t indent)
{
    size_t width = first, len = strlen(text);
    for (;;) {
        size_t cut = 0, skip = 0;
        if (len <= width) {
            PySys_WriteStderr("%s\n", text);
            return;
        }
        for (size_t n = width; n > 0 && cut == 0; n--) {
            if (text[n] == ' ')
                cut = n, skip = 1;
            else if (text[n - 1] == '/' || text[n - 1] == ',')
                cut = n;
        }
        if (cut == 0) {
            cut = width;
            while (cut > 1 && ((unsigned char)text[cut] & 0xc0) == 0x80)
                cut--;
        }
        PySys_WriteStderr("%.*s\n%*s", (int)cut, text, (int)indent, "");
        text += cut + skip;
        len -= cut + skip;
        width = TABLE_WIDTH - indent;
    }
}

/* Writes an optimisation's value from column VALUE_COL on. */
static void write_value(PyObject *v)
{
    char joined[1000], item[520], text[400];
    Py_ssize_t pos = 0;
    PyObject *key, *val;
    size_t used = 0;
    if (v == NULL || !PyDict_Check(v) || PyDict_Size(v) == 0) {
        value_text(v, text, sizeof text);
        write_wrapped(text, TABLE_WIDTH - VALUE_COL, VALUE_COL);
        return;
    }
    joined[0] = '\0';
    while (PyDict_Next(v, &pos, &key, &val)) {
        char k[100];
        value_text(key, k, sizeof k);
        value_text(val, text, sizeof text);
        used += (size_t)snprintf(joined + used, used < sizeof joined ? sizeof joined - used : 0,
                                 "%s%s=%s", used ? ", " : "", k, text);
        if (used >= sizeof joined)
            break;
    }
    if (used <= TABLE_WIDTH - VALUE_COL) {
        PySys_WriteStderr("%s\n", joined);
        return;
    }
    /* One item a line, continuation lines two further in. */
    pos = 0;
    for (int i = 0; PyDict_Next(v, &pos, &key, &val); i++) {
        char k[100];
        value_text(key, k, sizeof k);
        value_text(val, text, sizeof text);
        snprintf(item, sizeof item, "%s=%s", k, text);
        if (i > 0)
            PySys_WriteStderr("%*s", VALUE_COL, "");
        write_wrapped(item, TABLE_WIDTH - VALUE_COL, VALUE_COL + 2);
    }
}

void oc_report_verbose(void)
{
    char tv[64], reason[400];
    value_text(oc_g.torch_version, tv, sizeof tv);
    PySys_WriteStderr("outofcuda %s: torch %s imported\n", OC_VERSION, tv);
    PySys_WriteStderr("  %-20s %-8s %s\n", "optimisation", "applied", "value (reason below)");
    for (size_t i = 0; i < N_OPTS; i++) {
        PyObject *e = oc_g.results ? PyDict_GetItemString(oc_g.results, opt_names[i]) : NULL;
        PyObject *applied = e ? PyDict_GetItemString(e, "applied") : NULL;
        PySys_WriteStderr("  %-20s %-8s ", opt_names[i], applied == Py_True ? "yes" : "no");
        write_value(e ? PyDict_GetItemString(e, "value") : NULL);
        value_text(e ? PyDict_GetItemString(e, "reason") : NULL, reason, sizeof reason);
        PySys_WriteStderr("%*s", REASON_INDENT, "");
        write_wrapped(reason, TABLE_WIDTH - REASON_INDENT, REASON_INDENT);
    }
    if (oc_g.error != NULL) {
        value_text(oc_g.error, reason, sizeof reason);
        PySys_WriteStderr("  error: ");
        write_wrapped(reason, TABLE_WIDTH - 9, 9);
    }
}

PyMethodDef oc_report_methods[] = {
    {"status", oc_status, METH_NOARGS,
     "status()\n--\n\nWhat outofcuda did in this process, as a JSON-serialisable dict."},
    {NULL, NULL, 0, NULL},
};
