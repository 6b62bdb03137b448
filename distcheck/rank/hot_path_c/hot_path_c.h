/* The tracer's hot path in C, shared by its files: the types and what one file lends another.
   ``module.c`` makes the module; ``thread_flag.c``, ``hot_state.c``, ``slot_cursor.c`` and ``fast_call.c`` are its four
   types, and ``fast_key.c`` how a fast call finds its fingerprint and group. Why C at all: ``fast_call.c``. */

#ifndef DISTCHECK_HOT_PATH_C_H
#define DISTCHECK_HOT_PATH_C_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <frameobject.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

/* -- portability: CPython 3.10-3.13 on GCC, Clang or any C11 compiler --------------------------------------- */

/* Kept out of the hot path's cache lines: error and first-call paths. */
#if defined(__GNUC__) || defined(__clang__)
#define COLD __attribute__((cold, noinline))
#define LIKELY(x) __builtin_expect(!!(x), 1)
#else
#define COLD
#define LIKELY(x) (x)
#endif

#define UNUSED(x) (void)(x)

/* The checked arithmetic of a call's key: the compiler's builtins where it has them (GCC 5+, Clang), else the same
   answer in plain C. ``DISTCHECK_PORTABLE_C`` forces the plain C (how the fallback is tested). */
#if !defined(DISTCHECK_PORTABLE_C)
#if defined(__has_builtin)
#if __has_builtin(__builtin_add_overflow) && __has_builtin(__builtin_sub_overflow)
#define HAVE_OVERFLOW_BUILTINS 1
#endif
#elif defined(__GNUC__) && __GNUC__ >= 5
#define HAVE_OVERFLOW_BUILTINS 1
#endif
#endif

/* ``*out = base + seq - skew``, as Python's unbounded ints compute it: 0, or 1 where it does not fit 64 bits
   unsigned (or an intermediate sum does not: as the builtins check it, step by step). */
static inline int key_overflows(uint64_t base, uint64_t seq, int64_t skew, uint64_t *out) {
#if defined(HAVE_OVERFLOW_BUILTINS)
    return __builtin_add_overflow(base, seq, out) || __builtin_sub_overflow(*out, skew, out);
#else
    uint64_t sum = base + seq;
    if (sum < base)
        return 1;
    if (skew >= 0) {
        if ((uint64_t)skew > sum)
            return 1;
        *out = sum - (uint64_t)skew;
        return 0;
    }
    uint64_t minus = (uint64_t)(-(skew + 1)) + 1;   /* |skew|, INT64_MIN included */
    *out = sum + minus;
    return *out < sum;
#endif
}

/* The exception being raised, taken out of the thread's error indicator and put back: one object from 3.12 on
   (``PyErr_GetRaisedException``; 3.12 deprecated the Fetch/Restore triple), the normalized triple before it, its
   traceback set on the value as 3.12's is. ``value`` is NULL where none was raised. */
typedef struct {
    PyObject *value;
#if PY_VERSION_HEX < 0x030C0000
    PyObject *type, *tb;
#endif
} Raised;

static inline Raised raised_take(void) {
    Raised r;
#if PY_VERSION_HEX >= 0x030C0000
    r.value = PyErr_GetRaisedException();
#else
    PyErr_Fetch(&r.type, &r.value, &r.tb);
    PyErr_NormalizeException(&r.type, &r.value, &r.tb);
    if (r.tb != NULL && r.value != NULL)
        PyException_SetTraceback(r.value, r.tb);
#endif
    return r;
}

/* Raised again, as it was taken (the references go with it). */
static inline void raised_restore(Raised *r) {
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(r->value);
#else
    PyErr_Restore(r->type, r->value, r->tb);
    r->type = r->tb = NULL;
#endif
    r->value = NULL;
}

static inline void raised_drop(Raised *r) {
    Py_CLEAR(r->value);
#if PY_VERSION_HEX < 0x030C0000
    Py_CLEAR(r->type);
    Py_CLEAR(r->tb);
#endif
}

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
    PyObject *original;
    /* read once from the tracer's ``rank.hot_path.HotPathState`` (``state``) and the op's ``CKeys`` (``keys``) */
    PyObject *inside;           /* state.inside: a ThreadFlag */
    HotState *hot;              /* state.hot: the tracer's busy group and count */
    PyObject *append, *write;   /* state.writer's */
    SlotCursor *cursor;         /* state.writer.cursor where it has one (else NULL): records go straight in */
    PyObject *groups, *seqs, *default_group;   /* state.numbering's */
    PyObject *handles;          /* state.handles: ``hold(works, keys)`` */
    PyObject *exit_guarded, *failed;           /* state's: ``exit_guarded(key, exc)``, ``failed(exc)`` */
    PyObject *plain_user, *site_key, *op_ids;  /* state's */
    PyObject *op_default, *fast;               /* keys' */
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
    *s_key_base, *s_e_word, *s_skew, *s_hold, *s_append, *s_qualname;

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
