/* The module ``distcheck.rank._hot_path_c``: its four types, the attribute names they read, and what their
   constructors share. */

#include "hot_path_c.h"

PyObject *s_shape, *s_dtype, *s_is_cpu, *s_device, *s_key, *s_counter, *s_base, *s_written,
    *s_key_base, *s_e_word, *s_skew, *s_exit_guarded, *s_hold, *s_append, *s_qualname;

int no_arguments(const char *type_name, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) == 0 && (kwargs == NULL || PyDict_GET_SIZE(kwargs) == 0))
        return 0;
    PyErr_Format(PyExc_TypeError, "%s() takes no arguments", type_name);
    return -1;
}

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_hot_path_c", "The tracer's hot path in C (distcheck.rank.hot_path).", -1, NULL,
};

PyMODINIT_FUNC PyInit__hot_path_c(void) {
    struct { PyObject **slot; const char *text; } names[] = {
        {&s_shape, "shape"}, {&s_dtype, "dtype"}, {&s_is_cpu, "is_cpu"},
        {&s_device, "device"}, {&s_key, "key"}, {&s_counter, "counter"}, {&s_base, "base"},
        {&s_written, "written"}, {&s_key_base, "key_base"}, {&s_e_word, "e_word"}, {&s_skew, "skew"},
        {&s_exit_guarded, "_exit_guarded"}, {&s_hold, "_hold"}, {&s_append, "append"}, {&s_qualname, "__qualname__"},
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
        Py_INCREF(types[i].type);
        if (PyModule_AddObject(m, types[i].name, (PyObject *)types[i].type) < 0) {
            Py_DECREF(types[i].type);
            Py_DECREF(m);
            return NULL;
        }
    }
    return m;
}
