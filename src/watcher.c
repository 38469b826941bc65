/* watcher.c - the engine's half of the import watcher. The finder itself is
 * the boot module's (boot.c, on sys.meta_path from start-up); it hands each
 * "torch" lookup to _find_torch_spec here, which runs the bridge once, right
 * after torch's module has executed. The semantics follow a post-import hook:
 * ask the other finders for torch's real spec, wrap its loader, give the
 * module its real loader back before it runs. */
#include "oc.h"

#include <structmember.h>

typedef struct {
    OC_OBJECT_HEAD
    PyObject *loader;   /* torch's real loader */
    PyObject *module;   /* a torch that already ran, handed back by this loader, or NULL */
    PyObject *weakrefs; /* weakref.ref(spec.loader) works, as for the loader itself */
} proxy_object;

/* The watcher's own state (process-wide, under the GIL: see oc.h). */
static PyObject *engine_module; /* borrowed: lives in sys.modules as long as the engine */
static PyObject *proxy_type;
/* torch, fully loaded, that importlib dropped from sys.modules when an
 * interrupt in a thread other than the main one was raised from its import;
 * the next import hands it back. */
static PyObject *torch_dropped;

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
        OC_CLEAR();
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
        OC_CLEAR();
    PyErr_Restore(exc_type, exc_value, exc_tb);
}

/* ---- the loader proxy ---- */

static int proxy_traverse(PyObject *self, visitproc visit, void *arg)
{
    Py_VISIT(OC_FIELDS(proxy_object, self)->loader);
    Py_VISIT(OC_FIELDS(proxy_object, self)->module);
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static int proxy_clear(PyObject *self)
{
    Py_CLEAR(OC_FIELDS(proxy_object, self)->loader);
    Py_CLEAR(OC_FIELDS(proxy_object, self)->module);
    return 0;
}

static void proxy_dealloc(PyObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    PyObject_GC_UnTrack(self);
    if (OC_FIELDS(proxy_object, self)->weakrefs != NULL)
        PyObject_ClearWeakRefs(self);
    proxy_clear(self);
    tp_free(self);
    Py_DECREF(tp);
}

static PyObject *py_create_module(PyObject *self, PyObject *spec)
{
    PyObject *loader = OC_FIELDS(proxy_object, self)->loader;
    PyObject *fn, *res;
    if (OC_FIELDS(proxy_object, self)->module != NULL) {
        Py_INCREF(OC_FIELDS(proxy_object, self)->module);
        return OC_FIELDS(proxy_object, self)->module;
    }
    fn = PyObject_GetAttrString(loader, "create_module");
    if (fn == NULL) {
        /* Loaders without create_module get the default module. */
        OC_CLEAR();
        Py_RETURN_NONE;
    }
    res = PyObject_CallFunctionObjArgs(fn, spec, NULL);
    Py_DECREF(fn);
    return res;
}

/* Puts the real loader back where the proxy itself sits, before torch's code
 * runs: a proxy left there broke pkg_resources (wrapt issue 221). `slot` is
 * module.__loader__ or __spec__.loader; an import tool in front of the
 * watcher may have put its own wrapper there, holding the proxy as its
 * `loader` (ddtrace, wrapt): then the wrapper stays, and only its inner
 * reference becomes the real loader, so the tool later restores the real one,
 * as it would without outofcuda. */
static void restore_in(PyObject *self, PyObject *holder, const char *attr, PyObject *loader)
{
    PyObject *slot = PyObject_GetAttrString(holder, attr), *inner;
    if (slot == NULL) {
        OC_CLEAR();
        return;
    }
    if (slot == self) {
        if (PyObject_SetAttrString(holder, attr, loader) < 0)
            OC_CLEAR();
    } else if (slot != Py_None && slot != loader) {
        inner = oc_getattr_chain(slot, "loader");
        if (inner == self && PyObject_SetAttrString(slot, "loader", loader) < 0)
            OC_CLEAR();
        Py_XDECREF(inner);
    }
    Py_DECREF(slot);
}

static void restore_loader(PyObject *self, PyObject *module, PyObject *loader)
{
    PyObject *spec;
    restore_in(self, module, "__loader__", loader);
    spec = PyObject_GetAttrString(module, "__spec__");
    OC_CLEAR();
    if (spec != NULL && spec != Py_None)
        restore_in(self, spec, "loader", loader);
    Py_XDECREF(spec);
}

static void fire(PyObject *fallback_module)
{
    PyObject *torch;
    /* The callback runs once per process: report.c keeps whether it ran. */
    if (oc_report_hook_fired())
        return;
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

/* ---- a Ctrl-C after torch's __init__ ----
 *
 * A KeyboardInterrupt or SystemExit that arrives during outofcuda's work
 * after torch's __init__ finished is the program's, but raised from
 * exec_module it would make importlib drop the fully loaded torch from
 * sys.modules (_load_unlocked removes the module whenever exec_module
 * raises), and torch's own code cannot run twice in a process.
 *
 * In the main thread, where CPython raises every Ctrl-C, it is raised once
 * the import has returned, by a pending call (Py_AddPendingCall): the main
 * thread runs one at its next check, which comes right after exec_module
 * returns, still inside importlib's try, so the call puts itself back until
 * torch's spec says its import has ended (a few checks), then raises the
 * exception as it was (a SystemExit stays one). PyErr_SetInterrupt() would
 * raise at that first check, inside the try.
 *
 * In another thread, no signal is ever raised: a KeyboardInterrupt there
 * was raised by code, and a SystemExit ends that thread alone. Handing it to
 * the main thread would move it, so it stays with its thread and is raised
 * from that thread's import; torch is kept (torch_dropped) and the next
 * `import torch`, in any thread, gets that same module back through the
 * watcher instead of running torch's __init__ a second time. */

/* The pending call. arg, a tuple the call owns: torch's spec (or None) and
 * the interrupt, taken out of the thread's state so that the edge of
 * exec_module does not raise it. Once the spec says the import has ended,
 * the interrupt goes back to the thread's state, and the call's edge raises
 * it. Not sys.modules: importlib takes torch out and puts it back (to move
 * it to the end) after exec_module, with a check between. Reads the spec's
 * attribute only: no Python code runs. */
static int raise_after_import(void *arg);
OC_EDGE_PENDING_CALL(raise_after_import)

static int raise_after_import(void *arg)
{
    PyObject *carried = arg, *taken;
    PyObject *initializing = PyObject_GetAttrString(PyTuple_GetItem(carried, 0), "_initializing");
    int running = initializing != NULL && PyObject_IsTrue(initializing) == 1;
    Py_XDECREF(initializing);
    OC_CLEAR_ABSENT(); /* no flag, no import running */
    if (running && Py_AddPendingCall(edge_raise_after_import, carried) == 0)
        return 0;
    taken = PyTuple_GetItem(carried, 1);
    Py_INCREF(taken);
    Py_DECREF(carried);
    return oc_interrupt_put_back(taken);
}

static int in_main_thread(void)
{
    PyObject *threading = PyImport_ImportModule("threading");
    PyObject *main = threading ? PyObject_CallMethod(threading, "main_thread", NULL) : NULL;
    PyObject *ident = main ? PyObject_GetAttrString(main, "ident") : NULL;
    int res = ident != NULL && PyLong_AsUnsignedLong(ident) == PyThread_get_thread_ident();
    Py_XDECREF(ident);
    Py_XDECREF(main);
    Py_XDECREF(threading);
    OC_CLEAR();
    return res;
}

/* After torch's module ran: 0 when no interrupt waits in this thread, or
 * when the pending call took it; else -1, torch kept, and the interrupt left
 * for the edge of exec_module to raise. */
static int interrupt_after_exec(PyObject *module)
{
    PyObject *spec, *taken = NULL, *carried;
    if (!oc_interrupt_waiting())
        return 0;
    if (in_main_thread()) {
        spec = PyObject_GetAttrString(module, "__spec__");
        OC_CLEAR_ABSENT(); /* no spec, raised at the first check */
        taken = oc_interrupt_take();
        carried = taken != NULL ? PyTuple_Pack(2, spec ? spec : Py_None, taken) : NULL;
        Py_XDECREF(spec);
        if (carried != NULL && Py_AddPendingCall(edge_raise_after_import, carried) == 0) {
            Py_DECREF(taken);
            return 0;
        }
        Py_XDECREF(carried);
        OC_CLEAR(); /* no room for the pending call: raised from the import, as below */
    }
    if (torch_dropped == NULL) {
        torch_dropped = oc_sys_module("torch");
        if (torch_dropped == NULL) {
            torch_dropped = module;
            Py_INCREF(module);
        }
    }
    if (taken != NULL)
        (void)oc_interrupt_put_back(taken); /* -1: raised now, which the edge leaves as it is */
    return -1;
}

static PyObject *py_exec_module(PyObject *self, PyObject *module)
{
    PyObject *loader = OC_FIELDS(proxy_object, self)->loader;
    PyObject *spec, *res;
    Py_INCREF(loader);
    restore_loader(self, module, loader);
    if (OC_FIELDS(proxy_object, self)->module != NULL) {
        /* torch dropped by an interrupt in another thread, back in sys.modules */
        Py_CLEAR(OC_FIELDS(proxy_object, self)->module);
        Py_CLEAR(torch_dropped);
        Py_DECREF(loader);
        Py_RETURN_NONE;
    }
    if (!oc_bridge_prepared()) {
        spec = PyObject_GetAttrString(module, "__spec__");
        if (spec == NULL)
            OC_CLEAR();
        oc_bridge_before_torch(spec);
        Py_XDECREF(spec);
        if (oc_interrupt_waiting()) {
            Py_DECREF(loader);
            return NULL; /* torch's code never ran: the edge raises the interrupt */
        }
    }
    res = PyObject_CallMethod(loader, "exec_module", "O", module);
    Py_DECREF(loader);
    if (res == NULL) {
        /* torch's own error; a later successful import prepares and fires.
         * A Ctrl-C set aside meanwhile outranks it (the edge raises it). */
        PyObject *exc_type, *exc_value, *exc_tb;
        PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
        oc_bridge_import_failed();
        PyErr_Restore(exc_type, exc_value, exc_tb);
        return NULL;
    }
    Py_DECREF(res);
    fire(module);
    if (interrupt_after_exec(module) < 0)
        return NULL; /* the edge raises the interrupt, torch kept */
    Py_RETURN_NONE;
}

/* Everything else (get_code, is_package, get_resource_reader, ...) is the real
 * loader's: python -m torch.utils.collect_env and importlib.resources ask. */
static PyObject *proxy_getattro(PyObject *self, PyObject *name)
{
    PyObject *res = PyObject_GenericGetAttr(self, name);
    if (res != NULL || !PyErr_ExceptionMatches(PyExc_AttributeError))
        return res;
    OC_CLEAR();
    return PyObject_GetAttr(OC_FIELDS(proxy_object, self)->loader, name);
}

/* Writes and deletes go to the real loader: import tools set attributes on
 * the loader they are handed (ddtrace replaces get_code), and the real
 * loader's exec_module must see them. */
static int proxy_setattro(PyObject *self, PyObject *name, PyObject *value)
{
    PyObject *loader = OC_FIELDS(proxy_object, self)->loader;
    if (value == NULL)
        return PyObject_DelAttr(loader, name);
    return PyObject_SetAttr(loader, name, value);
}

/* __class__ is the real loader's, so isinstance() against its class or
 * against importlib.abc.Loader answers as it would for the loader itself
 * (isinstance consults __class__ when type() does not match). */
static PyObject *proxy_class(PyObject *self, void *closure)
{
    (void)closure;
    return PyObject_GetAttrString(OC_FIELDS(proxy_object, self)->loader, "__class__");
}

static PyObject *proxy_richcompare(PyObject *self, PyObject *other, int op)
{
    return PyObject_RichCompare(OC_FIELDS(proxy_object, self)->loader, other, op);
}

static Py_hash_t proxy_hash(PyObject *self)
{
    return PyObject_Hash(OC_FIELDS(proxy_object, self)->loader);
}

OC_EDGE_GETTER(proxy_class)

static PyGetSetDef proxy_getset[] = {
    OC_GETTER("__class__", proxy_class, NULL),
    {NULL, NULL, NULL, NULL, NULL},
};

/* copy.copy, copy.deepcopy and pickle reduce the proxy as the real loader:
 * what they make is a copy of that loader (its class, its state), unwatched. */
static PyObject *py_reduce_ex(PyObject *self, PyObject *protocol)
{
    return PyObject_CallMethod(OC_FIELDS(proxy_object, self)->loader, "__reduce_ex__", "O",
                               protocol);
}

static PyObject *proxy_repr(PyObject *self)
{
    return PyUnicode_FromFormat("<outofcuda loader proxy for %R>",
                                OC_FIELDS(proxy_object, self)->loader);
}

OC_EDGE_O(py_create_module)
OC_EDGE_O(py_exec_module)
OC_EDGE_O(py_reduce_ex)

static PyMethodDef proxy_methods[] = {
    OC_METHOD("create_module", py_create_module, NULL),
    OC_METHOD("exec_module", py_exec_module, NULL),
    OC_METHOD("__reduce_ex__", py_reduce_ex, NULL),
    {NULL, NULL, 0, NULL},
};

/* The abi3t build keeps the fields in the type's data, where no member can
 * name them: its proxy takes no weak reference. */
static PyMemberDef proxy_members[] = {
#ifndef OC_ABI3T
    {"__weaklistoffset__", T_PYSSIZET, offsetof(proxy_object, weakrefs), READONLY, NULL},
#endif
    {NULL, 0, 0, 0, NULL},
};

OC_EDGE_GETATTRO(proxy_getattro)
OC_EDGE_SETATTRO(proxy_setattro)
OC_EDGE_RICHCOMPARE(proxy_richcompare)
OC_EDGE_HASH(proxy_hash)
OC_EDGE_REPR(proxy_repr)

/* dealloc, traverse and clear cannot raise: nothing for an edge to do. */
static PyType_Slot proxy_slots[] = {
    {Py_tp_dealloc, (void *)proxy_dealloc},
    {Py_tp_traverse, (void *)proxy_traverse},
    {Py_tp_clear, (void *)proxy_clear},
    OC_SLOT(proxy_getattro),
    OC_SLOT(proxy_setattro),
    {Py_tp_getset, proxy_getset},
    OC_SLOT(proxy_richcompare),
    OC_SLOT(proxy_hash),
    OC_SLOT(proxy_repr),
    {Py_tp_methods, proxy_methods},
    {Py_tp_members, proxy_members},
    {0, NULL},
};

static PyType_Spec proxy_spec = {
    "_outofcuda.LoaderProxy",
    OC_BASICSIZE(proxy_object),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    proxy_slots,
};

static PyObject *make_proxy(PyObject *loader, PyObject *module)
{
    PyObject *p;
    if (proxy_type == NULL) {
        proxy_type = PyType_FromSpec(&proxy_spec);
        if (proxy_type == NULL)
            return NULL;
    }
    p = PyType_GenericAlloc((PyTypeObject *)proxy_type, 0);
    if (p == NULL)
        return NULL;
    Py_INCREF(loader);
    OC_FIELDS(proxy_object, p)->loader = loader;
    Py_XINCREF(module);
    OC_FIELDS(proxy_object, p)->module = module;
    return p;
}

/* ---- the torch lookup ---- */

/* Asks the meta-path finders after `self`, in order, for the spec of `name`
 * (all of them when `self` is not on the list: a direct call). The finders in
 * front of the watcher have already been asked by the import system, or are
 * asking right now: an import tool there that asks the rest would run twice
 * for one import. Returns a new reference (Py_None when none found) or NULL
 * with an error. */
static PyObject *find_with_others(PyObject *self, PyObject *name, PyObject *path, PyObject *target)
{
    PyObject *meta_path = PySys_GetObject("meta_path"); /* borrowed */
    PyObject *snapshot, *spec = NULL;
    Py_ssize_t n, start = 0;
    if (meta_path == NULL || !PyList_Check(meta_path))
        Py_RETURN_NONE;
    snapshot = PySequence_List(meta_path);
    if (snapshot == NULL)
        return NULL;
    n = PyList_Size(snapshot);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyList_GetItem(snapshot, i) == self) {
            start = i + 1;
            break;
        }
    }
    for (Py_ssize_t i = start; i < n; i++) {
        PyObject *f = PyList_GetItem(snapshot, i); /* borrowed */
        PyObject *fn;
        if (f == self)
            continue;
        fn = PyObject_GetAttrString(f, "find_spec");
        if (fn == NULL) {
            /* A legacy finder without find_spec: the import system handles it. */
            OC_CLEAR();
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

/* The spec that hands back the torch an interrupt in another thread made
 * importlib drop (torch_dropped): its own spec, with a loader whose
 * create_module returns that module and whose exec_module runs nothing. */
static PyObject *dropped_torch_spec(void)
{
    PyObject *spec, *loader, *proxy;
    PyObject *now = PyDict_GetItemString(PyImport_GetModuleDict(), "torch"); /* borrowed */
    if (now != NULL) {
        /* imported again some other way: that one stands */
        Py_CLEAR(torch_dropped);
        Py_RETURN_NONE;
    }
    spec = PyObject_GetAttrString(torch_dropped, "__spec__");
    loader = spec && spec != Py_None ? PyObject_GetAttrString(spec, "loader") : NULL;
    proxy = loader ? make_proxy(loader, torch_dropped) : NULL;
    Py_XDECREF(loader);
    if (proxy == NULL || PyObject_SetAttrString(spec, "loader", proxy) < 0) {
        oc_set_error("handing back the torch an interrupt left out of sys.modules");
        Py_XDECREF(proxy);
        Py_XDECREF(spec);
        Py_CLEAR(torch_dropped); /* the import system finds torch as it would */
        Py_RETURN_NONE;
    }
    Py_DECREF(proxy);
    return spec;
}

/* _find_torch_spec(finder, fullname, path=None, target=None): the boot's
 * finder hands every "torch" lookup here. None after the hook fired; else
 * torch's real spec with the loader wrapped. `finder` is skipped when the
 * other finders are asked. */
static PyObject *py_find_torch_spec(PyObject *module, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"finder", "fullname", "path", "target", NULL};
    PyObject *self, *name, *path = Py_None, *target = Py_None, *spec, *loader, *proxy, *exec_module;
    (void)module;
    if (oc_report_hook_has_fired() && torch_dropped == NULL)
        Py_RETURN_NONE;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OU|OO:find_spec", kwlist, &self, &name, &path,
                                     &target))
        return NULL;
    if (PyUnicode_CompareWithASCIIString(name, "torch") != 0)
        Py_RETURN_NONE;
    if (oc_report_hook_has_fired())
        return dropped_torch_spec();
    if (guard_enter())
        Py_RETURN_NONE;
    spec = find_with_others(self, name, path, target);
    guard_leave();
    if (spec == NULL || spec == Py_None)
        return spec;
    loader = PyObject_GetAttrString(spec, "loader");
    if (loader == NULL) {
        OC_CLEAR();
        return spec;
    }
    /* A namespace package has no loader; a loader without exec_module is one
     * the import system drives differently: leave both alone. */
    /* torch's loader is foreign code: PyObject_HasAttrString would swallow
     * a Ctrl-C raised in its __getattr__, this sets it aside for the edge. */
    exec_module = loader == Py_None ? NULL : PyObject_GetAttrString(loader, "exec_module");
    if (exec_module == NULL) {
        OC_CLEAR_ABSENT(); /* no exec_module */
        Py_DECREF(loader);
        return spec;
    }
    Py_DECREF(exec_module);
    proxy = make_proxy(loader, NULL);
    Py_DECREF(loader);
    if (proxy == NULL || PyObject_SetAttrString(spec, "loader", proxy) < 0)
        oc_set_error("wrapping torch's loader failed");
    Py_XDECREF(proxy);
    return spec;
}

OC_EDGE_KEYWORDS(py_find_torch_spec)

PyMethodDef oc_watcher_methods[] = {
    OC_METHOD(OC_ENGINE_FIND_SPEC, py_find_torch_spec,
              "_find_torch_spec(finder, fullname, path=None, target=None)\n--\n\nThe torch "
              "lookup of the boot's finder."),
    {NULL, NULL, 0, NULL},
};

/* ---- the boot module that owns the finder ---- */

/* The boot module: the one in sys.modules when it is outofcuda's (the hook
 * imported it), else loaded by path from the engine's own directory, never by
 * name (the working directory may be on sys.path). New reference or NULL. */
static PyObject *boot_module(void)
{
    PyObject *mod = PyDict_GetItemString(PyImport_GetModuleDict(), OC_BOOT_NAME);
    if (mod != NULL && PyObject_HasAttrString(mod, "_install")) {
        Py_INCREF(mod);
        return mod;
    }
    if (engine_module == NULL) {
        PyErr_SetString(PyExc_ImportError, "outofcuda's engine was not initialised");
        return NULL;
    }
    mod = oc_load_sibling(engine_module, OC_ENGINE_NAME, OC_BOOT_NAME);
    if (mod != NULL && PyDict_GetItemString(PyImport_GetModuleDict(), OC_BOOT_NAME) == NULL &&
        PyDict_SetItemString(PyImport_GetModuleDict(), OC_BOOT_NAME, mod) < 0)
        Py_CLEAR(mod);
    return mod;
}

/* Called from module_exec: the hook may have installed the boot's finder long
 * before the engine loads. */
int oc_watcher_init(PyObject *module)
{
    PyObject *boot = PyDict_GetItemString(PyImport_GetModuleDict(), OC_BOOT_NAME), *f;
    engine_module = module;
    if (boot == NULL || !PyObject_HasAttrString(boot, "_finder"))
        return 0;
    f = PyObject_CallMethod(boot, "_finder", NULL);
    OC_CLEAR();
    if (f != NULL && f != Py_None)
        oc_report_hook_installed();
    Py_XDECREF(f);
    return 0;
}

int oc_watcher_install(void)
{
    PyObject *boot = boot_module(), *f;
    if (boot == NULL)
        return -1;
    f = PyObject_CallMethod(boot, "_install", NULL);
    Py_DECREF(boot);
    if (f == NULL)
        return -1;
    Py_DECREF(f);
    oc_report_hook_installed();
    return 0;
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
    OC_CLEAR();
    if (initializing != NULL)
        busy = PyObject_IsTrue(initializing) == 1;
    /* A stand-in the program put in sys.modules itself (a mock, a bare
     * module) was never imported: it has no spec. Firing on it would spend
     * the one firing; the watcher waits for the real torch instead. */
    if (spec == NULL || spec == Py_None)
        busy = 1;
    Py_XDECREF(initializing);
    Py_XDECREF(spec);
    if (!busy)
        fire(torch);
    Py_DECREF(torch);
    return 0; /* an interrupt set aside meanwhile: install()'s edge raises it */
}
