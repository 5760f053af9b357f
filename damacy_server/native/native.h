/*
 * What the files of damacy_server.native._assemble share. One extension, a file per job:
 *   module.c   the Python module: its functions, what it supports
 *   task.c     a decode task: tables checked (with the GIL), units decoded and copied
 *              (without it), failures reported; run and run_decoded
 *   file.c     run_file: a read from the page cache, then the task, all without the GIL
 *   job.c      a batch's page-cached reads of one array, taken in turn by the decode threads
 *   zstd.c     libzstd found at run time, a context per thread, frames decoded as far as needed
 *   blosc.c    C-Blosc through numcodecs' library, frames checked before it reads them
 *   convert.c  element conversions (numpy's rounding): rows, gathers, scatters, their tables
 *   copy.c     one op's box copied into its sample (contiguous, index lists, strided views)
 *   open.c     files opened inside the roots (openat2, else the descriptor's location)
 *   lz4.c      the walk that checks an LZ4 block before nvCOMP decodes it
 *   plan.c     the planner's box rows, distinct units and copy tables, in one pass each
 *   cache.c    the chunk cache's index: keys, values, order and adaptive admission
 * Shared symbols are prefixed dm_ and hidden from other libraries (-fvisibility=hidden).
 */
#ifndef DAMACY_NATIVE_H
#define DAMACY_NATIVE_H

#define PY_SSIZE_T_CLEAN
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* preadv2, O_PATH */
#endif
#include <Python.h>
#include <stddef.h>
#include <stdint.h>

#define MAX_NDIM 8

/* dtype codes shared with Python */
enum { T_BOOL, T_I1, T_U1, T_I2, T_U2, T_I4, T_U4, T_I8, T_U8, T_F2, T_F4, T_F8, T_BF16, T_COUNT };
static const int ITEMSIZE[T_COUNT] = {1, 1, 1, 2, 2, 4, 4, 8, 8, 2, 4, 8, 2};
/* codecs, and a unit's status (shared with Python: native/__init__.py) */
enum { CODEC_RAW = 0, CODEC_ZSTD = 1, CODEC_BLOSC = 2 };
enum { OK = 0, E_ZSTD = 1, E_SIZE = 2, E_NOZSTD = 3, E_BLOSC = 4, E_OPS = 5, E_MEMORY = 6 };

/* ---- zstd (zstd.c) -------------------------------------------------------------------- */
typedef void *(*zstd_create_t)(void);
typedef size_t (*zstd_free_t)(void *);
typedef size_t (*zstd_decompress_t)(void *, void *, size_t, const void *, size_t);
typedef unsigned (*zstd_iserror_t)(size_t);
typedef const char *(*zstd_errname_t)(size_t);
typedef struct { const void *src; size_t size; size_t pos; } zstd_in;
typedef struct { void *dst; size_t size; size_t pos; } zstd_out;
typedef size_t (*zstd_stream_t)(void *, zstd_out *, zstd_in *);
typedef size_t (*zstd_reset_t)(void *, int);
typedef unsigned long long (*zstd_content_size_t)(const void *, size_t);
typedef size_t (*zstd_frame_size_t)(const void *, size_t);
typedef size_t (*zstd_set_parameter_t)(void *, int, int);
typedef size_t (*zstd_sizeof_t)(const void *);
extern int dm_zstd_ok; /* -1: not tried yet; 1: libzstd loaded; 0: not found */
extern zstd_decompress_t dm_zstd_decompress;
extern zstd_iserror_t dm_zstd_iserror;
extern zstd_errname_t dm_zstd_errname;
int dm_zstd_load(void);
void *dm_zstd_dctx(void);
void dm_zstd_trim(void);
size_t dm_zstd_prefix(void *dctx, char *dst, size_t full, size_t need, const void *src, size_t len, size_t *got, int *whole);

/* ---- Blosc (blosc.c) ------------------------------------------------------------------- */
typedef int (*blosc_getitem_t)(const void *src, int start, int nitems, void *dest);
typedef int (*blosc_decompress_t)(const void *src, void *dest, size_t destsize, int numinternalthreads);
extern blosc_getitem_t dm_blosc_getitem;
extern blosc_decompress_t dm_blosc_decompress;
int dm_blosc_frame_ok(const unsigned char *p, Py_ssize_t len, Py_ssize_t nbytes_expected, int64_t b0, int64_t b1);
PyObject *dm_py_use_blosc(PyObject *self, PyObject *args);

/* ---- conversions (convert.c) and copies (copy.c) ---------------------------------------- */
/* nm: the sample's normalisation (offset, scale) for the normalising rows, ignored by the others */
typedef void (*row_fn)(const char *src, char *dst, Py_ssize_t n, int swap, const double *nm);
typedef void (*gather_fn)(const char *src, const int64_t *index, char *dst, Py_ssize_t n, int swap, const double *nm);
typedef void (*scatter_fn)(const char *src, int64_t src_start, const int64_t *src_index, char *dst,
                           const int64_t *dst_index, Py_ssize_t n, int swap, const double *nm);
/* [src][dst]: a row copy, a gather from an index list and a scatter to one; NULL: left to
 * the numpy path (damacy_server/decode/contract.py, the same rules) */
typedef struct {
    row_fn row;
    gather_fn gather;
    scatter_fn scatter;
} conv_t;
extern const conv_t dm_conv[T_COUNT][T_COUNT];
extern const conv_t dm_nconv[T_COUNT][T_COUNT]; /* the normalising ones: float outputs only */
void dm_copy_box(const char *chunk, const int64_t *unit_shape, int ndim, int src_size, char *dst_base,
                 const int64_t *dst_strides, int dst_size, const int64_t *src_start, const int64_t *dst_start,
                 const int64_t *extent, const int64_t *pool, row_fn row, gather_fn gather, scatter_fn scatter, int swap,
                 const double *nm);

/* ---- the task (task.c) ------------------------------------------------------------------ */
typedef struct {
    const char *src;  /* encoded bytes */
    Py_ssize_t src_len;
} unit_in;

/* a target row: address, strides, shape, then the normalisation flag, offset and scale (f64 bits) */
#define TARGET_WIDTH(ndim) (4 + 2 * (ndim))

/* One decode task: the units' encoded bytes, the op table and where the copies go. */
typedef struct {
    Py_buffer spans, ops, targets, shape, pool, keep;
    long long base; /* the unit number of the first span: ops name units base, base + 1, ... */
    int src_type, dst_type, swap, codec;
    Py_ssize_t decoded_nbytes;
    long long encoded, elements; /* of the units decoded and copied: bytes read, elements written */
    Py_ssize_t n_units, n_ops, n_targets, width;
    int ndim;
    unit_in *views;
    int *status;
    size_t *err_codes;
} task_t;

#define TASK_FORMAT "y*y*Ly*y*iiiiny*|y*"
#define TASK_ARGS(t) &(t).spans, &(t).ops, &(t).base, &(t).targets, &(t).shape, &(t).src_type, &(t).dst_type, &(t).swap, \
                     &(t).codec, &(t).decoded_nbytes, &(t).pool, &(t).keep

void dm_task_release(task_t *t);
int dm_task_prepare(task_t *t);
void dm_task_locate(task_t *t, const char *data, Py_ssize_t data_len, long long data_offset);
void dm_task_assemble(task_t *t);
PyObject *dm_task_failures(task_t *t);
PyObject *dm_py_run(PyObject *self, PyObject *args);
PyObject *dm_py_run_decoded(PyObject *self, PyObject *args);

/* ---- files (open.c, file.c) and LZ4 (lz4.c) ------------------------------------------- */
#define RUN_FILE_MAX (16 << 20) /* the largest read run_file makes (module constant RUN_FILE_MAX) */
/* a flag of dm_open_checked (no open(2) flag uses this bit): advise random access */
#define DM_NO_READAHEAD (1 << 30)
int dm_open_checked(const char *path, int flags, const char *roots, size_t roots_len, int *code, long long *size);
PyObject *dm_py_open_checked(PyObject *self, PyObject *args);
PyObject *dm_py_run_file(PyObject *self, PyObject *args);
int dm_file_task(const char *path, int flags, const char *roots, size_t roots_len, long long offset, long long length,
                 int sparse, task_t *t, long long *read_ns, long long *nread);
PyObject *dm_py_file_job(PyObject *self, PyObject *args);
int dm_job_ready(PyObject *module);
PyObject *dm_py_box_rows(PyObject *self, PyObject *args);
PyObject *dm_py_unique_units(PyObject *self, PyObject *args);
PyObject *dm_py_plan_table(PyObject *self, PyObject *args);
PyObject *dm_py_merge_reads(PyObject *self, PyObject *args);
PyObject *dm_py_check_lz4(PyObject *self, PyObject *args);
int dm_cache_ready(PyObject *module);

#endif
