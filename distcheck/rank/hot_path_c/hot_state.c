/* HotState: the tracer's two values that every recorded call changes, ``busy_group`` (the group a Python call is
   in right now, read by the sidecar: rank.native) and ``count`` (calls recorded). Kept in one small C object so
   the fast path sets them with a store each, not an attribute write on the tracer; Python reads and writes them
   as attributes (``Tracer.busy_group``, ``Tracer.count``). */

#include "hot_path_c.h"

#include <structmember.h>

void hot_busy(HotState *self, PyObject *group) {
    Py_INCREF(group);
    Py_SETREF(self->busy_group, group);
}

static PyObject *hot_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    if (no_arguments("HotState", args, kwargs) < 0)
        return NULL;
    HotState *self = (HotState *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    Py_INCREF(Py_None);
    self->busy_group = Py_None;
    return (PyObject *)self;
}

static int hot_traverse(HotState *self, visitproc visit, void *arg) {
    Py_VISIT(self->busy_group);
    return 0;
}

static int hot_clear(HotState *self) {
    Py_CLEAR(self->busy_group);
    return 0;
}

static void hot_dealloc(HotState *self) {
    PyObject_GC_UnTrack(self);
    hot_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef hot_members[] = {
    {"busy_group", T_OBJECT, offsetof(HotState, busy_group), 0, "the group a Python call is in right now, or None"},
    {"count", T_ULONGLONG, offsetof(HotState, count), 0, "calls recorded"},
    {NULL, 0, 0, 0, NULL},
};

PyTypeObject HotStateType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "distcheck.rank._hot_path_c.HotState",
    .tp_doc = "The tracer's busy group and call count, set by every recorded call.",
    .tp_basicsize = sizeof(HotState),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = hot_new,
    .tp_dealloc = (destructor)hot_dealloc,
    .tp_traverse = (traverseproc)hot_traverse,
    .tp_clear = (inquiry)hot_clear,
    .tp_members = hot_members,
};
