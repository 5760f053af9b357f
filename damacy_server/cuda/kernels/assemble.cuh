/*
 * Batch assembly from a plan's copy table (damacy_server/plan.py, CopyTable): one block per
 * row (one unit's piece of one sample), its threads striding over the piece's elements.
 *
 * Row layout (2 + 3 * ndim int64 columns, as the CPU paths read it): the unit's position in
 * the unit table, the sample, then per axis the source start (in the unit), the destination
 * start (in the sample) and the extent; a negative start -(k + 1) on either side stands for
 * the index list pool[k : k + extent]. Units are decoded arrays of `unit_shape` (C order) in
 * the source dtype, at unit_ptr[pos] (byte order: swap when `swap`); sample s of the batch
 * is at out_ptr[s], of shape out_shape[s * ndim ...] with strides out_strides[s * ndim ...]
 * (elements; samples of one batch may differ there, as 2-d slices of a volume along
 * different axes do). No two rows write the same output element (the host checks it:
 * damacy_server/cuda/tables.py). `norm`, when not NULL, holds per sample three f64s: a flag
 * (nonzero: normalise), the offset and the scale (convert.cuh, normalize_value).
 */
#ifndef DAMACY_ASSEMBLE_CUH
#define DAMACY_ASSEMBLE_CUH

#include "convert.cuh"

#define DAMACY_MAX_NDIM 32

DAMACY_FN int64_t table_coord(const int64_t *pool, int64_t start, int64_t i) {
    return start >= 0 ? start + i : pool[-start - 1 + i];
}

DAMACY_FN int dtype_size(int dt) {
    switch (dt) {
    case DT_BOOL: case DT_I1: case DT_U1: return 1;
    case DT_I2: case DT_U2: case DT_F2: case DT_BF16: return 2;
    case DT_I4: case DT_U4: case DT_F4: return 4;
    default: return 8;
    }
}

DAMACY_KERNEL damacy_assemble(
    const int64_t *rows, int64_t n_rows, int ndim, const int64_t *pool, int64_t pool_len,
    const char *const *unit_ptr, int64_t n_units, const int64_t *unit_shape, int src_dtype, int swap,
    char *const *out_ptr, int64_t n_samples, const int64_t *out_shape, const int64_t *out_strides, int out_dtype,
    const double *norm)
{
    int64_t r = DAMACY_BLOCK;
    if (r >= n_rows) return;
    const int64_t *row = rows + r * (2 + 3 * ndim);
    int64_t pos = row[0], sample = row[1];
    DAMACY_CHECK(pos >= 0 && pos < n_units && sample >= 0 && sample < n_samples && ndim <= DAMACY_MAX_NDIM);
    int src_size = dtype_size(src_dtype), out_size = dtype_size(out_dtype);
    int64_t total = 1;
    for (int a = 0; a < ndim; a++) total *= row[2 + 2 * ndim + a];
    const char *unit = unit_ptr[pos];
    char *out = out_ptr[sample];
    const int64_t *shape = out_shape + sample * ndim, *strides = out_strides + sample * ndim;
    const double *nm = norm && norm[3 * sample] != 0.0 ? norm + 3 * sample + 1 : 0;
    for (int64_t e = DAMACY_THREAD; e < total; e += DAMACY_BLOCK_DIM) {
        /* element e of the piece: the last axis fastest */
        int64_t rest = e, src = 0, dst = 0, src_stride = 1;
        for (int a = ndim - 1; a >= 0; a--) {
            int64_t extent = row[2 + 2 * ndim + a];
            int64_t i = rest % extent;
            rest /= extent;
            int64_t s_start = row[2 + a], d_start = row[2 + ndim + a];
            DAMACY_CHECK(s_start >= 0 || -s_start - 1 + i < pool_len);
            DAMACY_CHECK(d_start >= 0 || -d_start - 1 + i < pool_len);
            int64_t sc = table_coord(pool, s_start, i), dc = table_coord(pool, d_start, i);
            DAMACY_CHECK(sc >= 0 && sc < unit_shape[a] && dc >= 0 && dc < shape[a]);
            src += sc * src_stride;
            src_stride *= unit_shape[a];
            dst += dc * strides[a];
        }
        damacy_value v = load_value(unit + src * src_size, src_dtype, swap);
        if (nm) v = normalize_value(v, out_dtype, nm[0], nm[1]);
        store_value(out + dst * out_size, out_dtype, v);
    }
}

/* Fill samples with their fill value (given in the source dtype, byte order `swap`),
 * converted (and normalised per `norm`, indexed as `samples`) as any element: one block per
 * listed sample, `count` elements each (the sample's part of a contiguous slot). Runs
 * before the assembly, on the same stream. */
DAMACY_KERNEL damacy_fill(
    const int64_t *samples, int64_t n_fill, const char *fill_values, int src_dtype, int swap,
    char *const *out_ptr, int64_t n_samples, int64_t count, int out_dtype, const double *norm)
{
    int64_t k = DAMACY_BLOCK;
    if (k >= n_fill) return;
    int64_t s = samples[k];
    DAMACY_CHECK(s >= 0 && s < n_samples);
    damacy_value v = load_value(fill_values + k * 8, src_dtype, swap);
    if (norm && norm[3 * k] != 0.0) v = normalize_value(v, out_dtype, norm[3 * k + 1], norm[3 * k + 2]);
    int out_size = dtype_size(out_dtype);
    char *out = out_ptr[s];
    for (int64_t e = DAMACY_THREAD; e < count; e += DAMACY_BLOCK_DIM) store_value(out + e * out_size, out_dtype, v);
}

/* Convert n elements (grid-stride): the contract on a flat array. */
DAMACY_KERNEL damacy_convert(const char *src, int src_dtype, int swap, char *out, int out_dtype, int64_t n)
{
    int src_size = dtype_size(src_dtype), out_size = dtype_size(out_dtype);
    for (int64_t e = DAMACY_BLOCK * DAMACY_BLOCK_DIM + DAMACY_THREAD; e < n; e += DAMACY_BLOCK_DIM * DAMACY_GRID_DIM)
        store_value(out + e * out_size, out_dtype, load_value(src + e * src_size, src_dtype, swap));
}

#endif
