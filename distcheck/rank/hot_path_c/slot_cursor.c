/* SlotCursor: appends whole records into a trace file's shared mapping, at a position of its own (the trace's
   writer owns it: distcheck.files.trace_writer); the fast path copies its records in without a call. */

#include "hot_path_c.h"


/* Appends ``len`` bytes: 0, or -1 where they do not fit (or the cursor is detached); no error set. */
int cursor_put(SlotCursor *self, const void *data, Py_ssize_t len) {
    if (!self->attached || len > self->view.len - self->pos)
        return -1;
    memcpy((char *)self->view.buf + self->pos, data, (size_t)len);
    self->pos += len;
    return 0;
}

static PyObject *cursor_attach(SlotCursor *self, PyObject *args) {
    PyObject *mapping;
    Py_ssize_t pos;
    if (!PyArg_ParseTuple(args, "On:attach", &mapping, &pos))
        return NULL;
    if (self->attached) {
        PyErr_SetString(PyExc_ValueError, "the cursor is attached already");
        return NULL;
    }
    if (PyObject_GetBuffer(mapping, &self->view, PyBUF_WRITABLE) < 0)
        return NULL;
    if (pos < 0 || pos > self->view.len) {
        PyBuffer_Release(&self->view);
        PyErr_SetString(PyExc_ValueError, "the position lies outside the mapping");
        return NULL;
    }
    self->attached = 1;
    self->pos = pos;
    Py_RETURN_NONE;
}

static PyObject *cursor_detach(SlotCursor *self, PyObject *unused) {
    UNUSED(unused);
    if (self->attached) {
        PyBuffer_Release(&self->view);
        self->attached = 0;
    }
    return PyLong_FromSsize_t(self->pos);
}

static PyObject *cursor_write(SlotCursor *self, PyObject *arg) {
    Py_buffer data;
    if (PyObject_GetBuffer(arg, &data, PyBUF_SIMPLE) < 0)
        return NULL;
    int put = cursor_put(self, data.buf, data.len);
    PyBuffer_Release(&data);
    if (put < 0) {   /* as mmap.write says it: the caller grows the file and tries again */
        PyErr_SetString(PyExc_ValueError, self->attached ? "data out of range" : "the mapping is detached");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *cursor_tell(SlotCursor *self, PyObject *unused) {
    UNUSED(unused);
    return PyLong_FromSsize_t(self->pos);
}

static void cursor_dealloc(SlotCursor *self) {
    if (self->attached)
        PyBuffer_Release(&self->view);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef cursor_methods[] = {
    {"attach", (PyCFunction)cursor_attach, METH_VARARGS, "attach(mapping, pos): write into the mapping from pos on"},
    {"detach", (PyCFunction)cursor_detach, METH_NOARGS, "let the mapping go (to resize or close it); returns the position"},
    {"write", (PyCFunction)cursor_write, METH_O, "append bytes; ValueError where they do not fit, as mmap.write"},
    {"tell", (PyCFunction)cursor_tell, METH_NOARGS, "the position"},
    {NULL, NULL, 0, NULL},
};

PyTypeObject SlotCursorType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "distcheck.rank._hot_path_c.SlotCursor",
    .tp_doc = "Appends into a trace file's mapping (distcheck.files.trace_writer): the fast path writes here directly.",
    .tp_basicsize = sizeof(SlotCursor),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)cursor_dealloc,
    .tp_methods = cursor_methods,
};
