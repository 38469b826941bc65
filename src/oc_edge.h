/* oc_edge.h - the edge, included by oc.h's Python part (needs Python.h and oc_raise_interrupt) */
#ifndef OC_EDGE_H
#define OC_EDGE_H

/* ---- the edge ----
 * Every C function of the engine that CPython calls (a method table's
 * function, a callback handed to torch or the interpreter, a slot of the
 * loader proxy, the module's exec) is called through a wrapper the compiler
 * makes: the macro of its calling convention, written after fn (or after its
 * prototype), defines edge_<fn>, which calls fn and then leaves through
 * oc_raise_interrupt, so an interrupt set aside while fn ran reaches its
 * caller as fn returns. fn may return NULL (or -1) with no exception set
 * while an interrupt waits: its wrapper raises that one. A table names fn
 * through OC_METHOD, OC_SLOT or OC_GETTER, which take the wrapper and the
 * flags or slot its macro gave, so the two cannot disagree, and CPython
 * checks the arguments itself, with the messages of any built-in. Only what
 * cannot raise stays bare: the dealloc, traverse and clear slots, a
 * capsule's destructor (tests/test_static.py holds every table and callback
 * of the engine to this).
 *     OC_EDGE_O(py_nvml_index)
 *     PyMethodDef oc_nvml_methods[] = {OC_METHOD("nvml_index", py_nvml_index, doc), ...};
 */
PyObject *oc_leave(PyObject *result); /* result, or NULL (result released) with the interrupt */
/* clang-format off */
#define OC_EDGE_OBJECT(fn, params, args)                                                           \
    static PyObject *edge_##fn params                                                              \
    {                                                                                              \
        return oc_leave(fn args);                                                                  \
    }
#define OC_EDGE_NUMBER(type, fn, params, args)                                                     \
    static type edge_##fn params                                                                   \
    {                                                                                              \
        type result = fn args;                                                                     \
        return oc_raise_interrupt() < 0 ? -1 : result;                                             \
    }
/* Functions, by calling convention (the 3.9 Limited API has no METH_FASTCALL);
 * OC_METHOD is a PyMethodDef: a method table's entry, or a callback's. */
#define OC_EDGE_NOARGS(fn)                                                                         \
    enum { edge_flags_##fn = METH_NOARGS };                                                        \
    OC_EDGE_OBJECT(fn, (PyObject *self, PyObject *unused), (self, unused))
#define OC_EDGE_O(fn)                                                                              \
    enum { edge_flags_##fn = METH_O };                                                             \
    OC_EDGE_OBJECT(fn, (PyObject *self, PyObject *arg), (self, arg))
#define OC_EDGE_VARARGS(fn)                                                                        \
    enum { edge_flags_##fn = METH_VARARGS };                                                       \
    OC_EDGE_OBJECT(fn, (PyObject *self, PyObject *args), (self, args))
#define OC_EDGE_KEYWORDS(fn)                                                                       \
    enum { edge_flags_##fn = METH_VARARGS | METH_KEYWORDS };                                       \
    OC_EDGE_OBJECT(fn, (PyObject *self, PyObject *args, PyObject *kw), (self, args, kw))
#define OC_METHOD(name, fn, doc)                                                                   \
    {name, (PyCFunction)(void (*)(void))edge_##fn, edge_flags_##fn, doc}
/* Slots of a type or a module, by slot; OC_SLOT is the slot's entry. */
#define OC_EDGE_GETATTRO(fn)                                                                       \
    enum { edge_slot_##fn = Py_tp_getattro };                                                      \
    OC_EDGE_OBJECT(fn, (PyObject *self, PyObject *name), (self, name))
#define OC_EDGE_SETATTRO(fn)                                                                       \
    enum { edge_slot_##fn = Py_tp_setattro };                                                      \
    OC_EDGE_NUMBER(int, fn, (PyObject *self, PyObject *name, PyObject *value), (self, name, value))
#define OC_EDGE_RICHCOMPARE(fn)                                                                    \
    enum { edge_slot_##fn = Py_tp_richcompare };                                                   \
    OC_EDGE_OBJECT(fn, (PyObject *self, PyObject *other, int op), (self, other, op))
#define OC_EDGE_HASH(fn)                                                                           \
    enum { edge_slot_##fn = Py_tp_hash };                                                          \
    OC_EDGE_NUMBER(Py_hash_t, fn, (PyObject *self), (self))
#define OC_EDGE_REPR(fn)                                                                           \
    enum { edge_slot_##fn = Py_tp_repr };                                                          \
    OC_EDGE_OBJECT(fn, (PyObject *self), (self))
#define OC_EDGE_MODULE_EXEC(fn)                                                                    \
    enum { edge_slot_##fn = Py_mod_exec };                                                         \
    OC_EDGE_NUMBER(int, fn, (PyObject *module), (module))
#define OC_SLOT(fn) {edge_slot_##fn, (void *)edge_##fn}
/* A PyGetSetDef's getter; OC_GETTER is its entry (no setter). */
#define OC_EDGE_GETTER(fn) OC_EDGE_OBJECT(fn, (PyObject *self, void *closure), (self, closure))
#define OC_GETTER(name, fn, doc) {name, edge_##fn, NULL, doc, NULL}
/* A pending call: Py_AddPendingCall(edge_<fn>, arg). */
#define OC_EDGE_PENDING_CALL(fn) OC_EDGE_NUMBER(int, fn, (void *arg), (arg))
/* clang-format on */

#endif /* OC_EDGE_H */
