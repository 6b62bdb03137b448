/* The module ``distcheck.rank._hot_path_c``: its three types and the attribute names they read. */

#include "hot_path_c.h"

PyObject *s_active, *s_shape, *s_dtype, *s_is_cpu, *s_device, *s_key, *s_counter, *s_base, *s_written,
    *s_key_base, *s_e_word, *s_skew, *s_busy_group, *s_count, *s_exit_guarded, *s_hold, *s_append, *s_qualname;

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
