#include "native.h"

#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

/*
 * run_file(path, flags, roots, offset, length, spans, ops, base, targets, unit_shape, src_type,
 *          dst_type, swap, codec, decoded_nbytes, pool)
 * As run, reading bytes [offset, offset + length) of the file at path (length -1: all of it)
 * first, all without the GIL, but only from the page cache: a read that would wait for the
 * device (or that the file system cannot promise not to) is not made. roots (None, or the
 * store's roots as open_checked takes them) applies FileStore.open's rule. Returns
 * (code, failures, read_ns, nbytes, encoded, elements): code 0, the bytes read and the rest as
 * run's; or code -1 (not in the page cache, a short or failed read, reads without waiting
 * unsupported, or not a regular file), -2 (larger than RUN_FILE_MAX), -3 (outside the roots)
 * or an errno from open, with nothing copied: the caller reads the ordinary way, which
 * reports errors fully.
 */
PyObject *dm_py_run_file(PyObject *self, PyObject *args) {
    PyObject *path_obj;
    int flags;
    const char *roots = NULL;
    Py_ssize_t roots_len = 0;
    long long offset, length;
    task_t t;
    memset(&t, 0, sizeof t);
    if (!PyArg_ParseTuple(args, "O&iz#LL" TASK_FORMAT, PyUnicode_FSConverter, &path_obj, &flags, &roots, &roots_len,
                          &offset, &length, TASK_ARGS(t)))
        return NULL;
    PyObject *result = NULL;
    int code = 0;
    long long read_ns = 0;
    if (dm_task_prepare(&t) == 0) {
        const char *path = PyBytes_AS_STRING(path_obj);
        Py_BEGIN_ALLOW_THREADS;
        code = -1;
#ifdef RWF_NOWAIT
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        char *buf = NULL;
        long long size = -1;
        int fd = dm_open_checked(path, flags, roots, (size_t)roots_len, &code, &size);
        if (fd >= 0) {
            code = -1;
            if (length < 0) {
                offset = 0;
                length = size;
            }
            if (length > RUN_FILE_MAX) code = -2;
            if (offset >= 0 && length >= 0 && length <= RUN_FILE_MAX && (buf = malloc((size_t)length + 1))) {
                long long got = 0;
                while (got < length) {
                    struct iovec iov = {buf + got, (size_t)(length - got)};
                    ssize_t r = preadv2(fd, &iov, 1, (off_t)(offset + got), RWF_NOWAIT);
                    if (r <= 0) break; /* EAGAIN (not cached), unsupported, an error or the end */
                    got += r;
                }
                if (got == length) code = 0;
            }
            close(fd);
        }
        clock_gettime(CLOCK_MONOTONIC, &t1);
        read_ns = (long long)(t1.tv_sec - t0.tv_sec) * 1000000000LL + (t1.tv_nsec - t0.tv_nsec);
        if (code == 0) {
            dm_task_locate(&t, buf, (Py_ssize_t)length, offset);
            dm_task_assemble(&t);
        }
        free(buf);
#endif
        Py_END_ALLOW_THREADS;
        if (code == 0) {
            PyObject *failures = dm_task_failures(&t);
            if (failures) result = Py_BuildValue("(iNLLLL)", 0, failures, read_ns, length, t.encoded, t.elements);
        } else {
            result = Py_BuildValue("(iOLLLL)", code, Py_None, read_ns, 0LL, 0LL, 0LL);
        }
    }
    dm_task_release(&t);
    Py_DECREF(path_obj);
    return result;
}
