/* facts.c - verdicts the Python layer (the CLI, the API, the OOM report)
 * asks for instead of parsing the environment again: one owner for each
 * fact, the same rules the start-up path applies. */
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

PyMethodDef oc_facts_methods[] = {
    {"_disabled_by_env", py_disabled_by_env, METH_NOARGS,
     "_disabled_by_env()\n--\n\nOUTOFCUDA_DISABLE turns outofcuda off."},
    {"_tf32_forced_off", py_tf32_forced_off, METH_NOARGS,
     "_tf32_forced_off()\n--\n\nNVIDIA_TF32_OVERRIDE turns TF32 off in NVIDIA's libraries."},
    {"_alloc_var", py_alloc_var, METH_VARARGS,
     "_alloc_var(torch_version=None, /)\n--\n\n(name, value or None) of the allocator variable "
     "that torch release reads."},
    {NULL, NULL, 0, NULL},
};
