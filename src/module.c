/* module.c - the engine's module definition: install(), config() and the
 * test entry points over the pure-C parsers, the method tables of the other
 * files gathered into one module. The helpers every file uses are in
 * common.c; the start-up hook is the separate boot extension (boot.c). */
#include "oc.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* install() -> None. Never raises: the boot calls it from the start-up hook
 * (for a torch imported before the finder), and apply() from user code. */
static PyObject *py_install(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    if (oc_disabled_by_env())
        Py_RETURN_NONE;
    if (oc_watcher_install() < 0) {
        oc_set_error("installing the import hook failed");
        Py_RETURN_NONE;
    }
    if (oc_watcher_fire_if_imported() < 0)
        oc_set_error("applying to an already imported torch failed");
    /* A Ctrl-C set aside meanwhile is raised by the edge as this returns. */
    Py_RETURN_NONE;
}

/* A setting's value in c, as config() shows it (new ref). */
static PyObject *setting_value(const oc_config *c, const oc_setting *s)
{
    /* Numbers are read with memcpy, as config.c stores them. */
    const char *base = (const char *)c + s->offset;
    int i_val = 0;
    long l_val = 0;
    double d_val = 0.0;
    /* A setting turned off by an off word reads None (torch's own default),
     * but for a boolean (False: the known-bugs switch is one) and a count
     * whose 0 is torch's default (OUTOFCUDA_NUM_WORKERS: 0). */
    if (oc_config_off(c, s->name) && s->kind != OC_SET_BOOL && s->kind != OC_SET_SUMMARY &&
        s->kind != OC_SET_KNOWN_BUGS && !(s->kind == OC_SET_LONG && s->lo == 0))
        Py_RETURN_NONE;
    switch (s->kind) {
    case OC_SET_BOOL:
    case OC_SET_KNOWN_BUGS:
        memcpy(&i_val, base, sizeof i_val);
        return PyBool_FromLong(i_val);
    case OC_SET_LONG:
        memcpy(&l_val, base, sizeof l_val);
        return PyLong_FromLong(l_val);
    case OC_SET_FRACTION:
        memcpy(&d_val, base, sizeof d_val);
        return d_val < 0.0 ? PyUnicode_FromString("auto") : PyFloat_FromDouble(d_val);
    case OC_SET_WORD:
        memcpy(&i_val, base, sizeof i_val);
        for (size_t i = 0; s->values != NULL && s->words[i] != NULL; i++) {
            if (s->values[i] == i_val)
                return PyUnicode_FromString(s->words[i]);
        }
        return PyUnicode_FromString(base);
    case OC_SET_ALLOC:
        return PyUnicode_FromString(base);
    case OC_SET_SUMMARY: {
        static const char *const modes[] = {"off", "stderr", "json"};
        const char *text = c->summary == OC_SUMMARY_JSON ? c->summary_path : modes[c->summary];
        return PyUnicode_DecodeUTF8(text, (Py_ssize_t)strlen(text), "replace");
    }
    case OC_SET_TEXT:
    case OC_SET_FOREIGN:
        break;
    }
    Py_RETURN_NONE;
}

/* Appends text (UTF-8, bad bytes replaced) to list; NULL, the list
 * released, when that fails or list is NULL. */
static PyObject *append_text(PyObject *list, const char *text)
{
    PyObject *s = list ? PyUnicode_DecodeUTF8(text, (Py_ssize_t)strlen(text), "replace") : NULL;
    if (s == NULL || PyList_Append(list, s) < 0)
        Py_CLEAR(list);
    Py_XDECREF(s);
    return list;
}

/* Every setting of the table that oc_config holds, keyed by its name less
 * "OUTOFCUDA_" in lower case, then the parser's warnings. */
static PyObject *dict_from_config(const oc_config *c)
{
    PyObject *d = PyDict_New(), *warnings = PyList_New(0), *off = PyList_New(0), *v;
    for (size_t i = 0; d != NULL && i < oc_setting_count(); i++) {
        const oc_setting *s = oc_setting_at(i);
        char key[64];
        if (s->offset == OC_NO_FIELD)
            continue;
        snprintf(key, sizeof key, "%s", s->name + strlen("OUTOFCUDA_"));
        for (char *k = key; *k; k++)
            *k = (char)(*k >= 'A' && *k <= 'Z' ? *k - 'A' + 'a' : *k);
        v = setting_value(c, s);
        if (v == NULL || PyDict_SetItemString(d, key, v) < 0)
            Py_CLEAR(d);
        Py_XDECREF(v);
    }
    for (int i = 0; warnings != NULL && i < c->n_warnings; i++)
        warnings = append_text(warnings, c->warnings[i]);
    /* The rows OUTOFCUDA_KNOWN_BUGS turned off, by id. */
    for (size_t i = 0; off != NULL && i < oc_known_bug_count() && i < 8 * sizeof c->known_bugs_off;
         i++) {
        if ((c->known_bugs_off >> i) & 1)
            off = append_text(off, oc_known_bug_at(i)->id);
    }
    if (off == NULL || d == NULL || PyDict_SetItemString(d, "known_bugs_off", off) < 0)
        Py_CLEAR(d);
    Py_XDECREF(off);
    v = PyUnicode_FromString(c->alloc_conf_no_expandable);
    if (d == NULL || warnings == NULL || v == NULL ||
        PyDict_SetItemString(d, "alloc_conf_no_expandable", v) < 0 ||
        PyDict_SetItemString(d, "warnings", warnings) < 0)
        Py_CLEAR(d);
    Py_XDECREF(v);
    Py_XDECREF(warnings);
    return d;
}

/* The words a word setting takes, in the table's order (None for other
 * kinds): the Python layer checks its own arguments against these. */
static PyObject *setting_words(const oc_setting *s)
{
    size_t n = 0;
    PyObject *t;
    if (s->words == NULL)
        Py_RETURN_NONE;
    while (s->words[n] != NULL)
        n++;
    t = PyTuple_New((Py_ssize_t)n);
    for (size_t i = 0; t != NULL && i < n; i++) {
        PyObject *w = PyUnicode_FromString(s->words[i]);
        if (w == NULL || PyTuple_SetItem(t, (Py_ssize_t)i, w) < 0)
            Py_CLEAR(t);
    }
    return t;
}

/* _settings() -> list of dicts: the table of every environment variable
 * outofcuda reads (name, kind, default, accepts, words), for doctor, tests
 * and the Python API's own checks. */
static PyObject *py_settings(PyObject *self, PyObject *unused)
{
    static const char *const kinds[] = {"boolean", "number", "fraction", "word",      "allocator",
                                        "summary", "text",   "foreign",  "known_bugs"};
    PyObject *list = PyList_New(0);
    (void)self;
    (void)unused;
    for (size_t i = 0; list != NULL && i < oc_setting_count(); i++) {
        const oc_setting *s = oc_setting_at(i);
        PyObject *e = Py_BuildValue("{s:s,s:s,s:z,s:s,s:N}", "name", s->name, "kind",
                                    kinds[s->kind], "default", s->default_text, "accepts",
                                    s->accepts, "words", setting_words(s));
        if (e == NULL || PyList_Append(list, e) < 0)
            Py_CLEAR(list);
        Py_XDECREF(e);
    }
    return list;
}

/* config() -> dict: the configuration read once from the environment (warnings
 * are emitted on the first read only). */
static PyObject *py_config(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return dict_from_config(oc_config_get());
}

typedef struct {
    PyObject *mapping; /* the dict standing in for the environment */
    PyObject *keep;    /* list of bytes that back the returned pointers */
} dict_env;

/* Looks name up in the dict; the UTF-8 copy lives as long as ctx->keep.
 * Limited API 3.9 has no PyUnicode_AsUTF8, hence the bytes objects. */
static const char *dict_getenv(const char *name, void *ctx)
{
    dict_env *env = ctx;
    PyObject *v = PyDict_GetItemString(env->mapping, name), *b;
    if (v == NULL || !PyUnicode_Check(v))
        return NULL;
    b = PyUnicode_AsEncodedString(v, "utf-8", "surrogateescape");
    if (b == NULL || PyList_Append(env->keep, b) < 0) {
        Py_XDECREF(b);
        OC_CLEAR();
        return NULL;
    }
    Py_DECREF(b);
    return PyBytes_AsString(b);
}

/* _parse_config(mapping) -> dict: the pure-C parser run over a dict instead of
 * the environment (for tests; emits no warnings, returns them). */
static PyObject *py_parse_config(PyObject *self, PyObject *arg)
{
    oc_config *c;
    dict_env env;
    PyObject *res;
    (void)self;
    if (!PyDict_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "_parse_config expects a dict of str to str");
        return NULL;
    }
    env.mapping = arg;
    env.keep = PyList_New(0);
    c = PyMem_Malloc(sizeof *c);
    if (c == NULL || env.keep == NULL) {
        PyMem_Free(c);
        Py_XDECREF(env.keep);
        return PyErr_NoMemory();
    }
    oc_config_load(c, dict_getenv, &env);
    res = dict_from_config(c);
    PyMem_Free(c);
    Py_DECREF(env.keep);
    return res;
}

static int allowed_for_version(const char *key, void *ctx)
{
    return oc_alloc_key_known(key, *(long *)ctx);
}

/* _merge_alloc_conf(defaults, user, torch_version=None, no_expandable="")
 * -> (merged, dropped): outofcuda's merge (oc_alloc_merge_defaults).
 * ValueError when a string is malformed. */
static PyObject *py_merge_alloc_conf(PyObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"defaults", "user", "torch_version", "no_expandable", NULL};
    const char *defaults, *user, *tv = NULL, *no_expandable = "";
    char out[OC_ALLOC_CONF_MAX * 2], dropped[512], err[160];
    long ver;
    int held_back;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "ss|zs:_merge_alloc_conf", kwlist, &defaults, &user,
                                     &tv, &no_expandable))
        return NULL;
    ver = tv ? oc_torch_version_number(tv) : 0;
    if (oc_alloc_merge_defaults(defaults, no_expandable, user, tv ? allowed_for_version : NULL,
                                &ver, out, sizeof out, dropped, sizeof dropped, err, sizeof err,
                                &held_back) != 0) {
        PyErr_Format(PyExc_ValueError, "bad allocator configuration: %s", err);
        return NULL;
    }
    return Py_BuildValue("(ss)", out, dropped);
}

OC_EDGE_NOARGS(py_install)
OC_EDGE_NOARGS(py_config)
OC_EDGE_O(py_parse_config)
OC_EDGE_NOARGS(py_settings)
OC_EDGE_KEYWORDS(py_merge_alloc_conf)

static PyMethodDef module_methods[] = {
    OC_METHOD("install", py_install,
              "install()\n--\n\nPut outofcuda's import watcher on sys.meta_path (idempotent, "
              "never raises). outofcuda.apply() calls it; the boot calls it when torch is already "
              "imported."),
    OC_METHOD("config", py_config,
              "config()\n--\n\nThe OUTOFCUDA_* configuration as read from the environment."),
    OC_METHOD("_parse_config", py_parse_config,
              "_parse_config($module, env, /)\n--\n\nParse a dict as if it were the environment."),
    OC_METHOD("_settings", py_settings,
              "_settings()\n--\n\nThe table of every environment variable outofcuda reads."),
    OC_METHOD("_merge_alloc_conf", py_merge_alloc_conf,
              "_merge_alloc_conf($module, defaults, user, torch_version=None, "
              "no_expandable='')\n--\n\nMerge allocator strings; the user's keys win."),
    {NULL, NULL, 0, NULL},
};

/* The method tables of every file, gathered into the engine's module. */
static PyMethodDef *const engine_tables[] = {
    module_methods,      oc_report_methods,  oc_nvml_methods,    oc_oom_methods,
    oc_api_methods,      oc_facts_methods,   oc_summary_methods, oc_known_bugs_methods,
    oc_platform_methods, oc_watcher_methods, oc_monitor_methods,
};
static PyMethodDef *const testing_tables[] = {
    oc_summary_testing_methods,
    oc_monitor_testing_methods,
    oc_platform_testing_methods,
    oc_oom_testing_methods,
};

/* The one door for tests: entry points that exist only so the tests can
 * drive the engine without CUDA or a GPU, gathered in the submodule
 * _outofcuda._testing. Nothing in outofcuda calls them but MemoryMonitor's
 * private _source argument, which is the tests' too. */
static int add_test_door(PyObject *m)
{
    PyObject *door = PyModule_New("_outofcuda._testing");
    int rc = door != NULL ? 0 : -1;
    for (size_t i = 0; rc == 0 && i < sizeof testing_tables / sizeof testing_tables[0]; i++)
        rc = PyModule_AddFunctions(door, testing_tables[i]);
    if (rc < 0 || PyModule_AddObject(m, "_testing", door) < 0) {
        Py_XDECREF(door);
        return -1;
    }
    return 0;
}

static int module_exec(PyObject *m)
{
    /* The hook state is process-wide (one torch per process); a second
     * interpreter would share torch-facing state it cannot own. */
    if (PyInterpreterState_GetID(PyInterpreterState_Get()) != 0) {
        PyErr_SetString(PyExc_ImportError,
                        "outofcuda's extension supports only the main interpreter");
        return -1;
    }
    for (size_t i = 0; i < sizeof engine_tables / sizeof engine_tables[0]; i++) {
        if (PyModule_AddFunctions(m, engine_tables[i]) < 0)
            return -1;
    }
    if (oc_watcher_init(m) < 0 || add_test_door(m) < 0)
        return -1;
    return PyModule_AddStringConstant(m, "__version__", OC_VERSION);
}

OC_EDGE_MODULE_EXEC(module_exec)

#ifndef OC_ABI3T
static PyModuleDef_Slot module_slots[] = {
    OC_SLOT(module_exec),
    {0, NULL}, /* Py_mod_gil where the running Python knows it (PyInit__outofcuda) */
    {0, NULL},
};

/* Py_mod_gil and Py_MOD_GIL_USED (3.13+), which a 3.9 Limited API build
 * cannot name: the numbers CPython gives them. */
#define OC_PY_MOD_GIL 4
#define OC_PY_MOD_GIL_USED ((void *)0)

/* The running interpreter's minor version (3.x), from Py_GetVersion(): the
 * 3.9 Limited API has no Py_Version. 0 when it cannot be read. */
static long running_minor(void)
{
    const char *v = Py_GetVersion();
    return v[0] == '3' && v[1] == '.' ? strtol(v + 2, NULL, 10) : 0;
}

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "_outofcuda",
    "outofcuda's engine: the import watcher, the torch bridge, the API's decisions and NVML "
    "access (the start-up hook is the boot, outofcuda_hook).",
    0,
    NULL,
    module_slots,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__outofcuda(void)
{
    if (oc_free_threaded_interpreter()) {
        PyErr_SetString(PyExc_ImportError, OC_FREE_THREADED_REFUSAL);
        return NULL;
    }
    /* The engine relies on the GIL (process-wide state, no locks of its
     * own), and says so where the slot exists: an unknown slot id is an
     * error on 3.9-3.12, which load this same file. */
    if (running_minor() >= 13) {
        module_slots[1].slot = OC_PY_MOD_GIL;
        module_slots[1].value = OC_PY_MOD_GIL_USED;
    }
    return PyModuleDef_Init(&module_def);
}
#else
/* abi3t (oc.h): the PEP 793 export hook; 3.15+ always knows Py_mod_gil. */
PyABIInfo_VAR(module_abi);

static PySlot module_export_slots[] = {
    PySlot_DATA(Py_mod_name, OC_ENGINE_NAME),
    PySlot_DATA(Py_mod_doc, "outofcuda's engine: the import watcher, the torch bridge, the API's "
                            "decisions and NVML access (the start-up hook is the boot, "
                            "outofcuda_hook)."),
    OC_EXPORT_COMMON_SLOTS(module_abi),
    PySlot_FUNC(Py_mod_exec, edge_module_exec),
    PySlot_END,
};

PyMODEXPORT_FUNC PyModExport__outofcuda(void)
{
    return oc_export(module_export_slots);
}
#endif /* OC_ABI3T */
