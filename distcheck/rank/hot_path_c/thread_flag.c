/* ThreadFlag: "inside a traced call on this thread", one thread-specific value (no dict lookups), which every
   wrapper of the tracer reads before it records a call. */

#include "hot_path_c.h"

int flag_is_set(ThreadFlag *flag) {
    return PyThread_tss_get(&flag->key) != NULL;
}

int flag_set(ThreadFlag *flag, int on) {
    return PyThread_tss_set(&flag->key, on ? (void *)flag : NULL) == 0 ? 0 : -1;
}

static PyObject *flag_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    if (no_arguments("ThreadFlag", args, kwargs) < 0)
        return NULL;
    ThreadFlag *self = (ThreadFlag *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    Py_tss_t fresh = Py_tss_NEEDS_INIT;
    self->key = fresh;
    if (PyThread_tss_create(&self->key) != 0) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    return (PyObject *)self;
}

static void flag_dealloc(ThreadFlag *self) {
    if (PyThread_tss_is_created(&self->key))
        PyThread_tss_delete(&self->key);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *flag_get_active(ThreadFlag *self, void *closure) {
    UNUSED(closure);
    return PyBool_FromLong(flag_is_set(self));
}

static int flag_set_active(ThreadFlag *self, PyObject *value, void *closure) {
    UNUSED(closure);
    int on = value == NULL ? 0 : PyObject_IsTrue(value);
    if (on < 0)
        return -1;
    if (flag_set(self, on) < 0) {
        PyErr_SetString(PyExc_RuntimeError, "a thread-specific value could not be set");
        return -1;
    }
    return 0;
}

static PyGetSetDef flag_getset[] = {
    {"active", (getter)flag_get_active, (setter)flag_set_active, "inside a traced call on this thread", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject ThreadFlagType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "distcheck.rank._hot_path_c.ThreadFlag",
    .tp_doc = "Whether this thread is inside a traced call (``active``): one value per thread, as threading.local's.",
    .tp_basicsize = sizeof(ThreadFlag),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = flag_new,
    .tp_dealloc = (destructor)flag_dealloc,
    .tp_getset = flag_getset,
};
