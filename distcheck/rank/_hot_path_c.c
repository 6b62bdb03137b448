/* The tracer's hot path in C: the same fast path as ``hot_path._FAST_SOURCE``, without a Python frame.

Why: after a blocking collective the rank's caches are cold, and there every bytecode, frame and object the
wrapper touches costs several times what it costs in a warm loop; in Python the fast path added about 15% to a
1-element gloo all_reduce, the same steps from C about 3% (benchmarks/tracer_overhead.py).

What: ``FastCall(fallback, state...)`` is called as the collective. A call that the fast path records from what
it shows alone (a key already cached, on a group already defined, not nested in a traced call) is numbered,
written and run here, step for step as ``_FAST_SOURCE`` does; every other call goes to ``fallback``, the
generated Python wrapper, whole (nothing is done here before it is chosen but reads). Rule 0 as there: an error
of distcheck's is counted through ``failed(Hook.TRACER, exc)``, never raised into the user's call; the user's own
exception leaves as it came. Optional: where this does not build, the Python wrapper is the hot path. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <frameobject.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

/* -- ThreadFlag: "inside a traced call on this thread", one thread-specific value (no dict lookups) ------------ */

typedef struct {
    PyObject_HEAD
    Py_tss_t key;
} ThreadFlag;

static PyTypeObject ThreadFlagType;

static int flag_is_set(ThreadFlag *flag) {
    return PyThread_tss_get(&flag->key) != NULL;
}

static int flag_set(ThreadFlag *flag, int on) {
    return PyThread_tss_set(&flag->key, on ? (void *)flag : NULL) == 0 ? 0 : -1;
}

static PyObject *flag_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) != 0 || (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0)) {
        PyErr_SetString(PyExc_TypeError, "ThreadFlag() takes no arguments");
        return NULL;
    }
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
    return PyBool_FromLong(flag_is_set(self));
}

static int flag_set_active(ThreadFlag *self, PyObject *value, void *closure) {
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

static PyTypeObject ThreadFlagType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "distcheck.rank._hot_path_c.ThreadFlag",
    .tp_doc = "Whether this thread is inside a traced call (``active``): one value per thread, as threading.local's.",
    .tp_basicsize = sizeof(ThreadFlag),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = flag_new,
    .tp_dealloc = (destructor)flag_dealloc,
    .tp_getset = flag_getset,
};

/* -- SlotCursor: appends whole records into a trace file's shared mapping, at a position of its own ----------- */

typedef struct {
    PyObject_HEAD
    Py_buffer view;     /* the mapping, exported while attached (the mmap refuses to resize or close then) */
    int attached;
    Py_ssize_t pos;
} SlotCursor;

/* Appends ``len`` bytes: 0, or -1 where they do not fit (or the cursor is detached); no error set. */
static int cursor_put(SlotCursor *self, const void *data, Py_ssize_t len) {
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

static PyTypeObject SlotCursorType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "distcheck.rank._hot_path_c.SlotCursor",
    .tp_doc = "Appends into a trace file's mapping (distcheck.files.trace_writer): the fast path writes here directly.",
    .tp_basicsize = sizeof(SlotCursor),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)cursor_dealloc,
    .tp_methods = cursor_methods,
};

/* -- FastCall ------------------------------------------------------------------------------------------------ */

/* One argument of the collective's signature: where it is read from, and its default. */
typedef struct {
    int present;        /* the signature has it (else it reads as None) */
    Py_ssize_t index;   /* its position, or -1 where it is keyword-only */
    PyObject *name;     /* its keyword */
    PyObject *deflt;    /* its default (None where it has none) */
} Param;

enum { P_PG, P_T, P_OP, P_ROOT, P_GROUP_ROOT, P_ASYNC, N_PARAMS };

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *weakrefs;
    PyObject *dict;             /* __dict__: functools.update_wrapper writes __wrapped__, __name__... here */
    PyObject *fallback;         /* the Python wrapper: every call this does not record itself */
    PyObject *original, *tracer, *inside, *append, *write;
    PyObject *plain_user, *site_key, *op_ids, *op_default, *fast, *groups, *default_group, *seqs;
    PyObject *failed, *hook;
    SlotCursor *cursor;         /* the trace's cursor where it has one (else NULL): records go straight in */
    Param params[N_PARAMS];
    /* the last call recorded here whose site is the user's own function, and its answer (``forget()`` when the
       tracer starts a segment: its keys and groups are cleared then) */
    int last_valid;
    struct {
        PyCodeObject *code;
        int lasti;
        PyObject *shape, *dtype, *place, *group;
    } last;
    PyObject *last_op, *last_root, *last_async, *last_entry;
    uint64_t last_fp;
    int has_op, has_root, has_tensor;
    uint64_t check, x_ok;
} FastCall;

static PyObject *s_active, *s_shape, *s_dtype, *s_is_cpu, *s_device, *s_key, *s_counter, *s_base, *s_written,
    *s_key_base, *s_e_word, *s_skew, *s_busy_group, *s_count, *s_exit_guarded, *s_hold, *s_append, *s_qualname;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);   /* what time.time_ns() reads */
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

/* The argument as ``args[i] if n > i else kwargs.get(name, default)`` reads it (borrowed; never NULL). */
static PyObject *read_arg(const Param *p, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    if (!p->present)
        return Py_None;
    if (p->index >= 0 && p->index < nargs)
        return args[p->index];
    if (kwnames != NULL) {
        Py_ssize_t nkw = PyTuple_GET_SIZE(kwnames);
        for (Py_ssize_t i = 0; i < nkw; i++) {
            if (PyTuple_GET_ITEM(kwnames, i) == p->name)
                return args[nargs + i];
        }
        for (Py_ssize_t i = 0; i < nkw; i++) {
            int eq = PyUnicode_Compare(PyTuple_GET_ITEM(kwnames, i), p->name);
            if (eq == 0)
                return args[nargs + i];
            if (eq == -1 && PyErr_Occurred())
                PyErr_Clear();
        }
    }
    return p->deflt;
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

/* ``inside.active``: the ThreadFlag's own value, or any other object's attribute (1, 0, or -1 with an error). */
static int is_inside(FastCall *self) {
    if (Py_IS_TYPE(self->inside, &ThreadFlagType))
        return flag_is_set((ThreadFlag *)self->inside);
    PyObject *active = PyObject_GetAttr(self->inside, s_active);
    if (active == NULL)
        return -1;
    int on = PyObject_IsTrue(active);
    Py_DECREF(active);
    return on;
}

static int set_inside(FastCall *self, int on) {
    if (Py_IS_TYPE(self->inside, &ThreadFlagType)) {
        if (flag_set((ThreadFlag *)self->inside, on) == 0)
            return 0;
        PyErr_SetString(PyExc_RuntimeError, "a thread-specific value could not be set");
        return -1;
    }
    return PyObject_SetAttr(self->inside, s_active, on ? Py_True : Py_False);
}

/* ``tracer.busy_group = None; inside.active = False``, keeping any exception in flight. */
static void leave(FastCall *self) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (PyObject_SetAttr(self->tracer, s_busy_group, Py_None) < 0)
        PyErr_Clear();
    if (set_inside(self, 0) < 0)
        PyErr_Clear();
    PyErr_Restore(type, value, tb);
}

/* ``failed(Hook.TRACER, exc)`` with the exception set now; cleared after. */
static void count_failure(FastCall *self) {
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

/* What a call shows that its fast key is made of, read once: its site (code, instruction), op, root, async_op,
   and its tensor's shape, dtype and place (``t.is_cpu or t.device``). */
typedef struct {
    PyCodeObject *code;                 /* new reference */
    int lasti;
    PyObject *op, *root, *async_op;     /* borrowed from the call's arguments */
    PyObject *shape, *dtype, *place;    /* new references (NULL without a tensor) */
    PyObject *group;                    /* the group the call is on (``default_group()`` for None): new reference */
} Shown;

static void shown_clear(Shown *c) {
    Py_CLEAR(c->code);
    Py_CLEAR(c->shape);
    Py_CLEAR(c->dtype);
    Py_CLEAR(c->place);
    Py_CLEAR(c->group);
}

/* 0, or -1 with an error set. */
static int shown_read(FastCall *self, PyFrameObject *frame, PyObject *t, PyObject *pg, Shown *c) {
    c->code = PyFrame_GetCode(frame);
#if PY_VERSION_HEX >= 0x030B0000
    c->lasti = PyFrame_GetLasti(frame);
#else
    PyObject *lasti = PyObject_GetAttrString((PyObject *)frame, "f_lasti");
    if (lasti == NULL)
        return -1;
    c->lasti = (int)PyLong_AsLong(lasti);
    Py_DECREF(lasti);
    if (PyErr_Occurred())
        return -1;
#endif
    if (self->has_tensor) {
        c->shape = PyObject_GetAttr(t, s_shape);
        c->dtype = c->shape ? PyObject_GetAttr(t, s_dtype) : NULL;
        c->place = c->dtype ? PyObject_GetAttr(t, s_is_cpu) : NULL;
        if (c->place == NULL)
            return -1;
        int cpu = PyObject_IsTrue(c->place);
        if (cpu < 0)
            return -1;
        if (cpu == 0) {   /* ``t.is_cpu or t.device`` */
            Py_SETREF(c->place, PyObject_GetAttr(t, s_device));
            if (c->place == NULL)
                return -1;
        }
    }
    if (pg == Py_None) {
        c->group = PyObject_CallNoArgs(self->default_group);
        return c->group == NULL ? -1 : 0;
    }
    Py_INCREF(pg);
    c->group = pg;
    return 0;
}

/* The fast path's key for this call (``seen``), or NULL with an error set. ``plain``: the site is the user's own
   function (its code and instruction), else ``site_key(frame)``'s. */
static PyObject *seen_key(FastCall *self, PyFrameObject *frame, const Shown *c, int plain) {
    PyObject *items[8], *made[3] = {NULL, NULL, NULL};
    Py_ssize_t n = 0;
    PyObject *key = NULL;
    if (plain) {
        made[0] = PyLong_FromVoidPtr(c->code);
        made[1] = made[0] ? PyLong_FromLong(c->lasti) : NULL;
    } else {
        made[0] = PyObject_CallOneArg(self->site_key, (PyObject *)frame);
        made[1] = Py_None;
        Py_INCREF(Py_None);
    }
    if (made[1] == NULL)
        goto done;
    items[n++] = made[0];
    items[n++] = made[1];
    if (self->has_op) {
        made[2] = PyLong_FromVoidPtr(c->op);
        if (made[2] == NULL)
            goto done;
        items[n++] = made[2];
    }
    if (self->has_root)
        items[n++] = c->root;
    items[n++] = c->async_op;
    if (self->has_tensor) {
        items[n++] = c->shape;
        items[n++] = c->dtype;
        items[n++] = c->place;
    }
    key = PyTuple_New(n);
    if (key != NULL) {
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_INCREF(items[i]);
            PyTuple_SET_ITEM(key, i, items[i]);
        }
    }
done:
    for (int i = 0; i < 3; i++)
        Py_XDECREF(made[i]);
    return key;
}

/* -- the last fast call, remembered: the next one like it skips its key and both lookups ----------------------- */

static void last_forget(FastCall *self) {
    self->last_valid = 0;
    Py_CLEAR(self->last.code);
    Py_CLEAR(self->last.shape);
    Py_CLEAR(self->last.dtype);
    Py_CLEAR(self->last.place);
    Py_CLEAR(self->last.group);
    Py_CLEAR(self->last_op);
    Py_CLEAR(self->last_root);
    Py_CLEAR(self->last_async);
    Py_CLEAR(self->last_entry);
}

/* Equal as the fast key's dict compares its items (1, 0; -1 with an error set). */
static int same(PyObject *a, PyObject *b) {
    if (a == b)
        return 1;
    if (a == NULL || b == NULL)
        return 0;
    return PyObject_RichCompareBool(a, b, Py_EQ);
}

/* Whether this call's key is the remembered one's: the same code object and instruction, the same op object, the
   same group object (all kept alive here, so no id is reused), equal root, async_op, shape, dtype and place. */
static int last_matches(FastCall *self, const Shown *c) {
    if (!self->last_valid || c->code != self->last.code || c->lasti != self->last.lasti || c->op != self->last_op
        || c->group != self->last.group)
        return 0;
    PyObject *now[5] = {c->root, c->async_op, c->shape, c->dtype, c->place};
    PyObject *then[5] = {self->last_root, self->last_async, self->last.shape, self->last.dtype, self->last.place};
    for (int i = 0; i < 5; i++) {
        int eq = same(now[i], then[i]);
        if (eq != 1) {
            if (eq < 0)
                PyErr_Clear();
            return 0;
        }
    }
    return 1;
}

static void last_remember(FastCall *self, const Shown *c, PyObject *entry, uint64_t fp) {
    last_forget(self);
    PyObject **slots[] = {(PyObject **)&self->last.code, &self->last.shape, &self->last.dtype, &self->last.place,
                          &self->last.group, &self->last_op, &self->last_root, &self->last_async, &self->last_entry};
    PyObject *values[] = {(PyObject *)c->code, c->shape, c->dtype, c->place, c->group, c->op, c->root, c->async_op,
                          entry};
    for (size_t i = 0; i < sizeof(values) / sizeof(values[0]); i++) {
        Py_XINCREF(values[i]);
        *slots[i] = values[i];
    }
    self->last.lasti = c->lasti;
    self->last_fp = fp;
    self->last_valid = 1;
}

/* ``op is None or op is op_default or (op_ids.get(id(op)) or NO_OP)[0] is op``: an op known by identity. */
static int op_known(FastCall *self, PyObject *op) {
    if (!self->has_op || op == Py_None || op == self->op_default)
        return 1;
    PyObject *op_id = PyLong_FromVoidPtr(op);
    if (op_id == NULL) {
        PyErr_Clear();
        return 0;
    }
    PyObject *held = PyDict_GetItemWithError(self->op_ids, op_id);
    Py_DECREF(op_id);
    if (held == NULL) {
        PyErr_Clear();
        return 0;
    }
    return PyTuple_Check(held) && PyTuple_GET_SIZE(held) > 0 && PyTuple_GET_ITEM(held, 0) == op;
}

/* The fingerprint and group entry of a call recorded by the key and group lookups (the fast dict, then the groups
   dict); new reference to the entry, or 0 (no error set) where the call has none yet. */
static int lookup(FastCall *self, PyFrameObject *frame, const Shown *c, PyObject **entry_out, uint64_t *fp_out) {
    PyObject *code_id = PyLong_FromVoidPtr(c->code);
    if (code_id == NULL)
        return 0;
    PyObject *known = PyDict_GetItemWithError(self->plain_user, code_id);
    Py_DECREF(code_id);
    int plain = known == (PyObject *)c->code;
    if (!plain && PyErr_Occurred())
        return 0;
    PyObject *seen = seen_key(self, frame, c, plain);
    if (seen == NULL)
        return 0;
    PyObject *fp = PyDict_GetItemWithError(self->fast, seen);
    Py_DECREF(seen);
    if (fp == NULL || !PyLong_Check(fp))
        return 0;
    uint64_t fp_value = PyLong_AsUnsignedLongLong(fp);
    if (fp_value == (uint64_t)-1 && PyErr_Occurred())
        return 0;
    PyObject *group_id = PyLong_FromVoidPtr(c->group);
    if (group_id == NULL)
        return 0;
    PyObject *entry = PyDict_GetItemWithError(self->groups, group_id);   /* it keeps the group alive */
    Py_DECREF(group_id);
    if (entry == NULL || entry == Py_None)
        return 0;
    Py_INCREF(entry);
    if (plain)   /* a site by code and instruction: the next call like this one takes the remembered answer */
        last_remember(self, c, entry, fp_value);
    *entry_out = entry;
    *fp_out = fp_value;
    return 1;
}

/* The group's entry for this call and the fingerprint its key has (a new reference), or 0 where the call is not
   one this records itself. No side effects but the remembered last call. */
static int fast_lookup(FastCall *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                       PyObject **entry_out, uint64_t *fp_out, int *async_out) {
    PyObject *pg = read_arg(&self->params[P_PG], args, nargs, kwnames);
    PyObject *t = read_arg(&self->params[P_T], args, nargs, kwnames);
    PyObject *group_root = read_arg(&self->params[P_GROUP_ROOT], args, nargs, kwnames);
    Shown c = {NULL, -1, read_arg(&self->params[P_OP], args, nargs, kwnames),
               read_arg(&self->params[P_ROOT], args, nargs, kwnames),
               read_arg(&self->params[P_ASYNC], args, nargs, kwnames), NULL, NULL, NULL, NULL};
    if (group_root != Py_None || (self->has_tensor && t == Py_None) || !op_known(self, c.op))
        return 0;
    PyFrameObject *frame = PyEval_GetFrame();
    if (frame == NULL)
        return 0;
    int found = 0;
    int async_flag = PyObject_IsTrue(c.async_op);
    if (async_flag < 0 || shown_read(self, frame, t, pg, &c) < 0)
        goto done;
    if (last_matches(self, &c)) {
        Py_INCREF(self->last_entry);
        *entry_out = self->last_entry;
        *fp_out = self->last_fp;
        found = 1;
    } else {
        found = lookup(self, frame, &c, entry_out, fp_out);
    }
    *async_out = async_flag;
done:
    shown_clear(&c);
    if (PyErr_Occurred())
        PyErr_Clear();
    return found;
}

static int get_u64(PyObject *obj, PyObject *name, uint64_t *out) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL)
        return -1;
    *out = PyLong_AsUnsignedLongLong(v);
    Py_DECREF(v);
    return (*out == (uint64_t)-1 && PyErr_Occurred()) ? -1 : 0;
}

/* Numbers the call on its group and writes its E record: 0 and its key, or -1 with an error set (no record
   written then). As ``_FAST_SOURCE``'s block under ``else:``. */
static int enter(FastCall *self, PyObject *entry, uint64_t fp, uint64_t *key_out) {
    uint64_t base, key_base, skew, e_word, seq;
    int status = -1;
    PyObject *group = PyObject_GetAttr(entry, s_key);
    PyObject *counter = group ? PyObject_GetAttr(entry, s_counter) : NULL;
    PyObject *seq_obj = NULL, *r = NULL;
    if (counter == NULL)
        goto done;
    if (counter == Py_None) {
        PyObject *last = PyObject_GetItem(self->seqs, group);
        if (last == NULL)
            goto done;
        seq = PyLong_AsUnsignedLongLong(last) + 1;
        Py_DECREF(last);
    } else {
        PyObject *now = PyObject_CallNoArgs(counter);
        if (now == NULL)
            goto done;
        uint64_t value = PyLong_AsUnsignedLongLong(now);
        Py_DECREF(now);
        if (PyErr_Occurred() || get_u64(entry, s_base, &base) < 0)
            goto done;
        if (value < base) {   /* Python's numbers would go negative, and its struct refuse them */
            PyErr_SetString(PyExc_OverflowError, "a group's counter went back below its segment's base");
            goto done;
        }
        seq = value - base + 1;
    }
    if (PyErr_Occurred())
        goto done;
    seq_obj = PyLong_FromUnsignedLongLong(seq);
    if (seq_obj == NULL || PyObject_SetItem(self->seqs, group, seq_obj) < 0)
        goto done;
    PyObject *written = PyObject_GetAttr(entry, s_written);
    if (written == NULL)
        goto done;
    r = PyObject_CallMethodOneArg(written, s_append, seq_obj);
    Py_DECREF(written);
    if (r == NULL || PyObject_SetAttr(self->tracer, s_busy_group, group) < 0)
        goto done;
    uint64_t count;
    if (get_u64(self->tracer, s_count, &count) < 0)
        goto done;
    PyObject *count_obj = PyLong_FromUnsignedLongLong(count + 1);
    if (count_obj == NULL)
        goto done;
    int set = PyObject_SetAttr(self->tracer, s_count, count_obj);
    Py_DECREF(count_obj);
    if (set < 0 || get_u64(entry, s_key_base, &key_base) < 0 || get_u64(entry, s_skew, &skew) < 0
        || get_u64(entry, s_e_word, &e_word) < 0)
        goto done;
    uint64_t key;
    if (__builtin_add_overflow(key_base, seq, &key) || key < skew) {
        PyErr_SetString(PyExc_OverflowError, "a call's key does not fit its record");
        goto done;
    }
    key -= skew;
    uint64_t w0 = fp | e_word;
    uint64_t t = now_ns();
    if (put(self, w0, key, t, w0 ^ key ^ t ^ self->check) == 0) {
        *key_out = key;
        status = 0;
    }
done:
    Py_XDECREF(group);
    Py_XDECREF(counter);
    Py_XDECREF(seq_obj);
    Py_XDECREF(r);
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
static void exit_raised(FastCall *self, uint64_t key) {
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
    int nested = is_inside(self);
    if (nested != 0) {   /* a collective inside a traced one, or a flag that cannot be read: Python's way */
        if (nested < 0)
            PyErr_Clear();
        return call_fallback(self, args, nargsf, kwnames);
    }
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
    static char *kw[] = {"fallback", "original", "tracer", "inside", "append", "write", "plain_user", "site_key",
                         "op_ids", "op_default", "fast", "groups", "default_group", "seqs", "failed", "hook",
                         "params", "has_op", "has_root", "has_tensor", "check", "x_ok", "cursor", NULL};
    PyObject *fallback, *original, *tracer, *inside, *append, *write, *plain_user, *site_key, *op_ids, *op_default,
        *fast, *groups, *default_group, *seqs, *failed, *hook, *params, *cursor = Py_None;
    int has_op, has_root, has_tensor;
    unsigned long long check, x_ok;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOOO!OO!OO!O!OO!OOO!pppKK|O", kw, &fallback, &original,
                                     &tracer, &inside, &append, &write, &PyDict_Type, &plain_user, &site_key,
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
    PyObject **slots[] = {&self->fallback, &self->original, &self->tracer, &self->inside, &self->append,
                          &self->write, &self->plain_user, &self->site_key, &self->op_ids, &self->op_default,
                          &self->fast, &self->groups, &self->default_group, &self->seqs, &self->failed, &self->hook};
    PyObject *values[] = {fallback, original, tracer, inside, append, write, plain_user, site_key, op_ids, op_default,
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
    V(dict) V(fallback) V(original) V(tracer) V(inside) V(append) V(write) V(plain_user) V(site_key) V(op_ids)        \
    V(op_default) V(fast) V(groups) V(default_group) V(seqs) V(failed) V(hook)

static int fast_traverse(FastCall *self, visitproc visit, void *arg) {
#define V(f) Py_VISIT(self->f);
    VISIT_ALL(V)
#undef V
    for (int i = 0; i < N_PARAMS; i++)
        Py_VISIT(self->params[i].deflt);
    Py_VISIT(self->cursor);
    Py_VISIT(self->last.code);
    Py_VISIT(self->last.shape);
    Py_VISIT(self->last.dtype);
    Py_VISIT(self->last.place);
    Py_VISIT(self->last.group);
    Py_VISIT(self->last_op);
    Py_VISIT(self->last_root);
    Py_VISIT(self->last_async);
    Py_VISIT(self->last_entry);
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

static PyTypeObject FastCallType = {
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

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_hot_path_c", "The tracer's hot path in C (distcheck.rank.hot_path).", -1, NULL,
};

PyMODINIT_FUNC PyInit__hot_path_c(void) {
    struct { PyObject **slot; const char *text; } names[] = {
        {&s_active, "active"}, {&s_shape, "shape"}, {&s_dtype, "dtype"}, {&s_is_cpu, "is_cpu"},
        {&s_device, "device"}, {&s_key, "key"}, {&s_counter, "counter"}, {&s_base, "base"},
        {&s_written, "written"}, {&s_key_base, "key_base"}, {&s_e_word, "e_word"}, {&s_skew, "skew"},
        {&s_busy_group, "busy_group"}, {&s_count, "count"}, {&s_exit_guarded, "_exit_guarded"},
        {&s_hold, "_hold"}, {&s_append, "append"}, {&s_qualname, "__qualname__"},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        *names[i].slot = PyUnicode_InternFromString(names[i].text);
        if (*names[i].slot == NULL)
            return NULL;
    }
    if (PyType_Ready(&FastCallType) < 0 || PyType_Ready(&ThreadFlagType) < 0 || PyType_Ready(&SlotCursorType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&FastCallType);
    if (PyModule_AddObject(m, "FastCall", (PyObject *)&FastCallType) < 0) {
        Py_DECREF(&FastCallType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&ThreadFlagType);
    if (PyModule_AddObject(m, "ThreadFlag", (PyObject *)&ThreadFlagType) < 0) {
        Py_DECREF(&ThreadFlagType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&SlotCursorType);
    if (PyModule_AddObject(m, "SlotCursor", (PyObject *)&SlotCursorType) < 0) {
        Py_DECREF(&SlotCursorType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
