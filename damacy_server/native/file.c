#include "native.h"

#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

/*
 * run_file(path, flags, roots, offset, length, sparse, spans, ops, base, targets, unit_shape,
 *          src_type, dst_type, swap, codec, decoded_nbytes, pool)
 * As run, reading bytes [offset, offset + length) of the file at path (length -1: all of it)
 * first, or with sparse only the units' spans in it (the holes between them are not read and
 * not touched), all without the GIL, but only from the page cache: a read that would wait for the
 * device (or that the file system cannot promise not to) is not made. roots (None, or the
 * store's roots as open_checked takes them) applies FileStore.open's rule. Returns
 * (code, failures, read_ns, nbytes, encoded, elements): code 0, the bytes read and the rest as
 * run's; or code -1 (not in the page cache, a short or failed read, reads without waiting
 * unsupported, or not a regular file), -2 (larger than RUN_FILE_MAX), -3 (outside the roots)
 * or an errno from open, with nothing copied: the caller reads the ordinary way, which
 * reports errors fully.
 */
#ifdef RWF_NOWAIT
/* Read length bytes at offset into buf, only from the page cache: 0, or -1 when a read would
 * wait for the device (EAGAIN), is unsupported, fails or ends short. */
static int read_cached(int fd, char *buf, long long offset, long long length) {
    long long got = 0;
    while (got < length) {
        struct iovec iov = {buf + got, (size_t)(length - got)};
        ssize_t r = preadv2(fd, &iov, 1, (off_t)(offset + got), RWF_NOWAIT);
        if (r <= 0) return -1;
        got += r;
    }
    return 0;
}
#endif

/* Without the GIL: read the task's bytes as run_file does (only from the page cache), then
 * locate and assemble its units. Returns run_file's code (0: done); the time spent reading
 * and the bytes read into *read_ns and *nread. */
int dm_file_task(const char *path, int flags, const char *roots, size_t roots_len, long long offset, long long length,
                 int sparse, task_t *t, long long *read_ns, long long *nread) {
    int code = -1;
    *read_ns = 0;
    *nread = 0;
#ifdef RWF_NOWAIT
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    char *buf = NULL;
    long long size = -1;
    int fd = dm_open_checked(path, flags, roots, roots_len, &code, &size);
    if (fd >= 0) {
        code = -1;
        if (length < 0) {
            offset = 0;
            length = size;
        }
        if (length > RUN_FILE_MAX) code = -2;
        if (offset >= 0 && length >= 0 && length <= RUN_FILE_MAX && (buf = malloc((size_t)length + 1))) {
            if (!sparse) {
                code = read_cached(fd, buf, offset, length);
                *nread = length;
            } else { /* each run of adjacent spans in one read, at its place in buf */
                const int64_t *spans = (const int64_t *)t->spans.buf;
                long long from = 0, to = 0; /* the run being gathered, relative to offset */
                code = 0;
                for (Py_ssize_t u = 0; u <= t->n_units && code == 0; u++) {
                    long long a = 0, b = 0;
                    if (u < t->n_units) {
                        a = spans[2 * u] - offset;
                        b = a + spans[2 * u + 1];
                        if (spans[2 * u + 1] < 0 || a < 0 || b > length) code = -1;
                        if (code == 0 && a <= to && b >= from && to > from) { /* touches the run: extend it */
                            if (a < from) from = a;
                            if (b > to) to = b;
                            continue;
                        }
                    }
                    if (code == 0 && to > from) {
                        code = read_cached(fd, buf + from, offset + from, to - from);
                        *nread += to - from;
                    }
                    from = a;
                    to = b;
                }
            }
        }
        close(fd);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    *read_ns = (long long)(t1.tv_sec - t0.tv_sec) * 1000000000LL + (t1.tv_nsec - t0.tv_nsec);
    if (code == 0) {
        dm_task_locate(t, buf, (Py_ssize_t)length, offset);
        dm_task_assemble(t);
    } else {
        *nread = 0;
    }
    free(buf);
#else
    (void)path, (void)flags, (void)roots, (void)roots_len, (void)offset, (void)length, (void)sparse, (void)t;
#endif
    return code;
}

PyObject *dm_py_run_file(PyObject *self, PyObject *args) {
    PyObject *path_obj;
    int flags;
    const char *roots = NULL;
    Py_ssize_t roots_len = 0;
    long long offset, length;
    int sparse;
    task_t t;
    memset(&t, 0, sizeof t);
    if (!PyArg_ParseTuple(args, "O&iz#LLp" TASK_FORMAT, PyUnicode_FSConverter, &path_obj, &flags, &roots, &roots_len,
                          &offset, &length, &sparse, TASK_ARGS(t)))
        return NULL;
    PyObject *result = NULL;
    int code = 0;
    long long read_ns = 0, nread = 0;
    if (dm_task_prepare(&t) == 0) {
        const char *path = PyBytes_AS_STRING(path_obj);
        Py_BEGIN_ALLOW_THREADS;
        code = dm_file_task(path, flags, roots, (size_t)roots_len, offset, length, sparse, &t, &read_ns, &nread);
        Py_END_ALLOW_THREADS;
        if (code == 0) {
            PyObject *failures = dm_task_failures(&t);
            if (failures) result = Py_BuildValue("(iNLLLL)", 0, failures, read_ns, nread, t.encoded, t.elements);
        } else {
            result = Py_BuildValue("(iOLLLL)", code, Py_None, read_ns, 0LL, 0LL, 0LL);
        }
    }
    dm_task_release(&t);
    Py_DECREF(path_obj);
    return result;
}
