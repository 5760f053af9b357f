/*
 * The host twin of the CUDA kernels: the headers in kernels/ compiled by the C compiler, each kernel
 * run block by block and thread by thread by a loop launcher. Python loads this module's
 * launchers with ctypes (damacy_server/cuda/twin.py); the module object itself is empty.
 * A launch returns 1 when a bounds check failed in any thread, else 0.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "kernels/assemble.cuh"
#include "kernels/shuffle.cuh"

_Thread_local int64_t damacy_twin_block, damacy_twin_thread, damacy_twin_block_dim, damacy_twin_grid_dim;
_Thread_local int damacy_twin_fault;

#define TWIN_LAUNCH(GRID, BLOCK, CALL)                                                     \
    do {                                                                                   \
        damacy_twin_fault = 0;                                                             \
        damacy_twin_grid_dim = (GRID);                                                     \
        damacy_twin_block_dim = (BLOCK);                                                   \
        for (damacy_twin_block = 0; damacy_twin_block < (GRID); damacy_twin_block++)       \
            for (damacy_twin_thread = 0; damacy_twin_thread < (BLOCK); damacy_twin_thread++) \
                CALL;                                                                      \
        return damacy_twin_fault;                                                          \
    } while (0)

int damacy_twin_assemble(int64_t grid, int64_t block, const int64_t *rows, int64_t n_rows, int ndim,
                         const int64_t *pool, int64_t pool_len, const char *const *unit_ptr, int64_t n_units,
                         const int64_t *unit_shape, int src_dtype, int swap, char *const *out_ptr, int64_t n_samples,
                         const int64_t *out_shape, const int64_t *out_strides, int out_dtype, const double *norm) {
    TWIN_LAUNCH(grid, block,
                damacy_assemble(rows, n_rows, ndim, pool, pool_len, unit_ptr, n_units, unit_shape, src_dtype, swap,
                                out_ptr, n_samples, out_shape, out_strides, out_dtype, norm));
}

int damacy_twin_fill(int64_t grid, int64_t block, const int64_t *samples, int64_t n_fill, const char *fill_values,
                     int src_dtype, int swap, char *const *out_ptr, int64_t n_samples, int64_t count, int out_dtype,
                     const double *norm) {
    TWIN_LAUNCH(grid, block,
                damacy_fill(samples, n_fill, fill_values, src_dtype, swap, out_ptr, n_samples, count, out_dtype, norm));
}

int damacy_twin_convert(int64_t grid, int64_t block, const char *src, int src_dtype, int swap, char *out, int out_dtype,
                        int64_t n) {
    TWIN_LAUNCH(grid, block, damacy_convert(src, src_dtype, swap, out, out_dtype, n));
}

int damacy_twin_unshuffle(int64_t grid, int64_t block, const char *const *src, char *const *dst, const int64_t *size,
                          int64_t n_blocks, int64_t typesize, int mode) {
    TWIN_LAUNCH(grid, block, damacy_unshuffle(src, dst, size, n_blocks, typesize, mode));
}

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_twin", "The host twin of damacy's CUDA kernels (launchers for ctypes).", -1,
    NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__twin(void) { return PyModule_Create(&module); }
