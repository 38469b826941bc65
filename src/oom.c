/* oom.c - what outofcuda does when CUDA runs out of memory: the chained
 * exception hooks (and, later, torch's OOM observer and the report). */
#include "oc.h"

#include <stdio.h>
#include <string.h>

static PyObject *prev_sys_hook, *prev_thread_hook, *oom_type;

static void oom_relief(void)
{
    PyObject *torch_cuda = PyImport_ImportModule("torch.cuda");
    PyObject *r, *alloc = NULL, *reserved = NULL, *peak = NULL;
    double gib = 1024.0 * 1024.0 * 1024.0;
    if (torch_cuda == NULL) {
        PyErr_Clear();
        return;
    }
    r = PyObject_CallMethod(torch_cuda, "empty_cache", NULL);
    Py_XDECREF(r);
    PyErr_Clear();
    if (oc_config_get()->gc_collect) {
        PyObject *gc = PyImport_ImportModule("gc");
        r = gc ? PyObject_CallMethod(gc, "collect", NULL) : NULL;
        Py_XDECREF(r);
        Py_XDECREF(gc);
        PyErr_Clear();
    }
    alloc = PyObject_CallMethod(torch_cuda, "memory_allocated", NULL);
    reserved = PyObject_CallMethod(torch_cuda, "memory_reserved", NULL);
    peak = PyObject_CallMethod(torch_cuda, "max_memory_allocated", NULL);
    PyErr_Clear();
    PySys_WriteStderr(
        "outofcuda: CUDA out of memory. After emptying the cache: allocated %.2f GiB, "
        "reserved %.2f GiB, peak allocated %.2f GiB.\n",
        alloc ? PyLong_AsDouble(alloc) / gib : 0.0, reserved ? PyLong_AsDouble(reserved) / gib : 0.0,
        peak ? PyLong_AsDouble(peak) / gib : 0.0);
    PyErr_Clear();
    Py_XDECREF(alloc);
    Py_XDECREF(reserved);
    Py_XDECREF(peak);
    Py_DECREF(torch_cuda);
}

static int is_oom(PyObject *type)
{
    int r;
    if (oom_type == NULL || type == NULL || !PyType_Check(type))
        return 0;
    r = PyObject_IsSubclass(type, oom_type);
    if (r < 0)
        PyErr_Clear();
    return r == 1;
}

/* If outofcuda's Python layer is loaded and offers a richer report, let it
 * speak; the C summary above is the fallback. */
static void oom_python_report(PyObject *value)
{
    PyObject *name = PyUnicode_FromString("outofcuda._oom");
    PyObject *mod = name ? PyImport_GetModule(name) : NULL;
    Py_XDECREF(name);
    if (mod == NULL) {
        PyErr_Clear();
        return;
    }
    {
        PyObject *r = PyObject_CallMethod(mod, "_on_uncaught", "O", value);
        Py_XDECREF(r);
        PyErr_Clear();
    }
    Py_DECREF(mod);
}

static PyObject *sys_excepthook(PyObject *self, PyObject *args)
{
    PyObject *type, *value, *tb;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOO", &type, &value, &tb))
        return NULL;
    if (is_oom(type)) {
        oom_relief();
        oom_python_report(value);
    }
    if (prev_sys_hook != NULL)
        return PyObject_CallObject(prev_sys_hook, args);
    Py_RETURN_NONE;
}

static PyObject *thread_excepthook(PyObject *self, PyObject *hook_args)
{
    PyObject *type = PyObject_GetAttrString(hook_args, "exc_type");
    (void)self;
    if (type == NULL)
        PyErr_Clear();
    else if (is_oom(type)) {
        PyObject *value = PyObject_GetAttrString(hook_args, "exc_value");
        PyErr_Clear();
        oom_relief();
        oom_python_report(value ? value : Py_None);
        Py_XDECREF(value);
    }
    Py_XDECREF(type);
    if (prev_thread_hook != NULL)
        return PyObject_CallFunctionObjArgs(prev_thread_hook, hook_args, NULL);
    Py_RETURN_NONE;
}

static PyMethodDef sys_hook_def = {"outofcuda_excepthook", sys_excepthook, METH_VARARGS,
                                   "outofcuda's OOM handler; chains to the previous hook."};
static PyMethodDef thread_hook_def = {"outofcuda_threading_excepthook", thread_excepthook, METH_O,
                                      "outofcuda's OOM handler; chains to the previous hook."};

void oc_oom_install(PyObject *torch)
{
    PyObject *threading, *hook;
    oom_type = oc_getattr_chain(torch, "cuda.OutOfMemoryError");
    if (oom_type == NULL) {
        oc_result_set("oom_handler", 0, NULL, "this torch has no torch.cuda.OutOfMemoryError");
        return;
    }
    prev_sys_hook = PySys_GetObject("excepthook");
    Py_XINCREF(prev_sys_hook);
    hook = PyCFunction_NewEx(&sys_hook_def, NULL, NULL);
    if (hook == NULL || PySys_SetObject("excepthook", hook) < 0) {
        Py_XDECREF(hook);
        oc_set_error("installing sys.excepthook");
        oc_result_set("oom_handler", 0, NULL, "sys.excepthook could not be set");
        return;
    }
    Py_DECREF(hook);
    /* threading is imported by torch already; this only looks it up. */
    threading = PyImport_ImportModule("threading");
    if (threading != NULL) {
        prev_thread_hook = PyObject_GetAttrString(threading, "excepthook");
        hook = prev_thread_hook ? PyCFunction_NewEx(&thread_hook_def, NULL, NULL) : NULL;
        if (hook == NULL || PyObject_SetAttrString(threading, "excepthook", hook) < 0)
            PyErr_Clear();
        Py_XDECREF(hook);
        Py_DECREF(threading);
    }
    PyErr_Clear();
    {
        PyObject *v = PyUnicode_FromString("sys.excepthook + threading.excepthook");
        oc_result_set("oom_handler", 1, v,
                      "on an uncaught CUDA OOM: empty the cache, collect garbage, print a "
                      "memory summary, then the usual traceback");
        Py_XDECREF(v);
    }
}

PyMethodDef oc_oom_methods[] = {
    {NULL, NULL, 0, NULL},
};
