/* HotState: the tracer's two values that every recorded call changes, ``busy_group`` (the group a Python call is
   in right now, read by the sidecar: rank.native) and ``count`` (calls recorded). Kept in one small C object so
   the fast path sets them with a store each, not an attribute write on the tracer; Python reads and writes them
   as attributes (``Tracer.busy_group``, ``Tracer.count``). */

#include "hot_path_c.h"

#if PY_VERSION_HEX >= 0x030C0000
#define MEMBER_ULONGLONG Py_T_ULONGLONG   /* 3.12 moved the member types into Python.h, with their Py_ names */
#else
#include <structmember.h>
#define MEMBER_ULONGLONG T_ULONGLONG
#endif

void hot_busy(HotState *self, PyObject *group) {
    Py_INCREF(group);
    Py_XSETREF(self->busy_group, group);   /* NULL only after the collector's tp_clear */
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

/* ``busy_group`` as the old ``T_OBJECT`` member read and wrote it (None where unset), but never NULL: ``del`` sets
   None, which the fast path's store can let go of. */
static PyObject *hot_get_busy(HotState *self, void *closure) {
    UNUSED(closure);
    PyObject *group = self->busy_group != NULL ? self->busy_group : Py_None;
    Py_INCREF(group);
    return group;
}

static int hot_set_busy(HotState *self, PyObject *value, void *closure) {
    UNUSED(closure);
    hot_busy(self, value != NULL ? value : Py_None);
    return 0;
}

static PyGetSetDef hot_getset[] = {
    {"busy_group", (getter)hot_get_busy, (setter)hot_set_busy, "the group a Python call is in right now, or None", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef hot_members[] = {
    {"count", MEMBER_ULONGLONG, offsetof(HotState, count), 0, "calls recorded"},
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
    .tp_getset = hot_getset,
};
