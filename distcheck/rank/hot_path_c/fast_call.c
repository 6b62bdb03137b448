/* FastCall: the tracer's hot path in C, the same fast path as ``hot_path._FAST_SOURCE`` without a Python frame.

Why: after a blocking collective the rank's caches are cold, and there every bytecode, frame and object the
wrapper touches costs several times what it costs in a warm loop; in Python the fast path added 16-18% to a
1-element gloo all_reduce (2 ranks on 2 cores), the same steps from C 5-6% (benchmarks/tracer_overhead.py).

What: ``FastCall(state, keys, fallback, original)`` is called as the collective (``state``: the tracer's
``HotPathState``, ``keys``: the op's ``CKeys``, both read once here). A call that the fast path records from what it
shows alone (a key already cached, on a group already defined, not nested in a traced call) is numbered, written and
run here, step for step as ``_FAST_SOURCE`` does; every other call goes to ``fallback``, the generated Python
wrapper, whole (nothing is done here before it is chosen but reads). Rule 0 as there: an error of distcheck's is
counted through ``state.failed(exc)`` (``guard.failed(Hook.TRACER, exc)``), never raised into the user's call; the
user's own exception leaves as it came. Optional: where this does not build, the Python wrapper is the hot path. */

#include "hot_path_c.h"

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);   /* what time.time_ns() reads */
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

/* 32 bytes, four little-endian words: the layout of distcheck.files.trace.SLOT_STRUCT ("<4Q"). */
static void pack_slot(unsigned char *buf, uint64_t w0, uint64_t w1, uint64_t w2, uint64_t w3) {
    uint64_t words[4] = {w0, w1, w2, w3};
    for (int w = 0; w < 4; w++)
        for (int b = 0; b < 8; b++)
            buf[w * 8 + b] = (unsigned char)(words[w] >> (8 * b));
}

static PyObject *slot(uint64_t w0, uint64_t w1, uint64_t w2, uint64_t w3) {
    unsigned char buf[32];
    pack_slot(buf, w0, w1, w2, w3);
    return PyBytes_FromStringAndSize((const char *)buf, 32);
}

/* Into the mapping through its cursor where there is room; else ``append(record)``, and ``write(record)`` where the
   mapping is full (ValueError). 0, or -1 with an error set. */
static int put(FastCall *self, uint64_t w0, uint64_t w1, uint64_t w2, uint64_t w3) {
    if (self->cursor != NULL) {
        unsigned char buf[32];
        pack_slot(buf, w0, w1, w2, w3);
        if (cursor_put(self->cursor, buf, 32) == 0)
            return 0;
    }
    PyObject *record = slot(w0, w1, w2, w3);
    if (record == NULL)
        return -1;
    PyObject *r = PyObject_CallOneArg(self->append, record);
    if (r == NULL && PyErr_ExceptionMatches(PyExc_ValueError)) {
        PyErr_Clear();
        r = PyObject_CallOneArg(self->write, record);
    }
    Py_DECREF(record);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

static PyObject *call_fallback(FastCall *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
}

/* ``inside.active = on``: 0, or -1 with an error set. */
static int set_inside(FastCall *self, int on) {
    if (flag_set((ThreadFlag *)self->inside, on) == 0)
        return 0;
    PyErr_SetString(PyExc_RuntimeError, "a thread-specific value could not be set");
    return -1;
}

/* ``hot.busy_group = None; inside.active = False``, keeping any exception in flight. */
static void leave(FastCall *self) {
    hot_busy(self->hot, Py_None);
    (void)flag_set((ThreadFlag *)self->inside, 0);   /* fails only out of memory, and sets no error */
}

/* ``failed(exc)`` with the exception set now; cleared after. */
static COLD void count_failure(FastCall *self) {
    Raised exc = raised_take();
    if (exc.value != NULL) {
        PyObject *r = PyObject_CallOneArg(self->failed, exc.value);
        if (r == NULL)
            PyErr_Clear();
        Py_XDECREF(r);
    }
    raised_drop(&exc);
}

/* The call's number on its group (``*seq``, and as a new reference): the group's counter (less its segment's base)
   + 1, or, on a group without one, the tracer's last number for it + 1 (kept in ``seqs``). NULL with an error set
   where it has none. */
static PyObject *number(FastCall *self, const EntryView *v, uint64_t *seq) {
    uint64_t last;
    if (v->counter == Py_None) {
        if (take_u64(PyObject_GetItem(self->seqs, v->key), &last) < 0)
            return NULL;
        *seq = last + 1;
        PyObject *seq_obj = PyLong_FromUnsignedLongLong(*seq);
        if (seq_obj != NULL && PyObject_SetItem(self->seqs, v->key, seq_obj) < 0)
            Py_CLEAR(seq_obj);
        return seq_obj;
    }
    if (take_u64(PyObject_CallNoArgs(v->counter), &last) < 0)
        return NULL;
    if (last < v->base) {   /* Python's numbers would go negative, and its struct refuse them */
        PyErr_SetString(PyExc_OverflowError, "a group's counter went back below its segment's base");
        return NULL;
    }
    *seq = last - v->base + 1;
    return PyLong_FromUnsignedLongLong(*seq);
}

/* Numbers the call on its group and writes its E record: 0 and its key, or -1 with an error set (no record
   written then). As ``_FAST_SOURCE``'s block under ``else:``. A number from the group's counter is the sidecar's
   to learn (``written``), and the group busy while the call runs (rank.native). */
static int enter(FastCall *self, PyObject *entry, uint64_t fp, uint64_t *key_out) {
    EntryView v = {NULL, NULL, NULL, 0, 0, 0, 0};
    int status = -1;
    PyObject *seq_obj = NULL;
    uint64_t seq, key;
    if (view_of(self, entry, &v) < 0 || (seq_obj = number(self, &v, &seq)) == NULL)
        goto done;
    if (v.counter != Py_None) {
        PyObject *r = PyObject_CallOneArg(v.written_append, seq_obj);
        if (r == NULL)
            goto done;
        Py_DECREF(r);
        hot_busy(self->hot, v.key);
    }
    self->hot->count++;
    /* key_base + seq - skew, as Python's numbers compute it, refused where its record could not hold it */
    if (key_overflows(v.key_base, seq, v.skew, &key)) {
        PyErr_SetString(PyExc_OverflowError, "a call's key does not fit its record");
        goto done;
    }
    uint64_t w0 = fp | v.e_word;
    uint64_t t = now_ns();
    if (put(self, w0, key, t, w0 ^ key ^ t ^ self->check) == 0) {
        *key_out = key;
        status = 0;
    }
done:
    view_clear(&v);
    Py_XDECREF(seq_obj);
    if (status < 0 && !PyErr_Occurred())
        PyErr_SetString(PyExc_RuntimeError, "distcheck's fast path could not number a call");
    return status;
}

/* The X record of a call that returned, and its handle held where it is an async call's. */
static void exit_ok(FastCall *self, uint64_t key, int async_flag, PyObject *result) {
    uint64_t t = now_ns();
    if (put(self, self->x_ok, key, t, self->x_ok ^ self->check ^ key ^ t) < 0) {
        count_failure(self);
        return;
    }
    if (!async_flag || result == Py_None)
        return;
    PyObject *key_obj = PyLong_FromUnsignedLongLong(key);
    PyObject *results = key_obj ? PyTuple_Pack(1, result) : NULL;
    PyObject *keys = results ? PyTuple_Pack(1, key_obj) : NULL;
    PyObject *r = keys ? PyObject_CallMethodObjArgs(self->handles, s_hold, results, keys, NULL) : NULL;
    if (r == NULL)
        count_failure(self);
    Py_XDECREF(r);
    Py_XDECREF(keys);
    Py_XDECREF(results);
    Py_XDECREF(key_obj);
}

/* The user's exception from the call: ``exit_guarded(key, exc)``, then the exception as it was. */
static COLD void exit_raised(FastCall *self, uint64_t key) {
    Raised exc = raised_take();
    PyObject *key_obj = PyLong_FromUnsignedLongLong(key);
    PyObject *r = key_obj ? PyObject_CallFunctionObjArgs(self->exit_guarded, key_obj,
                                                         exc.value ? exc.value : Py_None, NULL) : NULL;
    if (r == NULL)
        PyErr_Clear();
    Py_XDECREF(r);
    Py_XDECREF(key_obj);
    raised_restore(&exc);
}

static PyObject *fast_call(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    FastCall *self = (FastCall *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (flag_is_set((ThreadFlag *)self->inside))   /* a collective inside a traced one: Python's way */
        return call_fallback(self, args, nargsf, kwnames);
    PyObject *entry = NULL;
    uint64_t fp = 0;
    int async_flag = 0;
    if (!fast_lookup(self, args, nargs, kwnames, &entry, &fp, &async_flag))
        return call_fallback(self, args, nargsf, kwnames);
    if (set_inside(self, 1) < 0) {
        PyErr_Clear();
        Py_DECREF(entry);
        return call_fallback(self, args, nargsf, kwnames);
    }
    uint64_t key = 0;
    int recorded = enter(self, entry, fp, &key) == 0;
    Py_DECREF(entry);
    Raised unrecorded = {0};
    if (!recorded) {
        unrecorded = raised_take();
        if (!PyErr_GivenExceptionMatches(unrecorded.value, PyExc_Exception)) {   /* KeyboardInterrupt... */
            raised_restore(&unrecorded);
            leave(self);
            return NULL;
        }
    }
    PyObject *result = PyObject_Vectorcall(self->original, args, nargsf, kwnames);
    if (result == NULL) {
        if (recorded)
            exit_raised(self, key);
        raised_drop(&unrecorded);
        leave(self);
        return NULL;   /* the user's exception, as it was */
    }
    if (recorded) {
        exit_ok(self, key, async_flag, result);
    } else if (unrecorded.value != NULL) {   /* counted for a call that worked (a malformed call is the user's) */
        raised_restore(&unrecorded);
        count_failure(self);
    }
    leave(self);
    return result;
}

/* -- the type ---------------------------------------------------------------------------------------------- */

/* ``obj.name`` (a new reference), of ``type`` where one is given (None allowed where ``or_none``): NULL with an
   error set. */
static PyObject *field(PyObject *obj, const char *name, PyTypeObject *type, int or_none) {
    PyObject *v = PyObject_GetAttrString(obj, name);
    if (v == NULL || type == NULL || PyObject_TypeCheck(v, type) || (or_none && v == Py_None))
        return v;
    PyErr_Format(PyExc_TypeError, "FastCall: %s is a %s, not a %s", name, Py_TYPE(v)->tp_name, type->tp_name);
    Py_DECREF(v);
    return NULL;
}

/* ``obj.name`` as a C int (its truth): 0 or 1, or -1 with an error set. */
static int flag_field(PyObject *obj, const char *name) {
    PyObject *v = field(obj, name, NULL, 0);
    int on = v == NULL ? -1 : PyObject_IsTrue(v);
    Py_XDECREF(v);
    return on;
}

/* ``obj.name`` as an unsigned 64-bit int: 0, or -1 with an error set. */
static int u64_field(PyObject *obj, const char *name, uint64_t *out) {
    return take_u64(field(obj, name, NULL, 0), out);
}

/* One argument's place (``rank.ops.Place``: ``index``, ``name``, ``default``), or None where the signature lacks
   it. 0, or -1 with an error set. */
static int param_from(PyObject *place, Param *p) {
    if (place == Py_None) {
        p->present = 0;
        return 0;
    }
    PyObject *index = field(place, "index", &PyLong_Type, 0);
    if (index == NULL)
        return -1;
    p->index = PyLong_AsSsize_t(index);
    Py_DECREF(index);
    if (p->index == -1 && PyErr_Occurred())
        return -1;
    if ((p->name = field(place, "name", &PyUnicode_Type, 0)) == NULL)
        return -1;
    PyUnicode_InternInPlace(&p->name);
    if ((p->deflt = field(place, "default", NULL, 0)) == NULL)
        return -1;
    p->present = 1;
    return 0;
}

/* ``rank.hot_path.Places``'s fields, in the order of ``P_PG``... */
static const char *const place_names[N_PARAMS] = {"group", "tensor", "reduce_op", "root", "group_root", "async_op"};

/* What the fast path reads, from the tracer's ``HotPathState`` (``state``) and the op's ``CKeys`` (``keys``): 0, or
   -1 with an error set (what was read so far held, let go with ``self``). */
static int read_state(FastCall *self, PyObject *state, PyObject *keys) {
    PyObject *writer = NULL, *numbering = NULL, *places = NULL, *cursor = NULL;
    int status = -1;
    if ((self->inside = field(state, "inside", &ThreadFlagType, 0)) == NULL
        || (self->hot = (HotState *)field(state, "hot", &HotStateType, 0)) == NULL
        || (writer = field(state, "writer", NULL, 0)) == NULL
        || (self->append = field(writer, "append", NULL, 0)) == NULL
        || (self->write = field(writer, "write", NULL, 0)) == NULL
        || (cursor = field(writer, "cursor", &SlotCursorType, 1)) == NULL
        || (numbering = field(state, "numbering", NULL, 0)) == NULL
        || (self->groups = field(numbering, "groups", &PyDict_Type, 0)) == NULL
        || (self->seqs = field(numbering, "seqs", &PyDict_Type, 0)) == NULL
        || (self->default_group = field(numbering, "default_group", NULL, 0)) == NULL
        || (self->handles = field(state, "handles", NULL, 0)) == NULL
        || (self->exit_guarded = field(state, "exit_guarded", NULL, 0)) == NULL
        || (self->failed = field(state, "failed", NULL, 0)) == NULL
        || (self->plain_user = field(state, "plain_user", &PyDict_Type, 0)) == NULL
        || (self->site_key = field(state, "site_key", NULL, 0)) == NULL
        || (self->op_ids = field(state, "op_ids", &PyDict_Type, 0)) == NULL
        || u64_field(state, "check", &self->check) < 0 || u64_field(state, "x_ok", &self->x_ok) < 0
        || (self->op_default = field(keys, "op_default", NULL, 0)) == NULL
        || (self->fast = field(keys, "fast", &PyDict_Type, 0)) == NULL
        || (self->has_op = flag_field(keys, "has_op")) < 0 || (self->has_root = flag_field(keys, "has_root")) < 0
        || (self->has_tensor = flag_field(keys, "has_tensor")) < 0
        || (places = field(keys, "places", NULL, 0)) == NULL)
        goto done;
    for (int i = 0; i < N_PARAMS; i++) {
        PyObject *place = field(places, place_names[i], NULL, 0);
        int read = place == NULL ? -1 : param_from(place, &self->params[i]);
        Py_XDECREF(place);
        if (read < 0)
            goto done;
    }
    if (cursor != Py_None) {
        self->cursor = (SlotCursor *)cursor;
        cursor = NULL;
    }
    status = 0;
done:
    Py_XDECREF(writer);
    Py_XDECREF(numbering);
    Py_XDECREF(places);
    Py_XDECREF(cursor);
    return status;
}

/* ``FastCall(state, keys, fallback, original)``: ``original`` traced, ``fallback`` (the Python wrapper) for every call
   this does not record itself. */
static PyObject *fast_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *kw[] = {"state", "keys", "fallback", "original", NULL};
    PyObject *state, *keys, *fallback, *original;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOO", kw, &state, &keys, &fallback, &original))
        return NULL;
    FastCall *self = (FastCall *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->vectorcall = fast_call;
    Py_INCREF(fallback);
    self->fallback = fallback;
    Py_INCREF(original);
    self->original = original;
    if (read_state(self, state, keys) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

#define VISIT_ALL(V)                                                                                                 \
    V(dict) V(fallback) V(original) V(inside) V(hot) V(append) V(write) V(groups) V(seqs) V(default_group)          \
    V(handles) V(exit_guarded) V(failed) V(plain_user) V(site_key) V(op_ids) V(op_default) V(fast)

static int fast_traverse(FastCall *self, visitproc visit, void *arg) {
#define V(f) Py_VISIT(self->f);
    VISIT_ALL(V)
#undef V
    for (int i = 0; i < N_PARAMS; i++)
        Py_VISIT(self->params[i].deflt);
    Py_VISIT(self->cursor);
#define V(f) Py_VISIT(self->f);
    LAST_REFS(V)
#undef V
    return 0;
}

static int fast_clear(FastCall *self) {
#define V(f) Py_CLEAR(self->f);
    VISIT_ALL(V)
#undef V
    for (int i = 0; i < N_PARAMS; i++) {
        Py_CLEAR(self->params[i].deflt);
        Py_CLEAR(self->params[i].name);
    }
    Py_CLEAR(self->cursor);
    last_forget(self);
    return 0;
}

static void fast_dealloc(FastCall *self) {
    PyObject_GC_UnTrack(self);
    if (self->weakrefs != NULL)
        PyObject_ClearWeakRefs((PyObject *)self);
    fast_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Bound as a plain function is (a collective kept as a class attribute gets the instance first). */
static PyObject *fast_get(PyObject *self, PyObject *obj, PyObject *type) {
    UNUSED(type);
    if (obj == NULL || obj == Py_None) {
        Py_INCREF(self);
        return self;
    }
    return PyMethod_New(self, obj);
}

static PyObject *fast_repr(FastCall *self) {
    return PyObject_Repr(self->fallback);
}

/* Pickled by name, as the function it stands for is. */
static PyObject *fast_reduce(FastCall *self, PyObject *unused) {
    UNUSED(unused);
    return PyObject_GetAttr((PyObject *)self, s_qualname);
}

static PyObject *fast_forget(FastCall *self, PyObject *unused) {
    UNUSED(unused);
    last_forget(self);
    Py_RETURN_NONE;
}

static PyMethodDef fast_methods[] = {
    {"__reduce__", (PyCFunction)fast_reduce, METH_NOARGS, NULL},
    {"forget", (PyCFunction)fast_forget, METH_NOARGS, "drop the remembered last call (its key and group are gone)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef fast_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject FastCallType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "distcheck.rank._hot_path_c.FastCall",
    .tp_doc = "A traced collective: its fast path in C, every other call through the Python wrapper.",
    .tp_basicsize = sizeof(FastCall),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = fast_new,
    .tp_dealloc = (destructor)fast_dealloc,
    .tp_traverse = (traverseproc)fast_traverse,
    .tp_clear = (inquiry)fast_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(FastCall, vectorcall),
    .tp_dictoffset = offsetof(FastCall, dict),
    .tp_weaklistoffset = offsetof(FastCall, weakrefs),
    .tp_descr_get = fast_get,
    .tp_repr = (reprfunc)fast_repr,
    .tp_methods = fast_methods,
    .tp_getset = fast_getset,
    .tp_getattro = PyObject_GenericGetAttr,
    .tp_setattro = PyObject_GenericSetAttr,
};
