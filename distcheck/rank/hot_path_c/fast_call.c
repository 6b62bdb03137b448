/* FastCall: the tracer's hot path in C, the same fast path as ``hot_path._FAST_SOURCE`` without a Python frame.

Why: after a blocking collective the rank's caches are cold, and there every bytecode, frame and object the
wrapper touches costs several times what it costs in a warm loop; in Python the fast path added 16-18% to a
1-element gloo all_reduce (2 ranks on 2 cores), the same steps from C 5-6% (benchmarks/tracer_overhead.py).

What: ``FastCall(fallback, state...)`` is called as the collective. A call that the fast path records from what
it shows alone (a key already cached, on a group already defined, not nested in a traced call) is numbered,
written and run here, step for step as ``_FAST_SOURCE`` does; every other call goes to ``fallback``, the
generated Python wrapper, whole (nothing is done here before it is chosen but reads). Rule 0 as there: an error
of distcheck's is counted through ``failed(Hook.TRACER, exc)``, never raised into the user's call; the user's own
exception leaves as it came. Optional: where this does not build, the Python wrapper is the hot path. */

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

/* ``failed(Hook.TRACER, exc)`` with the exception set now; cleared after. */
static COLD void count_failure(FastCall *self) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (value != NULL) {
        if (tb != NULL)
            PyException_SetTraceback(value, tb);
        PyObject *r = PyObject_CallFunctionObjArgs(self->failed, self->hook, value, NULL);
        if (r == NULL)
            PyErr_Clear();
        Py_XDECREF(r);
    }
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
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
    if (__builtin_add_overflow(v.key_base, seq, &key) || __builtin_sub_overflow(key, v.skew, &key)) {
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
    PyObject *r = keys ? PyObject_CallMethodObjArgs(self->tracer, s_hold, results, keys, NULL) : NULL;
    if (r == NULL)
        count_failure(self);
    Py_XDECREF(r);
    Py_XDECREF(keys);
    Py_XDECREF(results);
    Py_XDECREF(key_obj);
}

/* The user's exception from the call: ``tracer._exit_guarded(key, exc)``, then the exception as it was. */
static COLD void exit_raised(FastCall *self, uint64_t key) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL)
        PyException_SetTraceback(value, tb);
    PyObject *key_obj = PyLong_FromUnsignedLongLong(key);
    PyObject *r = key_obj ? PyObject_CallMethodObjArgs(self->tracer, s_exit_guarded, key_obj,
                                                       value ? value : Py_None, NULL) : NULL;
    if (r == NULL)
        PyErr_Clear();
    Py_XDECREF(r);
    Py_XDECREF(key_obj);
    PyErr_Restore(type, value, tb);
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
    PyObject *unrecorded_type = NULL, *unrecorded = NULL, *unrecorded_tb = NULL;
    if (!recorded) {
        PyErr_Fetch(&unrecorded_type, &unrecorded, &unrecorded_tb);
        if (!PyErr_GivenExceptionMatches(unrecorded_type, PyExc_Exception)) {   /* KeyboardInterrupt... */
            PyErr_Restore(unrecorded_type, unrecorded, unrecorded_tb);
            leave(self);
            return NULL;
        }
    }
    PyObject *result = PyObject_Vectorcall(self->original, args, nargsf, kwnames);
    if (result == NULL) {
        if (recorded)
            exit_raised(self, key);
        Py_XDECREF(unrecorded_type);
        Py_XDECREF(unrecorded);
        Py_XDECREF(unrecorded_tb);
        leave(self);
        return NULL;   /* the user's exception, as it was */
    }
    if (recorded) {
        exit_ok(self, key, async_flag, result);
    } else if (unrecorded_type != NULL) {   /* counted for a call that worked (a malformed call is the user's) */
        PyErr_Restore(unrecorded_type, unrecorded, unrecorded_tb);
        count_failure(self);
    }
    leave(self);
    return result;
}

/* -- the type ---------------------------------------------------------------------------------------------- */

static int param_from(PyObject *spec, Param *p) {
    /* spec: None (not in the signature) or (index or -1, name, default) */
    if (spec == Py_None) {
        p->present = 0;
        return 0;
    }
    Py_ssize_t index;
    PyObject *name, *deflt;
    if (!PyArg_ParseTuple(spec, "nUO", &index, &name, &deflt))
        return -1;
    p->present = 1;
    p->index = index;
    Py_INCREF(name);
    PyUnicode_InternInPlace(&name);
    p->name = name;
    Py_INCREF(deflt);
    p->deflt = deflt;
    return 0;
}

static PyObject *fast_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *kw[] = {"fallback", "original", "tracer", "inside", "hot", "append", "write", "plain_user", "site_key",
                         "op_ids", "op_default", "fast", "groups", "default_group", "seqs", "failed", "hook",
                         "params", "has_op", "has_root", "has_tensor", "check", "x_ok", "cursor", NULL};
    PyObject *fallback, *original, *tracer, *inside, *hot, *append, *write, *plain_user, *site_key, *op_ids, *op_default,
        *fast, *groups, *default_group, *seqs, *failed, *hook, *params, *cursor = Py_None;
    int has_op, has_root, has_tensor;
    unsigned long long check, x_ok;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOO!O!OOO!OO!OO!O!OO!OOO!pppKK|O", kw, &fallback,
                                     &original, &tracer, &ThreadFlagType, &inside, &HotStateType, &hot, &append, &write, &PyDict_Type, &plain_user, &site_key,
                                     &PyDict_Type, &op_ids, &op_default, &PyDict_Type, &fast, &PyDict_Type, &groups,
                                     &default_group, &PyDict_Type, &seqs, &failed, &hook, &PyTuple_Type, &params,
                                     &has_op, &has_root, &has_tensor, &check, &x_ok, &cursor))
        return NULL;
    if (cursor != Py_None && !Py_IS_TYPE(cursor, &SlotCursorType)) {
        PyErr_SetString(PyExc_TypeError, "cursor: a SlotCursor or None");
        return NULL;
    }
    if (PyTuple_GET_SIZE(params) != N_PARAMS) {
        PyErr_SetString(PyExc_ValueError, "params: one entry each for pg, t, op, root, group_root, async_op");
        return NULL;
    }
    FastCall *self = (FastCall *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->vectorcall = fast_call;
    PyObject **slots[] = {&self->fallback, &self->original, &self->tracer, &self->inside, (PyObject **)&self->hot,
                          &self->append,
                          &self->write, &self->plain_user, &self->site_key, &self->op_ids, &self->op_default,
                          &self->fast, &self->groups, &self->default_group, &self->seqs, &self->failed, &self->hook};
    PyObject *values[] = {fallback, original, tracer, inside, hot, append, write, plain_user, site_key, op_ids, op_default,
                          fast, groups, default_group, seqs, failed, hook};
    for (size_t i = 0; i < sizeof(values) / sizeof(values[0]); i++) {
        Py_INCREF(values[i]);
        *slots[i] = values[i];
    }
    for (int i = 0; i < N_PARAMS; i++) {
        if (param_from(PyTuple_GET_ITEM(params, i), &self->params[i]) < 0) {
            Py_DECREF(self);
            return NULL;
        }
    }
    self->has_op = has_op;
    self->has_root = has_root;
    self->has_tensor = has_tensor;
    self->check = check;
    self->x_ok = x_ok;
    if (cursor != Py_None) {
        Py_INCREF(cursor);
        self->cursor = (SlotCursor *)cursor;
    }
    return (PyObject *)self;
}

#define VISIT_ALL(V)                                                                                                 \
    V(dict) V(fallback) V(original) V(tracer) V(inside) V(hot) V(append) V(write) V(plain_user) V(site_key)           \
    V(op_ids) V(op_default) V(fast) V(groups) V(default_group) V(seqs) V(failed) V(hook)

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
    return PyObject_GetAttr((PyObject *)self, s_qualname);
}

static PyObject *fast_forget(FastCall *self, PyObject *unused) {
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
