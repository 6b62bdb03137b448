/* The module ``distcheck.rank._hot_path_c``: its four types, the attribute names they read, and what their
   constructors share. */

#include "hot_path_c.h"

PyObject *s_shape, *s_dtype, *s_is_cpu, *s_device, *s_key, *s_counter, *s_base, *s_written,
    *s_key_base, *s_e_word, *s_skew, *s_hold, *s_append, *s_qualname;

int no_arguments(const char *type_name, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) == 0 && (kwargs == NULL || PyDict_GET_SIZE(kwargs) == 0))
        return 0;
    PyErr_Format(PyExc_TypeError, "%s() takes no arguments", type_name);
    return -1;
}

static struct PyModuleDef module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "_hot_path_c",
    .m_doc = "The tracer's hot path in C (distcheck.rank.hot_path).",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__hot_path_c(void) {
#ifdef Py_GIL_DISABLED
    /* A free-threaded interpreter (3.13t): a FastCall's remembered last call, the busy group and the trace's cursor
       are changed by every call without a lock, safe only under the GIL. setup.py does not build this there; a
       build made otherwise refuses to load, and distcheck.rank.hot_path takes the Python wrapper. */
    PyErr_SetString(PyExc_ImportError, "distcheck.rank._hot_path_c needs the GIL: on a free-threaded Python the "
                                       "tracer's Python hot path runs");
    return NULL;
#endif
    struct { PyObject **slot; const char *text; } names[] = {
        {&s_shape, "shape"}, {&s_dtype, "dtype"}, {&s_is_cpu, "is_cpu"},
        {&s_device, "device"}, {&s_key, "key"}, {&s_counter, "counter"}, {&s_base, "base"},
        {&s_written, "written"}, {&s_key_base, "key_base"}, {&s_e_word, "e_word"}, {&s_skew, "skew"},
        {&s_hold, "hold"}, {&s_append, "append"}, {&s_qualname, "__qualname__"},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        *names[i].slot = PyUnicode_InternFromString(names[i].text);
        if (*names[i].slot == NULL)
            return NULL;
    }
    struct { PyTypeObject *type; const char *name; } types[] = {
        {&FastCallType, "FastCall"}, {&ThreadFlagType, "ThreadFlag"}, {&HotStateType, "HotState"},
        {&SlotCursorType, "SlotCursor"},
    };
    for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++) {
        if (PyType_Ready(types[i].type) < 0)
            return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++) {
        if (PyModule_AddObjectRef(m, types[i].name, (PyObject *)types[i].type) < 0) {
            Py_DECREF(m);
            return NULL;
        }
    }
    return m;
}
