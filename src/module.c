/* module.c - the engine's module definition: install(), config() and the
 * test entry points over the pure-C parsers, the method tables of the other
 * files gathered into one module. The helpers every file uses are in
 * common.c; the start-up hook is the separate boot extension (boot.c). */
#include "oc.h"

#include <string.h>

/* install() -> None. Never raises: the boot calls it from the start-up hook
 * (for a torch imported before the finder), and apply() from user code. */
static PyObject *oc_install(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    if (oc_disabled_by_env())
        Py_RETURN_NONE;
    if (oc_watcher_install() < 0) {
        oc_set_error("installing the import hook failed");
        Py_RETURN_NONE;
    }
    oc_g.installed = 1;
    if (oc_watcher_fire_if_imported() < 0)
        oc_set_error("applying to an already imported torch failed");
    Py_RETURN_NONE;
}

static PyObject *dict_from_config(const oc_config *c)
{
    static const char *const amp[] = {"auto", "float16", "bfloat16"};
    PyObject *warnings = PyList_New(0), *d;
    if (warnings == NULL)
        return NULL;
    for (int i = 0; i < c->n_warnings; i++) {
        PyObject *s =
            PyUnicode_DecodeUTF8(c->warnings[i], (Py_ssize_t)strlen(c->warnings[i]), "replace");
        if (s == NULL || PyList_Append(warnings, s) < 0) {
            Py_XDECREF(s);
            Py_DECREF(warnings);
            return NULL;
        }
        Py_DECREF(s);
    }
    d = Py_BuildValue(
        "{s:O,s:O,s:O,s:O,s:O,s:O,s:O,s:s,s:O,s:s,s:d,s:s,s:O,s:O,s:O,s:O,s:O,s:l,s:l,s:N}",
        "disable", c->disable ? Py_True : Py_False, "verbose", c->verbose ? Py_True : Py_False,
        "tf32", c->tf32 ? Py_True : Py_False, "cudnn_benchmark",
        c->cudnn_benchmark ? Py_True : Py_False, "cudnn_deterministic",
        c->cudnn_deterministic ? Py_True : Py_False, "channels_last",
        c->channels_last ? Py_True : Py_False, "compile", c->compile ? Py_True : Py_False,
        "compile_mode", c->compile_mode, "compile_fullgraph",
        c->compile_fullgraph ? Py_True : Py_False, "amp_dtype", amp[c->amp_dtype],
        "memory_fraction", c->memory_fraction, "alloc_conf", c->alloc_conf, "gc_collect",
        c->gc_collect ? Py_True : Py_False, "flash_attn", c->flash_attn ? Py_True : Py_False,
        "mem_eff_attn", c->mem_eff_attn ? Py_True : Py_False, "math_attn",
        c->math_attn ? Py_True : Py_False, "pin_memory", c->pin_memory ? Py_True : Py_False,
        "num_workers", c->num_workers, "prefetch_factor", c->prefetch_factor, "warnings", warnings);
    if (d != NULL) {
        static const char *const modes[] = {"off", "stderr", "json"};
        const char *text = c->summary == OC_SUMMARY_JSON ? c->summary_path : modes[c->summary];
        PyObject *v = PyUnicode_DecodeUTF8(text, (Py_ssize_t)strlen(text), "replace");
        if (v == NULL || PyDict_SetItemString(d, "summary", v) < 0)
            Py_CLEAR(d);
        Py_XDECREF(v);
    }
    if (d != NULL) {
        PyObject *v = PyUnicode_FromString(c->alloc_conf_no_expandable);
        if (v == NULL || PyDict_SetItemString(d, "alloc_conf_no_expandable", v) < 0 ||
            PyDict_SetItemString(d, "framework_override",
                                 c->framework_override ? Py_True : Py_False) < 0)
            Py_CLEAR(d);
        Py_XDECREF(v);
    }
    if (d != NULL && PyDict_SetItemString(d, "known_bugs", c->known_bugs ? Py_True : Py_False) < 0)
        Py_CLEAR(d);
    return d;
}

/* config() -> dict: the configuration read once from the environment (warnings
 * are emitted on the first read only). */
static PyObject *oc_config_py(PyObject *self, PyObject *unused)
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
static PyObject *oc_parse_config_py(PyObject *self, PyObject *arg)
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
static PyObject *oc_merge_alloc_conf_py(PyObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"defaults", "user", "torch_version", "no_expandable", NULL};
    const char *defaults, *user, *tv = NULL, *no_expandable = "";
    char out[OC_ALLOC_CONF_MAX * 2], dropped[512], err[160];
    long ver;
    int held_back;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "ss|zs", kwlist, &defaults, &user, &tv,
                                     &no_expandable))
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

static PyMethodDef module_methods[] = {
    {"install", oc_install, METH_NOARGS,
     "install()\n--\n\nPut outofcuda's import watcher on sys.meta_path (idempotent, never "
     "raises). outofcuda.apply() calls it; the boot calls it when torch is already imported."},
    {"config", oc_config_py, METH_NOARGS,
     "config()\n--\n\nThe OUTOFCUDA_* configuration as read from the environment."},
    {"_parse_config", oc_parse_config_py, METH_O, "Parse a dict as if it were the environment."},
    {"_merge_alloc_conf", (PyCFunction)(void (*)(void))oc_merge_alloc_conf_py,
     METH_VARARGS | METH_KEYWORDS, "Merge allocator strings; the user's keys win."},
    {NULL, NULL, 0, NULL},
};

static int module_exec(PyObject *m)
{
    /* The hook state is process-wide (one torch per process); a second
     * interpreter would share torch-facing state it cannot own. */
    if (PyInterpreterState_GetID(PyInterpreterState_Get()) != 0) {
        PyErr_SetString(PyExc_ImportError,
                        "outofcuda's extension supports only the main interpreter");
        return -1;
    }
    if (PyModule_AddFunctions(m, module_methods) < 0 ||
        PyModule_AddFunctions(m, oc_report_methods) < 0 ||
        PyModule_AddFunctions(m, oc_nvml_methods) < 0 ||
        PyModule_AddFunctions(m, oc_oom_methods) < 0 ||
        PyModule_AddFunctions(m, oc_api_methods) < 0 ||
        PyModule_AddFunctions(m, oc_facts_methods) < 0 ||
        PyModule_AddFunctions(m, oc_summary_methods) < 0 ||
        PyModule_AddFunctions(m, oc_known_bugs_methods) < 0 ||
        PyModule_AddFunctions(m, oc_watcher_methods) < 0 || oc_watcher_init(m) < 0)
        return -1;
    if (oc_monitor_add_type(m) < 0)
        return -1;
    return PyModule_AddStringConstant(m, "__version__", OC_VERSION);
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, (void *)module_exec},
    {0, NULL},
};

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
    return PyModuleDef_Init(&module_def);
}
