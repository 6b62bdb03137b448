/* The tracer's hot path in C, shared by its files: the types and what one file lends another.
   ``module.c`` makes the module; ``thread_flag.c``, ``hot_state.c``, ``slot_cursor.c`` and ``fast_call.c`` are its four
   types, and ``fast_key.c`` how a fast call finds its fingerprint and group. Why C at all: ``fast_call.c``. */

#ifndef DISTCHECK_HOT_PATH_C_H
#define DISTCHECK_HOT_PATH_C_H

/* Kept out of the hot path's cache lines: error and first-call paths. */
#if defined(__GNUC__)
#define COLD __attribute__((cold, noinline))
#define LIKELY(x) __builtin_expect(!!(x), 1)
#else
#define COLD
#define LIKELY(x) (x)
#endif

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <frameobject.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

typedef struct {   /* thread_flag.c */
    PyObject_HEAD
    Py_tss_t key;
} ThreadFlag;

typedef struct {   /* hot_state.c */
    PyObject_HEAD
    PyObject *busy_group;         /* never NULL while alive: None where no Python call is in flight */
    unsigned long long count;
} HotState;

typedef struct {   /* slot_cursor.c */
    PyObject_HEAD
    Py_buffer view;     /* the mapping, exported while attached (the mmap refuses to resize or close then) */
    int attached;
    Py_ssize_t pos;
} SlotCursor;

/* One argument of the collective's signature: where it is read from, and its default. */
typedef struct {
    int present;        /* the signature has it (else it reads as None) */
    Py_ssize_t index;   /* its position, or -1 where it is keyword-only */
    PyObject *name;     /* its keyword */
    PyObject *deflt;    /* its default (None where it has none) */
} Param;

enum { P_PG, P_T, P_OP, P_ROOT, P_GROUP_ROOT, P_ASYNC, N_PARAMS };

/* A group's entry as the fast path reads it (``rank.numbering.GroupEntry``), read once per remembered call: its
   fields are fixed for the entry's life but ``skew``, and the tracer has its fast calls forget what they remember
   when a call numbered apart moves that (``Numbering._skew_after``). */
typedef struct {
    PyObject *key, *counter, *written_append;   /* owned; counter: None where the group has none */
    uint64_t base, key_base, e_word;
    int64_t skew;   /* below 0 where a call numbered apart took fewer numbers than its width (monitored_barrier) */
} EntryView;

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *weakrefs;
    PyObject *dict;             /* __dict__: functools.update_wrapper writes __wrapped__, __name__... here */
    PyObject *fallback;         /* the Python wrapper: every call this does not record itself */
    PyObject *original, *tracer, *inside, *append, *write;   /* inside: a ThreadFlag */
    HotState *hot;              /* the tracer's busy group and count */
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
    EntryView last_view;        /* last_entry's fields */
    uint64_t last_fp;
    int has_op, has_root, has_tensor;
    uint64_t check, x_ok;
} FastCall;

/* Every reference the remembered last call holds: let go by ``last_forget``, visited by the collector. */
#define LAST_REFS(V) \
    V(last.code) V(last.shape) V(last.dtype) V(last.place) V(last.group) V(last_op) V(last_root) V(last_async) \
    V(last_entry) V(last_view.key) V(last_view.counter) V(last_view.written_append)

/* What a call shows that its fast key is made of, read once: its site (code, instruction), op, root, async_op,
   and its tensor's shape, dtype and place (``t.is_cpu or t.device``). */
typedef struct {
    PyCodeObject *code;                 /* new reference */
    int lasti;
    PyObject *op, *root, *async_op;     /* borrowed from the call's arguments */
    PyObject *shape, *dtype, *place;    /* new references (NULL without a tensor) */
    PyObject *group;                    /* the group the call is on (``default_group()`` for None): new reference */
} Shown;

extern PyTypeObject ThreadFlagType, HotStateType, SlotCursorType, FastCallType;

/* interned attribute names (module.c) */
extern PyObject *s_shape, *s_dtype, *s_is_cpu, *s_device, *s_key, *s_counter, *s_base, *s_written,
    *s_key_base, *s_e_word, *s_skew, *s_exit_guarded, *s_hold, *s_append, *s_qualname;

int flag_is_set(ThreadFlag *flag);
int flag_set(ThreadFlag *flag, int on);
void hot_busy(HotState *self, PyObject *group);
int cursor_put(SlotCursor *self, const void *data, Py_ssize_t len);
int fast_lookup(FastCall *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, PyObject **entry_out,
                uint64_t *fp_out, int *async_out);
void last_forget(FastCall *self);
int view_of(FastCall *self, PyObject *entry, EntryView *view);
/* ``v`` (a reference it lets go of; NULL where getting it failed) as an unsigned 64-bit int: 0, or -1 with an
   error set. */
int take_u64(PyObject *v, uint64_t *out);
/* TypeError unless a type that takes no arguments got none: 0, or -1 with the error set. */
int no_arguments(const char *type_name, PyObject *args, PyObject *kwargs);
void view_clear(EntryView *view);

#endif
