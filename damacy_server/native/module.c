/*
 * damacy_server.native._assemble: decode read units and copy their boxes into batch slots,
 * with the cast, for a whole decode task in one call that releases the GIL.
 *
 * The Python side (damacy_server/native/__init__.py) hands over:
 *   - the units' encoded bytes (a list of buffers) and, per unit, the codec and sizes;
 *   - an op table (int64): per copy the unit, the sample, and per axis the source start,
 *     the destination start and the extent;
 *   - per sample the destination's address and strides (elements of the output dtype).
 * zstd is reached through the system's libzstd (dlopen, no build-time dependency). Every
 * element conversion follows damacy's numeric contract (convert.c); the pairs not offered
 * here (float to integer, f64 to bf16/f16) are left to its numpy reference.
 */
#include "native.h"

#include <string.h>

/* supports(src, dst, normalized=0): whether the cast (or, normalized, the normalising one) is offered */
static PyObject *supports(PyObject *self, PyObject *args) {
    int src_type, dst_type, normalized = 0;
    if (!PyArg_ParseTuple(args, "ii|p", &src_type, &dst_type, &normalized)) return NULL;
    int ok = src_type >= 0 && src_type < T_COUNT && dst_type >= 0 && dst_type < T_COUNT &&
             (normalized ? dm_nconv[src_type][dst_type].row : dm_conv[src_type][dst_type].row);
    return PyBool_FromLong(ok);
}

static PyObject *has_zstd(PyObject *self, PyObject *noargs) {
    if (dm_zstd_ok < 0) dm_zstd_ok = dm_zstd_load();
    return PyBool_FromLong(dm_zstd_ok);
}

/* addresses(arrays, nbytes[, format, shape]): bytes of int64, per object the address of its
 * buffer when that is C-contiguous and exactly nbytes long (and, when given, of the buffer
 * format string `format` and the dims `shape`, a tuple), else 0. One call checks a batch's
 * cached units, no Python per unit. The caller keeps the objects alive while the addresses
 * are used (numpy arrays never move their data). */
static PyObject *addresses(PyObject *self, PyObject *args) {
    PyObject *seq, *shape_obj = Py_None;
    Py_ssize_t nbytes;
    const char *format = NULL;
    if (!PyArg_ParseTuple(args, "On|zO", &seq, &nbytes, &format, &shape_obj)) return NULL;
    Py_ssize_t dims[MAX_NDIM];
    Py_ssize_t ndim = -1; /* -1: not checked */
    if (shape_obj != Py_None) {
        if (!PyTuple_Check(shape_obj) || PyTuple_GET_SIZE(shape_obj) > MAX_NDIM) {
            PyErr_SetString(PyExc_ValueError, "addresses: shape must be a tuple of at most MAX_NDIM ints");
            return NULL;
        }
        ndim = PyTuple_GET_SIZE(shape_obj);
        for (Py_ssize_t d = 0; d < ndim; d++) {
            dims[d] = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape_obj, d));
            if (dims[d] == -1 && PyErr_Occurred()) return NULL;
        }
    }
    int flags = PyBUF_C_CONTIGUOUS | (format ? PyBUF_FORMAT : 0);
    PyObject *fast = PySequence_Fast(seq, "addresses needs a sequence");
    if (!fast) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(int64_t));
    if (!out) {
        Py_DECREF(fast);
        return NULL;
    }
    int64_t *addr = (int64_t *)PyBytes_AS_STRING(out);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_buffer view;
        addr[i] = 0;
        if (PyObject_GetBuffer(items[i], &view, flags) != 0) {
            PyErr_Clear();
            continue;
        }
        int ok = view.len == nbytes;
        if (ok && format) ok = view.format != NULL && strcmp(view.format, format) == 0;
        if (ok && ndim >= 0) {
            ok = view.ndim == ndim;
            for (Py_ssize_t d = 0; ok && d < ndim; d++) ok = view.shape[d] == dims[d];
        }
        if (ok) addr[i] = (int64_t)(intptr_t)view.buf;
        PyBuffer_Release(&view);
    }
    Py_DECREF(fast);
    return out;
}

static PyMethodDef methods[] = {
    {"addresses", addresses, METH_VARARGS, "Per object the address of its C-contiguous buffer of exactly nbytes (and the format and shape given), else 0 (int64 bytes)."},
    {"run", dm_py_run, METH_VARARGS, "Decode units and copy their boxes into the targets, without the GIL."},
    {"run_decoded", dm_py_run_decoded, METH_VARARGS, "Copy the boxes of units already decoded into the targets, without the GIL."},
    {"run_file", dm_py_run_file, METH_VARARGS, "Read a byte range from the page cache, then run, without the GIL."},
    {"file_job", dm_py_file_job, METH_VARARGS, "A job of page-cached reads of one array, taken in turn by the threads calling its work() (a FileJob)."},
    {"box_rows", dm_py_box_rows, METH_VARARGS, "The planner's copy rows of boxes: per box the units it cuts (int64 bytearray)."},
    {"unique_units", dm_py_unique_units, METH_VARARGS, "The distinct units of rows and each row's index in them (int64 bytearrays)."},
    {"plan_table", dm_py_plan_table, METH_VARARGS, "One array's copy table from its rows and its units' places (int64 bytearrays and the count of cached units)."},
    {"merge_reads", dm_py_merge_reads, METH_VARARGS, "A table's units to read grouped into reads: each read's first unit and the end of its bytes (int64 bytearrays)."},
    {"supports", supports, METH_VARARGS, "Whether the cast (or with normalized=True the normalising one) from one dtype code to another is offered."},
    {"check_lz4", dm_py_check_lz4, METH_VARARGS, "None, or why an LZ4 block does not decode to exactly the given size."},
    {"has_zstd", has_zstd, METH_NOARGS, "Whether libzstd could be loaded."},
    {"use_blosc", dm_py_use_blosc, METH_VARARGS, "Take blosc_getitem from the C-Blosc library at the given path."},
    {"open_checked", dm_py_open_checked, METH_VARARGS, "Open a regular file for reading, inside the roots when given."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_assemble", NULL, -1, methods};

PyMODINIT_FUNC PyInit__assemble(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "RUN_FILE_MAX", RUN_FILE_MAX) < 0) Py_CLEAR(m);
    if (m && PyModule_AddIntConstant(m, "NO_READAHEAD", DM_NO_READAHEAD) < 0) Py_CLEAR(m);
    if (m && dm_job_ready(m) < 0) Py_CLEAR(m);
    if (m && dm_cache_ready(m) < 0) Py_CLEAR(m);
    return m;
}
