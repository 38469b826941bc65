/* facts.c - verdicts the Python layer (the CLI, the API) asks for instead
 * of parsing the environment again: one owner for each fact, the same rules
 * the start-up path applies. */
#include "oc.h"

#include <stdlib.h>
#include <string.h>

/* _disabled_by_env() -> bool: OUTOFCUDA_DISABLE turns outofcuda off (as the
 * boot and the engine read it: C-locale blanks trimmed). */
static PyObject *py_disabled_by_env(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyBool_FromLong(oc_disabled_by_env());
}

/* _tf32_forced_off() -> bool: NVIDIA_TF32_OVERRIDE turns TF32 off in
 * NVIDIA's libraries (and outofcuda leaves TF32 alone). */
static PyObject *py_tf32_forced_off(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyBool_FromLong(oc_tf32_forced_off(oc_env("NVIDIA_TF32_OVERRIDE")));
}

/* _alloc_var(torch_version=None) -> (name, value or None): the allocator
 * variable that release reads and its value (None when unset; "" counts as
 * set from 2.11). An unknown version reads as a release before 2.11. */
static PyObject *py_alloc_var(PyObject *self, PyObject *args)
{
    const char *version = NULL, *name, *value;
    (void)self;
    if (!PyArg_ParseTuple(args, "|z", &version))
        return NULL;
    name = oc_alloc_user_var(version ? oc_torch_version_number(version) : 0, &value);
    if (value == NULL)
        return Py_BuildValue("(sO)", name, Py_None);
    return Py_BuildValue("(sN)", name,
                         PyUnicode_DecodeUTF8(value, (Py_ssize_t)strlen(value), "replace"));
}

/* _alloc_vars() -> tuple: the allocator variables in the order torch 2.11+
 * reads them. */
static PyObject *py_alloc_vars(PyObject *self, PyObject *unused)
{
    size_t n = 0;
    PyObject *t;
    (void)self;
    (void)unused;
    while (oc_alloc_var_at(n) != NULL)
        n++;
    t = PyTuple_New((Py_ssize_t)n);
    for (size_t i = 0; t != NULL && i < n; i++) {
        PyObject *name = PyUnicode_FromString(oc_alloc_var_at(i));
        if (name == NULL || PyTuple_SetItem(t, (Py_ssize_t)i, name) < 0)
            Py_CLEAR(t);
    }
    return t;
}

/* _alloc_items(conf) -> (items, split): an allocator string read as torch
 * reads it (a list of (key, value), a key given twice keeping its first place
 * and last value) and its max_split_size_mb rule ("inside_expandable",
 * "no_expandable" or None, oc_alloc_split_rule). ValueError when malformed. */
static PyObject *py_alloc_items(PyObject *self, PyObject *arg)
{
    static const char *const splits[] = {NULL, "inside_expandable", "no_expandable"};
    static oc_alloc_list l; /* 10 kB off the stack; called under the GIL */
    char err[128] = "";
    const char *conf;
    PyObject *bytes, *items = NULL, *out = NULL;
    (void)self;
    bytes = oc_arg_bytes(arg, "_alloc_items expects a str");
    if (bytes == NULL)
        return NULL;
    conf = PyBytes_AsString(bytes);
    if (conf != NULL && oc_alloc_parse(conf, &l, err, sizeof err) != 0)
        PyErr_Format(PyExc_ValueError, "bad allocator configuration: %s", err);
    else if (conf != NULL)
        items = PyList_New(0);
    for (int i = 0; items != NULL && i < l.n; i++) {
        PyObject *kv = Py_BuildValue("(ss)", l.e[i].key, l.e[i].value);
        if (kv == NULL || PyList_Append(items, kv) < 0)
            Py_CLEAR(items);
        Py_XDECREF(kv);
    }
    if (items != NULL)
        out = Py_BuildValue("(Oz)", items, splits[oc_alloc_split_rule(conf)]);
    Py_XDECREF(items);
    Py_DECREF(bytes);
    return out;
}

OC_EDGE_NOARGS(py_disabled_by_env)
OC_EDGE_NOARGS(py_tf32_forced_off)
OC_EDGE_VARARGS(py_alloc_var)
OC_EDGE_NOARGS(py_alloc_vars)
OC_EDGE_O(py_alloc_items)

PyMethodDef oc_facts_methods[] = {
    OC_METHOD("_disabled_by_env", py_disabled_by_env,
              "_disabled_by_env()\n--\n\nOUTOFCUDA_DISABLE turns outofcuda off."),
    OC_METHOD(
        "_tf32_forced_off", py_tf32_forced_off,
        "_tf32_forced_off()\n--\n\nNVIDIA_TF32_OVERRIDE turns TF32 off in NVIDIA's libraries."),
    OC_METHOD(
        "_alloc_var", py_alloc_var,
        "_alloc_var(torch_version=None, /)\n--\n\n(name, value or None) of the allocator variable "
        "that torch release reads."),
    OC_METHOD("_alloc_vars", py_alloc_vars,
              "_alloc_vars()\n--\n\nThe allocator variables in the order torch 2.11+ reads them."),
    OC_METHOD(
        "_alloc_items", py_alloc_items,
        "_alloc_items(conf, /)\n--\n\n(items, split): an allocator string's (key, value) pairs as "
        "torch applies them, and its max_split_size_mb rule."),
    {NULL, NULL, 0, NULL},
};
