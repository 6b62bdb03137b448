/* How a fast call finds its fingerprint and group: what the call shows (its site, op, tensor, group), the fast key
   made of it, the last call at one site remembered. Nothing here has a side effect but that memory. */

#include "hot_path_c.h"

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
            PyObject *kw = PyTuple_GET_ITEM(kwnames, i);
            if (PyUnicode_CheckExact(kw) && PyUnicode_CHECK_INTERNED(kw))   /* both interned: not it (seen above) */
                continue;
            int eq = PyUnicode_Compare(kw, p->name);
            if (eq == 0)
                return args[nargs + i];
            if (eq == -1 && PyErr_Occurred())
                PyErr_Clear();
        }
    }
    return p->deflt;
}


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

/* -- a group entry's fields --------------------------------------------------------------------------------- */

void view_clear(EntryView *view) {
    Py_CLEAR(view->key);
    Py_CLEAR(view->counter);
    Py_CLEAR(view->written_append);
}

int take_u64(PyObject *v, uint64_t *out) {
    if (v == NULL)
        return -1;
    *out = PyLong_AsUnsignedLongLong(v);
    Py_DECREF(v);
    return (*out == (uint64_t)-1 && PyErr_Occurred()) ? -1 : 0;
}

static int u64_attr(PyObject *obj, PyObject *name, uint64_t *out) {
    return take_u64(PyObject_GetAttr(obj, name), out);
}

static int i64_attr(PyObject *obj, PyObject *name, int64_t *out) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL)
        return -1;
    *out = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* The entry's fields, read from it: 0, or -1 with an error set (nothing held then). */
static COLD int view_read(PyObject *entry, EntryView *view) {
    view->key = PyObject_GetAttr(entry, s_key);
    view->counter = view->key ? PyObject_GetAttr(entry, s_counter) : NULL;
    PyObject *written = view->counter ? PyObject_GetAttr(entry, s_written) : NULL;
    view->written_append = written ? PyObject_GetAttr(written, s_append) : NULL;
    Py_XDECREF(written);
    if (view->written_append == NULL || u64_attr(entry, s_base, &view->base) < 0
        || u64_attr(entry, s_key_base, &view->key_base) < 0 || u64_attr(entry, s_e_word, &view->e_word) < 0
        || i64_attr(entry, s_skew, &view->skew) < 0) {
        view_clear(view);
        return -1;
    }
    return 0;
}

/* The entry's fields into ``view`` (owned): the remembered ones where it is the remembered call's entry (held
   here, so a segment that starts meanwhile cannot let them go), else read. 0, or -1 with an error set. */
int view_of(FastCall *self, PyObject *entry, EntryView *view) {
    if (!self->last_valid || entry != self->last_entry)
        return view_read(entry, view);
    *view = self->last_view;
    Py_INCREF(view->key);
    Py_INCREF(view->counter);
    Py_INCREF(view->written_append);
    return 0;
}

/* -- the last fast call, remembered: the next one like it skips its key and both lookups ----------------------- */

void last_forget(FastCall *self) {
    self->last_valid = 0;
#define V(f) Py_CLEAR(self->f);
    LAST_REFS(V)
#undef V
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
    int eq = 1;
    for (int i = 0; i < 5; i++)   /* held while compared: an __eq__ may run anything, this cache's change included */
        Py_XINCREF(then[i]);
    for (int i = 0; i < 5 && eq == 1; i++)
        eq = same(now[i], then[i]);
    for (int i = 0; i < 5; i++)
        Py_XDECREF(then[i]);
    if (eq < 0)
        PyErr_Clear();
    return eq == 1;
}

static COLD void last_remember(FastCall *self, const Shown *c, PyObject *entry, uint64_t fp) {
    EntryView view;
    if (view_read(entry, &view) < 0) {   /* not remembered: the call reads them again */
        PyErr_Clear();
        return;
    }
    PyObject **slots[] = {(PyObject **)&self->last.code, &self->last.shape, &self->last.dtype, &self->last.place,
                          &self->last.group, &self->last_op, &self->last_root, &self->last_async, &self->last_entry,
                          &self->last_view.key, &self->last_view.counter, &self->last_view.written_append};
    PyObject *values[] = {(PyObject *)c->code, c->shape, c->dtype, c->place, c->group, c->op, c->root, c->async_op,
                          entry, view.key, view.counter, view.written_append};
    enum { N = sizeof(values) / sizeof(values[0]) };
    PyObject *old[N];
    for (size_t i = 0; i < N; i++) {   /* the new answer in place before the old one is let go (its finalizers) */
        old[i] = *slots[i];
        Py_XINCREF(values[i]);
        *slots[i] = values[i];
    }
    self->last.lasti = c->lasti;
    self->last_view.base = view.base;
    self->last_view.key_base = view.key_base;
    self->last_view.e_word = view.e_word;
    self->last_view.skew = view.skew;
    self->last_fp = fp;
    self->last_valid = 1;
    for (size_t i = 0; i < N; i++)
        Py_XDECREF(old[i]);
    view_clear(&view);
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
static COLD int lookup(FastCall *self, PyFrameObject *frame, const Shown *c, PyObject **entry_out, uint64_t *fp_out) {
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
int fast_lookup(FastCall *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
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
    int async_flag = c.async_op == Py_False ? 0 : c.async_op == Py_True ? 1 : PyObject_IsTrue(c.async_op);
    if (async_flag < 0 || shown_read(self, frame, t, pg, &c) < 0)
        goto done;
    if (LIKELY(last_matches(self, &c))) {
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
