/* A job of page-cached reads: the reads of one array a batch makes from the page cache,
 * checked once (with the GIL) and then taken in turn by every decode thread that calls
 * work(), each read made, decoded and copied as run_file makes one, without the GIL between
 * the reads. Python touches the job when it is made and once its last read is done. */
#include "native.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

/* per read: run_file's code (or NOT_RUN), the ns spent reading, the bytes read, the bytes
 * decoded and the elements written, and the ns of the whole read */
enum { R_CODE, R_READ_NS, R_NREAD, R_ENCODED, R_ELEMENTS, R_NS, R_WIDTH };
#define NOT_RUN 1 /* a code no read returns: skipped (the batch was cancelled) */

typedef struct {
    PyObject_HEAD
    task_t t;            /* every read's units: spans, ops, keep, one table */
    PyObject *paths;     /* a tuple of bytes (file system encoding), one per read */
    PyObject *roots_obj; /* bytes or None */
    Py_buffer offsets, lengths, sparse, bounds; /* per read; bounds: n_reads + 1 unit numbers */
    int flags;
    Py_ssize_t n_reads;
    Py_ssize_t *op_bounds; /* n_reads + 1: each read's ops */
    long long *results;    /* n_reads x R_WIDTH */
    Py_ssize_t next;       /* the next read to take (atomic) */
    Py_ssize_t completed;  /* reads made or skipped (atomic) */
} job_t;

static void job_dealloc(job_t *j) {
    dm_task_release(&j->t);
    Py_XDECREF(j->paths);
    Py_XDECREF(j->roots_obj);
    PyBuffer_Release(&j->offsets);
    PyBuffer_Release(&j->lengths);
    PyBuffer_Release(&j->sparse);
    PyBuffer_Release(&j->bounds);
    free(j->op_bounds);
    free(j->results);
    Py_TYPE(j)->tp_free((PyObject *)j);
}

static PyTypeObject JobType;

/*
 * file_job(paths, flags, roots, offsets, lengths, sparse, bounds, <the task arguments of run>)
 *   paths: a tuple of bytes, one file per read; flags and roots as run_file takes them (one
 *          store's)
 *   offsets, lengths: int64 per read, as run_file's (length -1: the whole file)
 *   sparse: uint8 per read (nonzero: only its units' spans are read)
 *   bounds: int64 (n_reads + 1): read r holds units bounds[r] .. bounds[r + 1] of the task,
 *           whose spans, ops and keep name the units of every read, in read order
 */
PyObject *dm_py_file_job(PyObject *self, PyObject *args) {
    job_t *j = PyObject_New(job_t, &JobType);
    if (!j) return NULL;
    memset((char *)j + sizeof(PyObject), 0, sizeof(job_t) - sizeof(PyObject));
    PyObject *paths, *roots;
    if (!PyArg_ParseTuple(args, "O!iOy*y*y*y*" TASK_FORMAT, &PyTuple_Type, &paths, &j->flags, &roots, &j->offsets,
                          &j->lengths, &j->sparse, &j->bounds, TASK_ARGS(j->t))) {
        Py_DECREF(j);
        return NULL;
    }
    Py_INCREF(paths);
    j->paths = paths;
    Py_INCREF(roots);
    j->roots_obj = roots;
    if (dm_task_prepare(&j->t) != 0) {
        Py_DECREF(j);
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(paths);
    j->n_reads = n;
    const int64_t *bounds = (const int64_t *)j->bounds.buf;
    if (roots != Py_None && !PyBytes_Check(roots)) {
        PyErr_SetString(PyExc_TypeError, "file_job: roots must be bytes or None");
    } else if (j->offsets.len != n * 8 || j->lengths.len != n * 8 || j->sparse.len != n || j->bounds.len != (n + 1) * 8) {
        PyErr_SetString(PyExc_ValueError, "file_job needs an offset, a length and a sparse flag per read, and n + 1 bounds");
    } else {
        for (Py_ssize_t i = 0; i < n && !PyErr_Occurred(); i++)
            if (!PyBytes_Check(PyTuple_GET_ITEM(paths, i))) PyErr_SetString(PyExc_TypeError, "file_job: paths must be bytes");
        for (Py_ssize_t r = 0; r < n && !PyErr_Occurred(); r++)
            if (bounds[r] < 0 || bounds[r + 1] < bounds[r] || bounds[r + 1] > j->t.n_units)
                PyErr_SetString(PyExc_ValueError, "file_job: bounds must rise within the units");
        if (!PyErr_Occurred() && (bounds[0] != 0 || bounds[n] != j->t.n_units))
            PyErr_SetString(PyExc_ValueError, "file_job: the reads must hold every unit");
    }
    if (PyErr_Occurred()) {
        Py_DECREF(j);
        return NULL;
    }
    j->op_bounds = malloc(sizeof(Py_ssize_t) * (size_t)(n + 1));
    j->results = calloc((size_t)(n ? n : 1) * R_WIDTH, sizeof(long long));
    if (!j->op_bounds || !j->results) {
        Py_DECREF(j);
        return PyErr_NoMemory();
    }
    /* the ops are grouped by unit in unit order (checked by dm_task_prepare): each read's in one run */
    const int64_t *ops = (const int64_t *)j->t.ops.buf;
    Py_ssize_t q = 0;
    for (Py_ssize_t r = 0; r <= n; r++) {
        while (q < j->t.n_ops && ops[q * j->t.width] - j->t.base < bounds[r]) q++;
        j->op_bounds[r] = q;
    }
    for (Py_ssize_t r = 0; r < n; r++) j->results[r * R_WIDTH + R_CODE] = NOT_RUN;
    return (PyObject *)j;
}

/* Read r of the job as run_file reads a task, on a view of the job's tables holding its units. */
static void job_read(job_t *j, Py_ssize_t r) {
    const int64_t *bounds = (const int64_t *)j->bounds.buf;
    Py_ssize_t u0 = bounds[r], n_units = bounds[r + 1] - u0, o0 = j->op_bounds[r];
    task_t sub = j->t; /* its buffers stay the job's: only views into them are adjusted */
    sub.spans.buf = (char *)j->t.spans.buf + 16 * u0;
    sub.spans.len = 16 * n_units;
    sub.ops.buf = (char *)j->t.ops.buf + 8 * sub.width * o0;
    sub.ops.len = 8 * sub.width * (j->op_bounds[r + 1] - o0);
    sub.n_units = n_units;
    sub.n_ops = j->op_bounds[r + 1] - o0;
    sub.base = j->t.base + u0;
    if (j->t.keep.len) {
        sub.keep.buf = (char *)j->t.keep.buf + 8 * u0;
        sub.keep.len = 8 * n_units;
    }
    sub.views = j->t.views + u0;
    sub.status = j->t.status + u0;
    sub.err_codes = j->t.err_codes + u0;
    long long *out = j->results + r * R_WIDTH;
    const char *path = PyBytes_AS_STRING(PyTuple_GET_ITEM(j->paths, r));
    const char *roots = j->roots_obj == Py_None ? NULL : PyBytes_AS_STRING(j->roots_obj);
    size_t roots_len = j->roots_obj == Py_None ? 0 : (size_t)PyBytes_GET_SIZE(j->roots_obj);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    long long read_ns = 0, nread = 0;
    int code = dm_file_task(path, j->flags, roots, roots_len, ((const int64_t *)j->offsets.buf)[r],
                            ((const int64_t *)j->lengths.buf)[r], ((const uint8_t *)j->sparse.buf)[r] != 0, &sub, &read_ns,
                            &nread);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    out[R_READ_NS] = read_ns;
    out[R_NREAD] = nread;
    out[R_ENCODED] = code == 0 ? sub.encoded : 0;
    out[R_ELEMENTS] = code == 0 ? sub.elements : 0;
    out[R_NS] = (long long)(t1.tv_sec - t0.tv_sec) * 1000000000LL + (t1.tv_nsec - t0.tv_nsec);
    out[R_CODE] = code;
}

/* work(skip=False, most=-1): take the job's reads in turn (at most `most` of them; -1: as many
 * as are left) and make them without the GIL, or with skip mark them not run. Returns
 * (last, more): whether this call completed the job's last read (the caller then takes the
 * results), and whether reads are left for another call to take. */
static PyObject *job_work(job_t *j, PyObject *args) {
    int skip = 0;
    Py_ssize_t most = -1;
    if (!PyArg_ParseTuple(args, "|pn", &skip, &most)) return NULL;
    int last = 0;
    Py_ssize_t taken = 0;
    Py_BEGIN_ALLOW_THREADS;
    while (most < 0 || taken < most) {
        Py_ssize_t r = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (r >= j->n_reads) break;
        taken++;
        if (!skip) job_read(j, r);
        /* acq_rel: the call that completes the last read sees every read's results */
        if (__atomic_add_fetch(&j->completed, 1, __ATOMIC_ACQ_REL) == j->n_reads) last = 1;
    }
    Py_END_ALLOW_THREADS;
    int more = __atomic_load_n(&j->next, __ATOMIC_RELAXED) < j->n_reads;
    return Py_BuildValue("(OO)", last ? Py_True : Py_False, more ? Py_True : Py_False);
}

/* results(): once every read is completed, (per read its R_WIDTH int64 figures as bytes, the
 * failures of every read made, units counted over the job). */
static PyObject *job_results(job_t *j, PyObject *noargs) {
    if (__atomic_load_n(&j->completed, __ATOMIC_ACQUIRE) != j->n_reads) {
        PyErr_SetString(PyExc_RuntimeError, "the job's reads are not all completed");
        return NULL;
    }
    PyObject *failures = dm_task_failures(&j->t); /* units of reads not made have status OK */
    if (!failures) return NULL;
    return Py_BuildValue("(y#N)", (const char *)j->results, (Py_ssize_t)(j->n_reads * R_WIDTH * 8), failures);
}

static PyMethodDef job_methods[] = {
    {"work", (PyCFunction)job_work, METH_VARARGS, "Take reads of the job in turn and make them without the GIL: (last, more)."},
    {"results", (PyCFunction)job_results, METH_NOARGS, "Per read its figures (int64 bytes), and the failed units."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject JobType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "damacy_server.native._assemble.FileJob",
    .tp_basicsize = sizeof(job_t),
    .tp_dealloc = (destructor)job_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The page-cached reads of one array for a batch, taken in turn by the threads that call work().",
    .tp_methods = job_methods,
};

/* the type readied and added to the module as FileJob (its tp_name's last part) */
int dm_job_ready(PyObject *module) { return PyModule_AddType(module, &JobType); }
