/* boot.c - outofcuda_hook, the only outofcuda code every Python process of
 * the environment runs. The .pth line loads this file by path from its own
 * directory; its init puts one meta-path finder on sys.meta_path. The finder
 * answers None to every import but `torch`; for torch it loads the engine
 * (_outofcuda, by path from this file's directory) and hands the lookup to it
 * (watcher.c).
 *
 * Start-up cost is why this is a separate, small extension: nothing imported
 * by its init, a handful of symbols to bind at dlopen, and no Python code for
 * site to compile beyond the .pth line (benchmarks/startup.py measures it). */
#include "oc.h"

#include <stdlib.h>
#include <structmember.h>

typedef struct {
    OC_OBJECT_HEAD
    PyObject *dict; /* tools patch finders with setattr(finder, "find_spec", ...) */
} finder_object;

/* OC_ABI3T (oc.h): the module comes from the PEP 793 export hook below
 * instead of a PyModuleDef, and the dict is reached through getattro and
 * setattro (an opaque object has no __dictoffset__). */

/* The boot's own state, apart from the engine's: it runs at start-up,
 * before the engine is loaded, in a separate extension. */
static PyObject *boot_module; /* strong; __file__ locates the engine */
static PyObject *finder;      /* strong; the one instance on sys.meta_path */
static PyObject *engine;      /* strong; _outofcuda once loaded */
static int engine_unusable;   /* loading it failed once: never retried */

/* Py_FinalizeEx calls this once the interpreter has ended (no Python may run
 * here: nothing is released). An embedding application's next Py_Initialize
 * loads this file again, still mapped with these statics: its interpreter gets
 * a finder and an engine of its own, not the ended one's emptied objects. */
static void boot_forget(void)
{
    boot_module = finder = engine = NULL;
    engine_unusable = 0;
}

static int is_blank(char c)
{
    /* isspace() in the C locale, as config.c trims */
    return c == ' ' || c == '\t' || c == '\n' || c == '\v' || c == '\f' || c == '\r';
}

/* A variable set to a word oc_parse_bool (config.c) accepts for "yes", any
 * case, blanks around. The boot links nothing of the engine, so it reads the
 * two variables it needs itself (OUTOFCUDA_DISABLE, OUTOFCUDA_DEBUG). */
static int env_yes(const char *name)
{
    static const char *const yes[] = {"1", "true", "yes", "on"};
    const char *v = getenv(name), *w, *y;
    for (; v != NULL && is_blank(*v); v++)
        ;
    for (size_t k = 0; v != NULL && k < sizeof yes / sizeof yes[0]; k++) {
        /* the word (a capital letter for its small one), then only blanks */
        for (w = v, y = yes[k]; *y != '\0' && (*w == *y || (*y >= 'a' && *w == *y - 32)); w++, y++)
            ;
        for (; *y == '\0' && is_blank(*w); w++)
            ;
        if (*y == '\0' && *w == '\0')
            return 1;
    }
    return 0;
}

/* sys.stderr is there and open (the engine's oc_stderr_write, which the
 * boot does not link, makes the same check). */
static int stderr_usable(void)
{
    PyObject *err = PySys_GetObject("stderr"), *closed; /* borrowed */
    int usable;
    if (err == NULL || err == Py_None)
        return 0;
    closed = PyObject_GetAttrString(err, "closed");
    usable = closed == NULL || PyObject_IsTrue(closed) == 0;
    Py_XDECREF(closed);
    PyErr_Clear(); /* a stream without `closed` is open */
    return usable;
}

/* Swallows the current exception; under OUTOFCUDA_DEBUG=1 prints it first,
 * in the engine's format (common.c's oc_clear_at, which the boot does not
 * link). Only an error path reads the variable: start-up pays nothing. Every
 * exception the boot swallows goes through BOOT_CLEAR; the clears here and in
 * stderr_usable, which it calls, are its own (tests/test_static.py). */
static void boot_clear(int line, const char *func)
{
    PyObject *type, *value, *tb, *name, *text = NULL, *utf8 = NULL;
    if (!PyErr_Occurred())
        return;
    /* The user's Ctrl-C or exit() is never swallowed: the caller sees it set. */
    if (PyErr_ExceptionMatches(PyExc_KeyboardInterrupt) || PyErr_ExceptionMatches(PyExc_SystemExit))
        return;
    if (!env_yes(OC_VAR("OUTOFCUDA_DEBUG"))) {
        PyErr_Clear();
        return;
    }
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    name = type ? PyObject_GetAttrString(type, "__name__") : NULL;
    if (name != NULL && value != NULL)
        text = PyUnicode_FromFormat("%S: %S", name, value);
    Py_XDECREF(name);
    if (text != NULL)
        utf8 = PyUnicode_AsUTF8String(text);
    PyErr_Clear(); /* "?" below */
    /* Through sys.stderr, not C's stderr: no stdio symbol for the loader to
     * bind when the boot loads in every process. PySys_WriteStderr falls back
     * to descriptor 2 when sys.stderr is None or fails, and a program started
     * with stderr closed holds one of its own files there: then nothing. */
    if (stderr_usable())
        PySys_WriteStderr("outofcuda debug: boot.c:%d %s: %.900s\n", line, func,
                          utf8 ? PyBytes_AsString(utf8) : "?");
    Py_XDECREF(utf8);
    Py_XDECREF(text);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
}
#define BOOT_CLEAR() boot_clear(__LINE__, __func__)

/* ---- the engine, loaded on the first `import torch` ---- */

/* The engine module (borrowed), or NULL with an exception. An `_outofcuda`
 * already in sys.modules is used only when it is the engine (it carries the
 * watcher entry point); a foreign module of that name stays where it is. */
static PyObject *get_engine(void)
{
    PyObject *modules = PyImport_GetModuleDict(); /* borrowed */
    PyObject *mod = PyDict_GetItemString(modules, OC_ENGINE_NAME);
    if (engine != NULL)
        return engine;
    if (mod != NULL && PyObject_HasAttrString(mod, OC_ENGINE_FIND_SPEC))
        Py_INCREF(mod);
    else if ((mod = oc_load_sibling(boot_module, OC_BOOT_NAME, OC_ENGINE_NAME)) != NULL &&
             PyDict_GetItemString(modules, OC_ENGINE_NAME) == NULL &&
             PyDict_SetItemString(modules, OC_ENGINE_NAME, mod) < 0)
        Py_CLEAR(mod);
    engine = mod;
    return engine;
}

/* Calls engine.<name>(*args); NULL with an exception on failure. A missing or
 * damaged engine is remembered and reported by nobody here: `import torch`
 * must work as without outofcuda (`outofcuda doctor` explains). */
static PyObject *call_engine(const char *name, PyObject *args, PyObject *kw)
{
    PyObject *eng, *fn, *res;
    if (engine_unusable)
        Py_RETURN_NONE;
    eng = get_engine();
    if (eng == NULL) {
        BOOT_CLEAR();
        if (PyErr_Occurred())
            return NULL; /* a Ctrl-C while loading: the next import tries again */
        engine_unusable = 1;
        Py_RETURN_NONE;
    }
    fn = PyObject_GetAttrString(eng, name);
    if (fn == NULL)
        return NULL;
    res = PyObject_Call(fn, args, kw);
    Py_DECREF(fn);
    return res;
}

/* ---- the finder ---- */

/* find_spec(fullname, path=None, target=None): every import of the process
 * passes here (importlib calls positionally), so a name other than "torch" is
 * answered before anything else. The torch lookup is the engine's. */
static PyObject *finder_find_spec(PyObject *self, PyObject *args, PyObject *kw)
{
    PyObject *first = PyTuple_Size(args) > 0 ? PyTuple_GetItem(args, 0) : NULL, *head, *full, *res;
    if (first != NULL && PyUnicode_Check(first) &&
        PyUnicode_CompareWithASCIIString(first, "torch") != 0)
        Py_RETURN_NONE;
    if (first == NULL)
        BOOT_CLEAR();
    /* engine._find_torch_spec(finder, *args, **kw) */
    head = PyTuple_Pack(1, self);
    full = head != NULL ? PySequence_Concat(head, args) : NULL;
    Py_XDECREF(head);
    if (full == NULL)
        return NULL;
    res = call_engine(OC_ENGINE_FIND_SPEC, full, kw);
    Py_DECREF(full);
    return res;
}

static PyObject *finder_invalidate_caches(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    Py_RETURN_NONE;
}

static PyObject *finder_repr(PyObject *self)
{
    (void)self;
    return PyUnicode_FromString("<outofcuda torch import watcher>");
}

static int finder_traverse(PyObject *self, visitproc visit, void *arg)
{
    Py_VISIT(OC_FIELDS(finder_object, self)->dict);
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static int finder_clear(PyObject *self)
{
    Py_CLEAR(OC_FIELDS(finder_object, self)->dict);
    return 0;
}

static void finder_dealloc(PyObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    PyObject_GC_UnTrack(self);
    finder_clear(self);
    tp_free(self);
    Py_DECREF(tp);
}

#ifdef OC_ABI3T
/* Attributes set on the finder live in its own dict and come before the
 * type's (as an instance __dict__ would). */
static PyObject *finder_getattro(PyObject *self, PyObject *name)
{
    PyObject *d = OC_FIELDS(finder_object, self)->dict;
    PyObject *v = d != NULL ? PyDict_GetItemWithError(d, name) : NULL; /* borrowed */
    if (v != NULL) {
        Py_INCREF(v);
        return v;
    }
    return PyErr_Occurred() ? NULL : PyObject_GenericGetAttr(self, name);
}

static int finder_setattro(PyObject *self, PyObject *name, PyObject *value)
{
    finder_object *f = OC_FIELDS(finder_object, self);
    if (f->dict == NULL && (f->dict = PyDict_New()) == NULL)
        return -1;
    return value != NULL ? PyDict_SetItem(f->dict, name, value) : PyDict_DelItem(f->dict, name);
}
#endif

static PyMethodDef finder_methods[] = {
    {"find_spec", (PyCFunction)(void (*)(void))finder_find_spec, METH_VARARGS | METH_KEYWORDS,
     NULL},
    {"invalidate_caches", finder_invalidate_caches, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef finder_members[] = {
#ifndef OC_ABI3T
    {"__dictoffset__", T_PYSSIZET, offsetof(finder_object, dict), READONLY, NULL},
#endif
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot finder_slots[] = {
    {Py_tp_dealloc, (void *)finder_dealloc},
    {Py_tp_traverse, (void *)finder_traverse},
    {Py_tp_clear, (void *)finder_clear},
    {Py_tp_repr, (void *)finder_repr},
    {Py_tp_methods, finder_methods},
    {Py_tp_members, finder_members},
#ifdef OC_ABI3T
    {Py_tp_getattro, (void *)finder_getattro},
    {Py_tp_setattro, (void *)finder_setattro},
#endif
    {0, NULL},
};

static PyType_Spec finder_spec = {
    OC_BOOT_NAME ".TorchImportWatcher",
    OC_BASICSIZE(finder_object),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    finder_slots,
};

/* _install() -> the finder, first on sys.meta_path (once: a venv runs every
 * .pth twice). Raises on failure; the engine records why. */
static PyObject *boot_install_raw(PyObject *self, PyObject *unused)
{
    PyObject *meta_path;
    (void)self;
    (void)unused;
    if (finder == NULL) {
        PyObject *type = PyType_FromSpec(&finder_spec);
        if (type == NULL)
            return NULL;
        finder = PyType_GenericAlloc((PyTypeObject *)type, 0);
        Py_DECREF(type);
        if (finder == NULL)
            return NULL;
    }
    meta_path = PySys_GetObject("meta_path"); /* borrowed */
    if (meta_path == NULL || !PyList_Check(meta_path)) {
        PyErr_SetString(PyExc_RuntimeError, "sys.meta_path is not a list");
        return NULL;
    }
    /* First place: the watcher must see torch before PathFinder or an
     * editable-install finder claims it. */
    if (PySequence_Contains(meta_path, finder) != 1 && PyList_Insert(meta_path, 0, finder) < 0)
        return NULL;
    Py_INCREF(finder);
    return finder;
}

/* install() -> None. Never raises: it runs from the .pth line (and the PEP 829
 * .start entry) at start-up. A torch imported before it (another hook) is
 * handed to the engine at once. */
static PyObject *boot_install(PyObject *self, PyObject *unused)
{
    static int said_off;
    PyObject *res, *none;
    if (env_yes(OC_VAR("OUTOFCUDA_DISABLE"))) {
        /* One line, so that "turned off" is told from "not installed"; the
         * .start entry calls this once more after the module's init. */
        if (!said_off && env_yes(OC_VAR("OUTOFCUDA_VERBOSE")) && stderr_usable())
            PySys_WriteStderr("outofcuda: " OC_DISABLED_TEXT "\n");
        said_off = 1;
        Py_RETURN_NONE;
    }
    res = boot_install_raw(self, unused);
    if (res == NULL) {
        BOOT_CLEAR();
        if (PyErr_Occurred())
            return NULL; /* the user's Ctrl-C or exit() */
        Py_RETURN_NONE;
    }
    Py_DECREF(res);
    if (PyDict_GetItemString(PyImport_GetModuleDict(), "torch") != NULL) {
        none = PyTuple_New(0);
        res = none ? call_engine(OC_ENGINE_INSTALL, none, NULL) : NULL;
        Py_XDECREF(res);
        Py_XDECREF(none);
    }
    BOOT_CLEAR();
    if (PyErr_Occurred())
        return NULL; /* Ctrl-C during start-up stops start-up, as without outofcuda */
    Py_RETURN_NONE;
}

/* _incomplete(path) -> None when the extension file at path holds every
 * byte its headers promise (oc_elf_complete), else why not to load it: the
 * check `import torch` makes, for `import outofcuda` (outofcuda/_native.py),
 * which loads the engine itself with what is already imported. */
static PyObject *boot_incomplete(PyObject *self, PyObject *path)
{
    PyObject *bytes;
    int complete;
    (void)self;
    if (!PyUnicode_Check(path)) {
        PyErr_SetString(PyExc_TypeError, "_incomplete expects a str");
        return NULL;
    }
    bytes = PyUnicode_EncodeFSDefault(path);
    if (bytes == NULL)
        return NULL;
    complete = oc_elf_complete(PyBytes_AsString(bytes));
    Py_DECREF(bytes);
    if (complete)
        Py_RETURN_NONE;
    return PyUnicode_FromFormat(OC_INCOMPLETE_FMT, path);
}

/* _finder() -> the installed finder or None (for the engine's status). */
static PyObject *boot_finder(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    if (finder == NULL)
        Py_RETURN_NONE;
    Py_INCREF(finder);
    return finder;
}

static PyMethodDef boot_methods[] = {
    {"install", boot_install, METH_NOARGS,
     "install()\n--\n\nPut outofcuda's torch import watcher on sys.meta_path (idempotent, never "
     "raises). The .pth/.start hook calls this at interpreter start-up."},
    {"_install", boot_install_raw, METH_NOARGS, "install(), raising on failure."},
    {"_finder", boot_finder, METH_NOARGS, "The installed watcher, or None."},
    {"_incomplete", boot_incomplete, METH_O,
     "_incomplete(path, /)\n--\n\nNone when the extension file at path is complete, else why "
     "not to load it."},
    {NULL, NULL, 0, NULL},
};

/* Both builds: the module becomes the process's boot, records itself in
 * sys.modules (loaded by path from the .pth line, with no import system to do
 * it, so a second line stands aside) and installs the finder. NULL only for a
 * Ctrl-C or exit(), which propagate. */
static PyObject *boot_start(PyObject *m)
{
    PyObject *modules = PyImport_GetModuleDict(); /* borrowed */
    /* One watcher per process; a subinterpreter gets none. */
    if (PyInterpreterState_GetID(PyInterpreterState_Get()) != 0) {
        PyErr_SetString(PyExc_ImportError,
                        "outofcuda's extension supports only the main interpreter");
        return NULL;
    }
    if (boot_module == NULL) {
        Py_INCREF(m);
        boot_module = m;
        (void)Py_AtExit(boot_forget); /* a full table (32): kept as before */
    }
    if (PyDict_GetItemString(modules, OC_BOOT_NAME) == NULL &&
        PyDict_SetItemString(modules, OC_BOOT_NAME, m) < 0)
        BOOT_CLEAR();
    return boot_install(m, NULL);
}

#ifndef OC_ABI3T
static struct PyModuleDef boot_def = {
    PyModuleDef_HEAD_INIT,
    OC_BOOT_NAME,
    "outofcuda's start-up hook: a finder that loads the engine on `import torch`.",
    -1,
    boot_methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

/* Single-phase init on purpose: the .pth line loads this file by path with
 * _imp.create_dynamic alone (no exec step, no spec), and the module must then
 * be in sys.modules and carry __file__, which CPython does for single-phase
 * modules only. */
PyMODINIT_FUNC PyInit_outofcuda_hook(void)
{
    PyObject *m, *res;
    if (oc_free_threaded_interpreter()) {
        PyErr_SetString(PyExc_ImportError, OC_FREE_THREADED_REFUSAL);
        return NULL;
    }
    m = PyModule_Create(&boot_def);
    if (m == NULL)
        return NULL;
    res = boot_start(m);
    if (res == NULL) {
        Py_DECREF(m); /* a subinterpreter, a Ctrl-C or exit(): it propagates */
        return NULL;
    }
    Py_DECREF(res);
    return m;
}
#else
/* abi3t: a multi-phase module. Its .pth line names outofcuda_hook.abi3t.so,
 * sets __file__ (the engine is found beside it) and runs the module after
 * creating it (_imp.exec_dynamic). */
static int boot_exec(PyObject *m)
{
    PyObject *res = boot_start(m);
    Py_XDECREF(res);
    return res != NULL ? 0 : -1;
}

PyABIInfo_VAR(boot_abi);

static PySlot boot_slots[] = {
    PySlot_DATA(Py_mod_name, OC_BOOT_NAME),
    PySlot_DATA(Py_mod_doc,
                "outofcuda's start-up hook: a finder that loads the engine on `import torch`."),
    PySlot_STATIC_DATA(Py_mod_methods, boot_methods), /* lives as long as the process */
    OC_EXPORT_COMMON_SLOTS(boot_abi),
    PySlot_FUNC(Py_mod_exec, boot_exec),
    PySlot_END,
};

PyMODEXPORT_FUNC PyModExport_outofcuda_hook(void)
{
    return oc_export(boot_slots);
}
#endif /* OC_ABI3T */
