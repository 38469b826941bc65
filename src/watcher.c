/* watcher.c - notices `import torch` from sys.meta_path and runs the bridge
 * once, right after torch's module has executed. The semantics follow a
 * post-import hook: ask the other finders for torch's real spec, wrap its
 * loader, give the module its real loader back before it runs. */
#include "oc.h"

#include <structmember.h>

typedef struct {
    PyObject_HEAD
    PyObject *dict; /* tools patch finders with setattr(finder, "find_spec", ...) */
} finder_object;

typedef struct {
    PyObject_HEAD
    PyObject *loader; /* torch's real loader */
} proxy_object;

static const char guard_key[] = "outofcuda.finding_torch";

/* Returns 1 when this thread is already inside find_spec("torch"). */
static int guard_enter(void)
{
    PyObject *d = PyThreadState_GetDict();
    if (d == NULL)
        return 0;
    if (PyDict_GetItemString(d, guard_key) != NULL)
        return 1;
    if (PyDict_SetItemString(d, guard_key, Py_True) < 0)
        PyErr_Clear();
    return 0;
}

static void guard_leave(void)
{
    PyObject *d = PyThreadState_GetDict();
    PyObject *exc_type, *exc_value, *exc_tb;
    if (d == NULL)
        return;
    PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
    if (PyDict_DelItemString(d, guard_key) < 0)
        PyErr_Clear();
    PyErr_Restore(exc_type, exc_value, exc_tb);
}

/* ---- the loader proxy ---- */

static int proxy_traverse(PyObject *self, visitproc visit, void *arg)
{
    Py_VISIT(((proxy_object *)self)->loader);
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static int proxy_clear(PyObject *self)
{
    Py_CLEAR(((proxy_object *)self)->loader);
    return 0;
}

static void proxy_dealloc(PyObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    PyObject_GC_UnTrack(self);
    proxy_clear(self);
    tp_free(self);
    Py_DECREF(tp);
}

static PyObject *proxy_create_module(PyObject *self, PyObject *spec)
{
    PyObject *loader = ((proxy_object *)self)->loader;
    PyObject *fn = PyObject_GetAttrString(loader, "create_module");
    PyObject *res;
    if (fn == NULL) {
        /* Loaders without create_module get the default module. */
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    res = PyObject_CallFunctionObjArgs(fn, spec, NULL);
    Py_DECREF(fn);
    return res;
}

/* Puts the real loader back on the module and its spec before torch's code
 * runs: a proxy left there broke pkg_resources (wrapt issue 221). */
static void restore_loader(PyObject *module, PyObject *loader)
{
    PyObject *spec;
    if (PyObject_SetAttrString(module, "__loader__", loader) < 0)
        PyErr_Clear();
    spec = PyObject_GetAttrString(module, "__spec__");
    if (spec == NULL) {
        PyErr_Clear();
        return;
    }
    if (spec != Py_None && PyObject_SetAttrString(spec, "loader", loader) < 0)
        PyErr_Clear();
    Py_DECREF(spec);
}

static void fire(PyObject *fallback_module)
{
    PyObject *torch;
    if (oc_g.fired)
        return;
    oc_g.fired = 1;
    /* torch may have replaced itself in sys.modules; prefer that object. */
    torch = oc_sys_module("torch");
    if (torch == NULL) {
        torch = fallback_module;
        Py_XINCREF(torch);
    }
    if (torch != NULL) {
        oc_bridge_after_torch(torch);
        Py_DECREF(torch);
    }
}

static PyObject *proxy_exec_module(PyObject *self, PyObject *module)
{
    PyObject *loader = ((proxy_object *)self)->loader;
    PyObject *spec, *res;
    Py_INCREF(loader);
    restore_loader(module, loader);
    if (!oc_g.prepared) {
        oc_g.prepared = 1;
        spec = PyObject_GetAttrString(module, "__spec__");
        if (spec == NULL)
            PyErr_Clear();
        oc_bridge_before_torch(spec);
        Py_XDECREF(spec);
    }
    res = PyObject_CallMethod(loader, "exec_module", "O", module);
    Py_DECREF(loader);
    if (res == NULL) {
        /* torch's own error; a later successful import prepares and fires */
        PyObject *exc_type, *exc_value, *exc_tb;
        PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
        oc_bridge_import_failed();
        PyErr_Restore(exc_type, exc_value, exc_tb);
        return NULL;
    }
    Py_DECREF(res);
    fire(module);
    Py_RETURN_NONE;
}

/* Everything else (get_code, is_package, get_resource_reader, ...) is the real
 * loader's: python -m torch.utils.collect_env and importlib.resources ask. */
static PyObject *proxy_getattro(PyObject *self, PyObject *name)
{
    PyObject *res = PyObject_GenericGetAttr(self, name);
    if (res != NULL || !PyErr_ExceptionMatches(PyExc_AttributeError))
        return res;
    PyErr_Clear();
    return PyObject_GetAttr(((proxy_object *)self)->loader, name);
}

static PyObject *proxy_repr(PyObject *self)
{
    return PyUnicode_FromFormat("<outofcuda loader proxy for %R>", ((proxy_object *)self)->loader);
}

static PyMethodDef proxy_methods[] = {
    {"create_module", proxy_create_module, METH_O, NULL},
    {"exec_module", proxy_exec_module, METH_O, NULL},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot proxy_slots[] = {
    {Py_tp_dealloc, (void *)proxy_dealloc},
    {Py_tp_traverse, (void *)proxy_traverse},
    {Py_tp_clear, (void *)proxy_clear},
    {Py_tp_getattro, (void *)proxy_getattro},
    {Py_tp_repr, (void *)proxy_repr},
    {Py_tp_methods, proxy_methods},
    {0, NULL},
};

static PyType_Spec proxy_spec = {
    "_outofcuda.LoaderProxy",
    sizeof(proxy_object),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    proxy_slots,
};

static PyObject *make_proxy(PyObject *loader)
{
    proxy_object *p;
    if (oc_g.proxy_type == NULL) {
        oc_g.proxy_type = PyType_FromSpec(&proxy_spec);
        if (oc_g.proxy_type == NULL)
            return NULL;
    }
    p = (proxy_object *)PyType_GenericAlloc((PyTypeObject *)oc_g.proxy_type, 0);
    if (p == NULL)
        return NULL;
    Py_INCREF(loader);
    p->loader = loader;
    return (PyObject *)p;
}

/* ---- the finder ---- */

/* Asks the other meta-path finders, in order, for the spec of `name`.
 * Returns a new reference (Py_None when none found) or NULL with an error. */
static PyObject *find_with_others(PyObject *self, PyObject *name, PyObject *path, PyObject *target)
{
    PyObject *meta_path = PySys_GetObject("meta_path"); /* borrowed */
    PyObject *snapshot, *spec = NULL;
    Py_ssize_t n;
    if (meta_path == NULL || !PyList_Check(meta_path))
        Py_RETURN_NONE;
    snapshot = PySequence_List(meta_path);
    if (snapshot == NULL)
        return NULL;
    n = PyList_Size(snapshot);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *f = PyList_GetItem(snapshot, i); /* borrowed */
        PyObject *fn;
        if (f == self)
            continue;
        fn = PyObject_GetAttrString(f, "find_spec");
        if (fn == NULL) {
            /* A legacy finder without find_spec: the import system handles it. */
            PyErr_Clear();
            continue;
        }
        spec = PyObject_CallFunctionObjArgs(fn, name, path, target, NULL);
        Py_DECREF(fn);
        if (spec == NULL || spec != Py_None)
            break;
        Py_DECREF(spec);
        spec = NULL;
    }
    Py_DECREF(snapshot);
    if (spec == NULL && !PyErr_Occurred())
        Py_RETURN_NONE;
    return spec;
}

/* find_spec(name, path=None, target=None): None for every module but a first
 * import of torch; for torch, its real spec with the loader wrapped. */
static PyObject *finder_find_spec(PyObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"fullname", "path", "target", NULL};
    PyObject *name, *path = Py_None, *target = Py_None, *spec, *loader, *proxy;
    PyObject *first = PyTuple_Size(args) > 0 ? PyTuple_GetItem(args, 0) : NULL;
    /* Every import of the process passes here (importlib calls positionally):
     * answer "not torch" before any argument parsing. */
    if (oc_g.fired || (first != NULL && PyUnicode_Check(first) &&
                       PyUnicode_CompareWithASCIIString(first, "torch") != 0))
        Py_RETURN_NONE;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "U|OO:find_spec", kwlist, &name, &path, &target))
        return NULL;
    if (PyUnicode_CompareWithASCIIString(name, "torch") != 0)
        Py_RETURN_NONE;
    if (guard_enter())
        Py_RETURN_NONE;
    spec = find_with_others(self, name, path, target);
    guard_leave();
    if (spec == NULL || spec == Py_None)
        return spec;
    loader = PyObject_GetAttrString(spec, "loader");
    if (loader == NULL) {
        PyErr_Clear();
        return spec;
    }
    /* A namespace package has no loader; a loader without exec_module is one
     * the import system drives differently: leave both alone. */
    if (loader == Py_None || !PyObject_HasAttrString(loader, "exec_module")) {
        Py_DECREF(loader);
        return spec;
    }
    proxy = make_proxy(loader);
    Py_DECREF(loader);
    if (proxy == NULL || PyObject_SetAttrString(spec, "loader", proxy) < 0) {
        oc_set_error("wrapping torch's loader failed");
        Py_XDECREF(proxy);
        return spec;
    }
    Py_DECREF(proxy);
    return spec;
}

static PyObject *finder_repr(PyObject *self)
{
    (void)self;
    return PyUnicode_FromString("<outofcuda torch import watcher>");
}

static PyObject *finder_invalidate_caches(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    Py_RETURN_NONE;
}

static int finder_traverse(PyObject *self, visitproc visit, void *arg)
{
    Py_VISIT(((finder_object *)self)->dict);
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static int finder_clear(PyObject *self)
{
    Py_CLEAR(((finder_object *)self)->dict);
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

static PyMethodDef finder_methods[] = {
    {"find_spec", (PyCFunction)(void (*)(void))finder_find_spec, METH_VARARGS | METH_KEYWORDS,
     NULL},
    {"invalidate_caches", finder_invalidate_caches, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef finder_members[] = {
    {"__dictoffset__", T_PYSSIZET, offsetof(finder_object, dict), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot finder_slots[] = {
    {Py_tp_dealloc, (void *)finder_dealloc},
    {Py_tp_traverse, (void *)finder_traverse},
    {Py_tp_clear, (void *)finder_clear},
    {Py_tp_repr, (void *)finder_repr},
    {Py_tp_methods, finder_methods},
    {Py_tp_members, finder_members},
    {0, NULL},
};

static PyType_Spec finder_spec = {
    "_outofcuda.TorchImportWatcher",         sizeof(finder_object), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, finder_slots,
};

int oc_watcher_install(void)
{
    PyObject *meta_path;
    if (oc_g.finder == NULL) {
        if (oc_g.finder_type == NULL) {
            oc_g.finder_type = PyType_FromSpec(&finder_spec);
            if (oc_g.finder_type == NULL)
                return -1;
        }
        oc_g.finder = PyType_GenericAlloc((PyTypeObject *)oc_g.finder_type, 0);
        if (oc_g.finder == NULL)
            return -1;
    }
    meta_path = PySys_GetObject("meta_path"); /* borrowed */
    if (meta_path == NULL || !PyList_Check(meta_path)) {
        PyErr_SetString(PyExc_RuntimeError, "sys.meta_path is not a list");
        return -1;
    }
    if (PySequence_Contains(meta_path, oc_g.finder) == 1)
        return 0;
    /* First place: the watcher must see torch before PathFinder or an
     * editable-install finder claims it. */
    return PyList_Insert(meta_path, 0, oc_g.finder);
}

int oc_watcher_fire_if_imported(void)
{
    PyObject *name = PyUnicode_FromString("torch");
    PyObject *torch, *spec, *initializing = NULL;
    int busy = 0;
    if (name == NULL)
        return -1;
    torch = PyImport_GetModule(name);
    Py_DECREF(name);
    if (torch == NULL)
        return PyErr_Occurred() ? -1 : 0;
    /* A torch still executing its __init__ (another hook imports it right
     * now) fires through that import's loader, not here. */
    spec = PyObject_GetAttrString(torch, "__spec__");
    if (spec != NULL && spec != Py_None)
        initializing = PyObject_GetAttrString(spec, "_initializing");
    PyErr_Clear();
    if (initializing != NULL)
        busy = PyObject_IsTrue(initializing) == 1;
    Py_XDECREF(initializing);
    Py_XDECREF(spec);
    if (!busy)
        fire(torch);
    Py_DECREF(torch);
    return 0;
}
