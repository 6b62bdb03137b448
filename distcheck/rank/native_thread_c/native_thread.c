/* ``distcheck.rank._native_thread``: the one thread distcheck runs in a rank, made as torch makes its own: a
   native thread that the job's code cannot see (rule 0).

   The ``threading`` module never hears of it, so it is not in ``threading.enumerate()`` or ``active_count()``
   (a test suite's thread police, Lightning's among them, checks those). Between ticks it holds no Python thread
   state at all, so ``sys._current_frames()`` and faulthandler's dumps do not list it either; each tick takes the
   GIL through ``PyGILState_Ensure`` (a thread state made for that tick), calls ``tick()``, and lets both go.

   ``tick()`` returns a false value to end the thread. ``stop()`` ends it from outside: a tick under way is waited
   for (bounded, with the GIL released), and no tick starts after. At interpreter shutdown no tick starts either:
   distcheck's own atexit handler stops the thread before the interpreter finalizes, and a thread that wakes after
   that sees the interpreter finalizing and returns without touching it. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#if defined(_WIN32)
#error "distcheck's native thread uses POSIX threads (distcheck runs on Linux)"
#endif

#include <errno.h>
#include <pthread.h>
#include <time.h>

#if PY_VERSION_HEX >= 0x030D0000
#define INTERPRETER_FINALIZING() Py_IsFinalizing()
#else
#define INTERPRETER_FINALIZING() _Py_IsFinalizing()
#endif

#define UNUSED(x) (void)(x)

/* A free-threaded interpreter (3.13t): the thread takes a thread state through PyGILState_Ensure there too, and
   its flags are the mutex's; the one field read without it, the ident (written by the thread's first tick, read by
   stop()), is atomic there, as the GIL made it elsewhere. */
#ifdef Py_GIL_DISABLED
#include <stdatomic.h>
typedef _Atomic unsigned long ident_t;
#else
typedef unsigned long ident_t;
#endif

typedef struct {
    PyObject_HEAD
    PyObject *tick;              /* owned */
    double interval_s;
    pthread_mutex_t lock;        /* guards the three flags below */
    pthread_cond_t changed;      /* signalled when ``stopping`` is set or ``running`` is cleared */
    int stopping, running, ticking;
    pthread_t thread;
    ident_t ident;               /* the thread's ident (PyThread_get_thread_ident in it), 0 before it starts */
} NativeThread;

static PyTypeObject NativeThreadType;

static void deadline_after(struct timespec *at, double seconds) {
    clock_gettime(CLOCK_MONOTONIC, at);
    long long ns = (long long)at->tv_nsec + (long long)(seconds * 1e9);
    at->tv_sec += (time_t)(ns / 1000000000LL);
    at->tv_nsec = (long)(ns % 1000000000LL);
}

/* Sleeps until the next tick is due or ``stop()`` is asked; returns whether to tick. The GIL is not held. */
static int wait_for_tick(NativeThread *self) {
    struct timespec at;
    deadline_after(&at, self->interval_s);
    pthread_mutex_lock(&self->lock);
    while (!self->stopping) {
        int rc = pthread_cond_timedwait(&self->changed, &self->lock, &at);
        if (rc == ETIMEDOUT)
            break;
    }
    int go = !self->stopping;
    if (go)
        self->ticking = 1;
    pthread_mutex_unlock(&self->lock);
    return go;
}

/* One tick with the GIL; whether the tick asked for more. Its own exceptions are its business: one that escapes
   is dropped here, never printed into the job's output. */
static int run_tick(NativeThread *self) {
    PyGILState_STATE gil = PyGILState_Ensure();
    if (self->ident == 0)
        self->ident = PyThread_get_thread_ident();
    PyObject *result = PyObject_CallNoArgs(self->tick);
    int again = 0;
    if (result == NULL) {
        PyErr_Clear();
    } else {
        again = PyObject_IsTrue(result);
        if (again < 0) {
            PyErr_Clear();
            again = 0;
        }
        Py_DECREF(result);
    }
    PyGILState_Release(gil);
    return again;
}

static void *thread_main(void *arg) {
    NativeThread *self = (NativeThread *)arg;
    for (;;) {
        if (!wait_for_tick(self))
            break;
        /* No tick once the interpreter shuts down: taking the GIL then would end or block this thread inside
           the interpreter's teardown. */
        int again = !INTERPRETER_FINALIZING() && run_tick(self);
        pthread_mutex_lock(&self->lock);
        self->ticking = 0;
        if (!again)
            self->stopping = 1;
        pthread_mutex_unlock(&self->lock);
        if (!again)
            break;
    }
    pthread_mutex_lock(&self->lock);
    self->running = 0;
    pthread_cond_broadcast(&self->changed);
    pthread_mutex_unlock(&self->lock);
    /* The thread's own reference (nt_start), given back with the GIL; at shutdown it is left (the process ends). */
    if (!INTERPRETER_FINALIZING()) {
        PyGILState_STATE gil = PyGILState_Ensure();
        Py_DECREF(self);
        PyGILState_Release(gil);
    }
    return NULL;
}

/* The lock and the condition (on the monotonic clock) the thread and its callers share, made anew. */
static void init_sync(NativeThread *self) {
    pthread_mutex_init(&self->lock, NULL);
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&self->changed, &attr);
    pthread_condattr_destroy(&attr);
}

static PyObject *nt_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"tick", "interval_s", NULL};
    PyObject *tick;
    double interval_s;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "Od", keywords, &tick, &interval_s))
        return NULL;
    if (!PyCallable_Check(tick)) {
        PyErr_SetString(PyExc_TypeError, "tick must be callable");
        return NULL;
    }
    if (!(interval_s > 0.0 && interval_s < 3600.0)) {
        PyErr_SetString(PyExc_ValueError, "interval_s must be above 0 and below 3600");
        return NULL;
    }
    NativeThread *self = (NativeThread *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    Py_INCREF(tick);
    self->tick = tick;
    self->interval_s = interval_s;
    init_sync(self);
    return (PyObject *)self;
}

/* start(): the thread begins, holding a reference to the object until it ends. */
static PyObject *nt_start(NativeThread *self, PyObject *unused) {
    UNUSED(unused);
    pthread_mutex_lock(&self->lock);
    if (self->running) {
        pthread_mutex_unlock(&self->lock);
        PyErr_SetString(PyExc_RuntimeError, "the thread is already running");
        return NULL;
    }
    self->stopping = 0;
    self->running = 1;
    self->ident = 0;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 4 << 20);   /* a tick runs Python and torch code */
    Py_INCREF(self);   /* the thread's reference, given back when it ends */
    int rc = pthread_create(&self->thread, &attr, thread_main, self);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
        self->running = 0;
        Py_DECREF(self);
    }
    pthread_mutex_unlock(&self->lock);
    if (rc != 0) {
        errno = rc;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

/* stop(wait_s): no tick starts after this; a tick under way (on another thread) is waited for, up to wait_s.
   Returns whether the thread has ended. */
static PyObject *nt_stop(NativeThread *self, PyObject *args) {
    double wait_s = 2.0;
    if (!PyArg_ParseTuple(args, "|d", &wait_s))
        return NULL;
    int own = self->ident != 0 && self->ident == PyThread_get_thread_ident();
    int ended;
    Py_BEGIN_ALLOW_THREADS
    struct timespec at;
    deadline_after(&at, wait_s);
    pthread_mutex_lock(&self->lock);
    self->stopping = 1;
    pthread_cond_broadcast(&self->changed);
    /* from its own tick the thread cannot wait for itself: it ends once the tick returns */
    while (self->running && !own) {
        if (pthread_cond_timedwait(&self->changed, &self->lock, &at) == ETIMEDOUT)
            break;
    }
    ended = !self->running;
    pthread_mutex_unlock(&self->lock);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(ended);
}

static PyObject *nt_get_running(NativeThread *self, void *closure) {
    UNUSED(closure);
    pthread_mutex_lock(&self->lock);
    int running = self->running;
    pthread_mutex_unlock(&self->lock);
    return PyBool_FromLong(running);
}

static PyObject *nt_get_ident(NativeThread *self, void *closure) {
    UNUSED(closure);
    return PyLong_FromUnsignedLong(self->ident);
}

/* In a forked child the thread does not exist: the object forgets it ran (distcheck calls this from its
   os.register_at_fork hook). */
static PyObject *nt_forget_after_fork(NativeThread *self, PyObject *unused) {
    UNUSED(unused);
    init_sync(self);
    self->running = self->ticking = 0;
    self->stopping = 1;
    self->ident = 0;
    Py_RETURN_NONE;
}

static void nt_dealloc(NativeThread *self) {
    Py_CLEAR(self->tick);
    pthread_cond_destroy(&self->changed);
    pthread_mutex_destroy(&self->lock);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef nt_methods[] = {
    {"start", (PyCFunction)nt_start, METH_NOARGS, "Start the thread."},
    {"stop", (PyCFunction)nt_stop, METH_VARARGS, "stop(wait_s=2.0) -> whether the thread has ended."},
    {"forget_after_fork", (PyCFunction)nt_forget_after_fork, METH_NOARGS, "In a forked child: it never ran here."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef nt_getset[] = {
    {"running", (getter)nt_get_running, NULL, "the thread has started and not ended", NULL},
    {"ident", (getter)nt_get_ident, NULL, "the thread's ident while it ticks (0 before its first tick)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject NativeThreadType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "distcheck.rank._native_thread.NativeThread",
    .tp_doc = "NativeThread(tick, interval_s): calls tick() every interval_s on a thread the job cannot see.",
    .tp_basicsize = sizeof(NativeThread),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = nt_new,
    .tp_dealloc = (destructor)nt_dealloc,
    .tp_methods = nt_methods,
    .tp_getset = nt_getset,
};

static struct PyModuleDef module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "_native_thread",
    .m_doc = "distcheck's thread in a rank, outside the threading module.",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__native_thread(void) {
    if (PyType_Ready(&NativeThreadType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "NativeThread", (PyObject *)&NativeThreadType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
#ifdef Py_GIL_DISABLED
    /* safe without the GIL (above): importing it must not turn the GIL back on in the job's process (rule 0) */
    if (PyUnstable_Module_SetGIL(m, Py_MOD_GIL_NOT_USED) < 0) {
        Py_DECREF(m);
        return NULL;
    }
#endif
    return m;
}
