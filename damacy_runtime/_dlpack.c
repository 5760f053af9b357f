/* The two C entry points of damacy's DLPack producer (damacy_runtime/dlpack.py builds the
 * structures): the managed tensor's deleter and the capsule's destructor.
 *
 * Both may run while a Python exception is pending (a consumer that refused the tensor
 * drops the capsule with its error set) and the deleter on a thread without the GIL (a
 * consumer freeing the tensor from C), which a ctypes callback does not survive. So they
 * are C: each takes the GIL, sets any pending error aside, calls the Python release
 * function with the managed tensor's address (the capsule's pointer), and puts the error
 * back.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static PyObject *release_fn = NULL; /* dlpack._delete(address) */

static void call_release(void *address) {
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (release_fn != NULL) {
        PyObject *r = PyObject_CallFunction(release_fn, "K", (unsigned long long)(uintptr_t)address);
        if (r == NULL)
            PyErr_WriteUnraisable(release_fn);
        Py_XDECREF(r);
    }
    PyErr_Restore(type, value, tb);
    PyGILState_Release(gil);
}

static void deleter(void *managed) { call_release(managed); }

static void capsule_destructor(PyObject *capsule) {
    /* A consumer renames the capsule when it takes the tensor and calls the deleter itself;
     * a capsule still under its own name was never taken. */
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    const char *name = PyCapsule_GetName(capsule);
    if (name != NULL && (strcmp(name, "dltensor") == 0 || strcmp(name, "dltensor_versioned") == 0)) {
        void *p = PyCapsule_GetPointer(capsule, name);
        if (p != NULL)
            call_release(p);
    }
    PyErr_Clear();
    PyErr_Restore(type, value, tb);
}

static PyObject *set_release(PyObject *self, PyObject *fn) {
    if (!PyCallable_Check(fn)) {
        PyErr_SetString(PyExc_TypeError, "set_release takes a callable");
        return NULL;
    }
    Py_XSETREF(release_fn, Py_NewRef(fn));
    Py_RETURN_NONE;
}

static PyObject *addresses(PyObject *self, PyObject *unused) {
    return Py_BuildValue("KK", (unsigned long long)(uintptr_t)&deleter, (unsigned long long)(uintptr_t)&capsule_destructor);
}

static PyMethodDef methods[] = {
    {"set_release", set_release, METH_O, "set_release(fn): fn(address) runs when a managed tensor is deleted"},
    {"addresses", addresses, METH_NOARGS, "(deleter, capsule destructor): their addresses"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_dlpack", NULL, -1, methods};

PyMODINIT_FUNC PyInit__dlpack(void) { return PyModule_Create(&module); }
