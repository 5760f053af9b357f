/* One op's box copied from a decoded unit into its sample: contiguous rows, gathers and
 * scatters for index lists, and strided lines for a transformed (flipped, permuted) view. */
#include "native.h"

/* Copy one op's box: nested loops over all axes but the last, a row call per row. */
/* The coordinate along an axis at position i of a copy, on either side: a range (start >= 0)
 * or an index list in the pool (start = -(offset + 1)). */
static inline int64_t src_coord(const int64_t *pool, int64_t start, int64_t i) {
    return start >= 0 ? start + i : pool[-start - 1 + i];
}

/* A transformed sample's view (flipped, permuted) steps along its last axis by a stride other
 * than 1, maybe a negative one. Its lines run along the axis where the destination steps by
 * +-1 (the output's last axis: writes stay contiguous, the decoded unit, small and in cache,
 * is read with a stride), gathered in pieces of PIECE; a reversed line is written forwards
 * from its far end. Without such an axis (index lists on the destination), scattered. */
#define PIECE 1024
static void copy_box_strided(const char *chunk, const int64_t *src_strides, int ndim, int src_size, char *dst_base,
                             const int64_t *dst_strides, int dst_size, const int64_t *src_start, const int64_t *dst_start,
                             const int64_t *extent, const int64_t *pool, gather_fn gather, scatter_fn scatter, int swap,
                             const double *nm) {
    int inner = -1;
    for (int a = ndim - 1; a >= 0; a--)
        if ((dst_strides[a] == 1 || dst_strides[a] == -1) && dst_start[a] >= 0) {
            inner = a;
            break;
        }
    int64_t idx[MAX_NDIM] = {0};
    int64_t src_at[PIECE], dst_at[PIECE];
    int line = inner >= 0 ? inner : ndim - 1;
    Py_ssize_t n = (Py_ssize_t)extent[line];
    /* a line's positions are the same for every line: made once when a line fits a piece */
    int once = inner >= 0 && n <= PIECE;
    if (once) {
        for (Py_ssize_t i = 0; i < n; i++)
            src_at[i] = src_coord(pool, src_start[inner], dst_strides[inner] == 1 ? i : n - 1 - i) * src_strides[inner];
    }
    for (;;) {
        int64_t so = 0, dof = 0;
        for (int a = 0; a < ndim; a++) {
            if (a == line) continue;
            so += src_coord(pool, src_start[a], idx[a]) * src_strides[a];
            dof += src_coord(pool, dst_start[a], idx[a]) * dst_strides[a];
        }
        for (Py_ssize_t off = 0; off < n; off += PIECE) {
            Py_ssize_t m = n - off < PIECE ? n - off : PIECE;
            if (inner >= 0) {
                int64_t step = dst_strides[inner], first = dst_start[inner] + off;
                if (step == 1) {
                    if (!once)
                        for (Py_ssize_t i = 0; i < m; i++) src_at[i] = src_coord(pool, src_start[inner], off + i) * src_strides[inner];
                    gather(chunk + so * src_size, src_at, dst_base + (dof + first) * dst_size, m, swap, nm);
                } else {  /* the line's last element is at the lowest address */
                    if (!once)
                        for (Py_ssize_t i = 0; i < m; i++)
                            src_at[i] = src_coord(pool, src_start[inner], off + m - 1 - i) * src_strides[inner];
                    gather(chunk + so * src_size, src_at, dst_base + (dof - (first + m - 1)) * dst_size, m, swap, nm);
                }
            } else {
                for (Py_ssize_t i = 0; i < m; i++) {
                    src_at[i] = src_coord(pool, src_start[line], off + i) * src_strides[line];
                    dst_at[i] = src_coord(pool, dst_start[line], off + i) * dst_strides[line];
                }
                scatter(chunk + so * src_size, 0, src_at, dst_base + dof * dst_size, dst_at, m, swap, nm);
            }
        }
        int a = ndim - 1;
        while (a >= 0) {
            if (a != line && ++idx[a] < extent[a]) break;
            if (a != line) idx[a] = 0;
            a--;
        }
        if (a < 0) return;
    }
}

/* Copy one op: nested loops over all axes but the last, a row (gather, scatter) call per row.
 * Along any axis the source and the destination are each a range or an index list; the
 * destination's last axis is contiguous (slots are C-ordered), or see copy_box_strided. */
void dm_copy_box(const char *chunk, const int64_t *unit_shape, int ndim, int src_size, char *dst_base,
                     const int64_t *dst_strides, int dst_size, const int64_t *src_start, const int64_t *dst_start,
                     const int64_t *extent, const int64_t *pool, row_fn row, gather_fn gather, scatter_fn scatter,
                     int swap, const double *nm) {
    int64_t src_strides[MAX_NDIM];
    int64_t s = 1;
    for (int a = ndim - 1; a >= 0; a--) {
        src_strides[a] = s;
        s *= unit_shape[a];
    }
    if (ndim == 0) {
        row(chunk, dst_base, 1, swap, nm);
        return;
    }
    int64_t idx[MAX_NDIM] = {0};
    int last = ndim - 1;
    Py_ssize_t n = (Py_ssize_t)extent[last];
    for (int a = 0; a < ndim; a++)
        if (extent[a] <= 0) return;
    if (dst_strides[last] != 1) {
        copy_box_strided(chunk, src_strides, ndim, src_size, dst_base, dst_strides, dst_size, src_start, dst_start, extent,
                         pool, gather, scatter, swap, nm);
        return;
    }
    for (;;) {
        int64_t so = 0, dof = 0;
        for (int a = 0; a < last; a++) {
            so += src_coord(pool, src_start[a], idx[a]) * src_strides[a];
            dof += src_coord(pool, dst_start[a], idx[a]) * dst_strides[a];
        }
        if (dst_start[last] < 0) {
            const int64_t *six = src_start[last] >= 0 ? NULL : pool - src_start[last] - 1;
            scatter(chunk + so * src_size, src_start[last], six, dst_base + dof * dst_size, pool - dst_start[last] - 1, n,
                    swap, nm);
        } else if (src_start[last] >= 0) {
            dof += dst_start[last] * dst_strides[last];
            row(chunk + (so + src_start[last]) * src_size, dst_base + dof * dst_size, n, swap, nm);
        } else {
            dof += dst_start[last] * dst_strides[last];
            gather(chunk + so * src_size, pool - src_start[last] - 1, dst_base + dof * dst_size, n, swap, nm);
        }
        int a = last - 1;
        while (a >= 0) {
            if (++idx[a] < extent[a]) break;
            idx[a] = 0;
            a--;
        }
        if (a < 0) return;
    }
}
