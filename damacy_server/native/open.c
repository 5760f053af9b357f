#include "native.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Opening files inside the roots
 * roots (FileStore._roots_blob): one entry per allowed folder, "FD:PATH\0", FD a descriptor
 * of the folder (O_PATH) the store keeps open, PATH its resolved path. A file under PATH is
 * opened with openat2(FD, rest, RESOLVE_BENEATH): the kernel refuses any escape, in one
 * call. What openat2 cannot decide (an absolute symlink, a kernel without openat2, a path
 * not lexically under a root) is decided by the descriptor's real location: open with
 * O_PATH, read /proc/self/fd/N, check it against the roots, then open through it. */
#ifndef SYS_openat2
#define SYS_openat2 437
#endif
struct open_how_ { uint64_t flags, mode, resolve; };
#define RESOLVE_NO_MAGICLINKS_ 0x02
#define RESOLVE_BENEATH_ 0x08

/* The next root entry at *r: its descriptor and path (len bytes); advances *r. */
static int next_root(const char **r, const char *end, int *fd, const char **path, size_t *len) {
    if (*r >= end) return 0;
    size_t n = strnlen(*r, (size_t)(end - *r));
    const char *colon = memchr(*r, ':', n);
    *fd = colon ? atoi(*r) : -1;
    *path = colon ? colon + 1 : *r;
    *len = (size_t)(*r + n - *path);
    while (*len > 1 && (*path)[*len - 1] == '/') (*len)--; /* "/data/" matches like "/data" */
    *r += n + 1;
    return 1;
}

/* Is p[0:n] the root path[0:len], or below it? Returns the offset of the rest, or -1. */
static long below(const char *p, size_t n, const char *path, size_t len) {
    if (len == 1 && path[0] == '/') return p[0] == '/' ? 1 : -1;
    if (n < len || memcmp(p, path, len) != 0) return -1;
    if (n == len) return (long)len;
    return p[len] == '/' ? (long)len + 1 : -1;
}

/* A regular file's descriptor (fd itself, its size in *size), or -1 with *code -1 (fd closed). */
static int regular_only(int fd, int *code, long long *size) {
    struct stat st;
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode)) {
        *size = (long long)st.st_size;
        return fd;
    }
    close(fd);
    *code = -1;
    return -1;
}

static int open_checked(const char *path, int flags, const char *roots, size_t roots_len, int *code, long long *size);

/* Open path for reading as FileStore.open does: a descriptor (the file's size in *size), or
 * -1 with *code set (an errno, -1 for not a regular file, -3 for outside the roots). With
 * DM_NO_READAHEAD in flags the kernel is told the file is read at random (no readahead);
 * a kernel that refuses that fails the open with its errno. */
int dm_open_checked(const char *path, int flags, const char *roots, size_t roots_len, int *code, long long *size) {
    int random = flags & DM_NO_READAHEAD;
    int fd = open_checked(path, flags & ~DM_NO_READAHEAD, roots, roots_len, code, size);
#ifdef POSIX_FADV_RANDOM
    if (fd >= 0 && random) {
        int err = posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM);
        if (err != 0) {
            close(fd);
            *code = err;
            return -1;
        }
    }
#else
    (void)random;
#endif
    return fd;
}

static int open_checked(const char *path, int flags, const char *roots, size_t roots_len, int *code, long long *size) {
    flags |= O_NONBLOCK | O_CLOEXEC; /* a FIFO must not block a reader */
    if (!roots) {
        int fd = open(path, flags);
        if (fd < 0) { *code = errno; return -1; }
        return regular_only(fd, code, size);
    }
    size_t n = strlen(path);
    const char *r = roots, *end = roots + roots_len, *root;
    size_t len;
    int rootfd;
    while (next_root(&r, end, &rootfd, &root, &len)) {
        long rest = below(path, n, root, len);
        if (rest < 0 || rootfd < 0) continue;
        struct open_how_ how = {(uint64_t)flags, 0, RESOLVE_BENEATH_ | RESOLVE_NO_MAGICLINKS_};
        const char *rel = path[rest] ? path + rest : ".";
        int fd = (int)syscall(SYS_openat2, rootfd, rel, &how, sizeof how);
        if (fd >= 0) return regular_only(fd, code, size);
        if (errno == ENOENT || errno == ENOTDIR || errno == EACCES || errno == EISDIR) { *code = errno; return -1; }
        break; /* EXDEV (a link out of the folder, maybe into another root), ENOSYS, EPERM...: decide below */
    }
#ifndef O_PATH
    *code = -3;
    return -1;
#else
    int handle = open(path, O_PATH | O_CLOEXEC);
    if (handle < 0) { *code = errno; return -1; }
    char proc[64], real[4097];
    snprintf(proc, sizeof proc, "/proc/self/fd/%d", handle);
    ssize_t got = readlink(proc, real, sizeof real - 1);
    int inside = 0;
    if (got > 0 && got < (ssize_t)sizeof real - 1) {
        for (r = roots; !inside && next_root(&r, end, &rootfd, &root, &len);)
            inside = below(real, (size_t)got, root, len) >= 0;
    }
    int fd = -1;
    struct stat st;
    if (!inside) {
        *code = -3;
    } else if (fstat(handle, &st) != 0 || !S_ISREG(st.st_mode)) {
        *code = -1; /* never opened for reading */
    } else {
        fd = open(proc, flags); /* the checked file itself, not the path again */
        if (fd < 0) *code = errno;
        *size = (long long)st.st_size;
    }
    close(handle);
    return fd;
#endif
}

/* open_checked(path, flags, roots) -> (fd, code, size): FileStore.open's rule, for Python. */
PyObject *dm_py_open_checked(PyObject *self, PyObject *args) {
    PyObject *path_obj;
    int flags, code = 0, fd;
    long long size = 0;
    const char *roots = NULL;
    Py_ssize_t roots_len = 0;
    if (!PyArg_ParseTuple(args, "O&iz#", PyUnicode_FSConverter, &path_obj, &flags, &roots, &roots_len)) return NULL;
    const char *path = PyBytes_AS_STRING(path_obj);
    Py_BEGIN_ALLOW_THREADS;
    fd = dm_open_checked(path, flags, roots, (size_t)roots_len, &code, &size);
    Py_END_ALLOW_THREADS;
    Py_DECREF(path_obj);
    return Py_BuildValue("(iiL)", fd, code, size);
}
