#include "native.h"

#include <stdlib.h>
#include <string.h>

/*
 * The array passes of the planner that numpy makes in tens of calls (each costing more than
 * the work for the hundreds of rows a batch has): the rows of a batch's boxes, the distinct
 * units those rows cut, and an array's copy table once its units are located.
 * plan/planner.py keeps the numpy forms they equal, for builds without a compiler.
 */

static int int64_args(Py_buffer *b, Py_ssize_t width, const char *what) {
    if (b->len % (Py_ssize_t)(sizeof(int64_t) * (size_t)width)) {
        PyErr_Format(PyExc_ValueError, "%s: not whole rows of %zd int64", what, width);
        return -1;
    }
    return 0;
}

/* The largest magnitude box_rows takes for a coordinate, an array or unit length (an array's
 * shape is below it, as its metadata must say): every difference and sum it makes then stays
 * inside int64 (a unit's end at most 2**62 - 1 + 2**62; a box start to the array's end, at
 * most 2**62 + 2**62 - 1). Larger values are refused, not wrapped. */
#define PLAN_LIMIT ((int64_t)1 << 62)

/*
 * box_rows(boxes, shape, unit_shape): boxes is int64 (n, 1 + 2 * ndim): per box its sample,
 * then each axis' start, then each axis' stop, every box reaching into the array on every
 * axis. Returns a bytearray of int64 rows (total, 1 + 4 * ndim): per box the units it cuts
 * in C order, each row the sample, then per axis the unit coordinate, the source start (in
 * the unit), the destination start (in the sample) and the extent.
 */
PyObject *dm_py_box_rows(PyObject *self, PyObject *args) {
    Py_buffer boxes, shape, unit;
    if (!PyArg_ParseTuple(args, "y*y*y*", &boxes, &shape, &unit)) return NULL;
    PyObject *out = NULL;
    Py_ssize_t ndim = shape.len / (Py_ssize_t)sizeof(int64_t);
    if (ndim < 1 || ndim > MAX_NDIM || shape.len != ndim * (Py_ssize_t)sizeof(int64_t) || unit.len != shape.len) {
        PyErr_SetString(PyExc_ValueError, "box_rows: shape and unit shape need 1 to 8 int64 each");
        goto done;
    }
    if (int64_args(&boxes, 1 + 2 * ndim, "box_rows") < 0) goto done;
    const int64_t *b = boxes.buf, *size = shape.buf, *us = unit.buf;
    Py_ssize_t n = boxes.len / (Py_ssize_t)sizeof(int64_t) / (1 + 2 * ndim), width = 1 + 4 * ndim;
    for (Py_ssize_t a = 0; a < ndim; a++) {
        if (us[a] < 1 || size[a] < 1 || us[a] > PLAN_LIMIT || size[a] > PLAN_LIMIT) {
            PyErr_SetString(PyExc_ValueError, "box_rows: a unit or array axis of length < 1 or > 2**62");
            goto done;
        }
    }
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        const int64_t *box = b + i * (1 + 2 * ndim);
        int64_t per = 1;
        for (Py_ssize_t a = 0; a < ndim; a++) {
            if (box[1 + a] < -PLAN_LIMIT || box[1 + a] > PLAN_LIMIT || box[1 + ndim + a] < -PLAN_LIMIT || box[1 + ndim + a] > PLAN_LIMIT) {
                PyErr_Format(PyExc_ValueError, "box_rows: box %zd has a start or stop beyond 2**62 on axis %zd", i, a);
                goto done;
            }
            int64_t lo = box[1 + a] > 0 ? box[1 + a] : 0, hi = box[1 + ndim + a] < size[a] ? box[1 + ndim + a] : size[a];
            if (hi <= lo) {
                PyErr_Format(PyExc_ValueError, "box_rows: box %zd does not reach into the array on axis %zd", i, a);
                goto done;
            }
            if (__builtin_mul_overflow(per, (hi - 1) / us[a] - lo / us[a] + 1, &per)) per = INT64_MAX;
        }
        if (__builtin_add_overflow(total, per, &total) || total > PY_SSIZE_T_MAX / (Py_ssize_t)sizeof(int64_t) / width) {
            PyErr_SetString(PyExc_MemoryError, "box_rows: too many rows");
            goto done;
        }
    }
    out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)total * width * (Py_ssize_t)sizeof(int64_t));
    if (!out) goto done;
    int64_t *r = (int64_t *)PyByteArray_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        const int64_t *box = b + i * (1 + 2 * ndim);
        int64_t lo[MAX_NDIM], hi[MAX_NDIM], first[MAX_NDIM], last[MAX_NDIM], at[MAX_NDIM];
        for (Py_ssize_t a = 0; a < ndim; a++) {
            lo[a] = box[1 + a] > 0 ? box[1 + a] : 0;
            hi[a] = box[1 + ndim + a] < size[a] ? box[1 + ndim + a] : size[a];
            first[a] = at[a] = lo[a] / us[a];
            last[a] = (hi[a] - 1) / us[a];
        }
        for (;;) { /* the units of the box, last axis fastest */
            r[0] = box[0];
            for (Py_ssize_t a = 0; a < ndim; a++) {
                int64_t begin = at[a] * us[a], a0 = lo[a] > begin ? lo[a] : begin;
                int64_t end = hi[a] < begin + us[a] ? hi[a] : begin + us[a];
                r[1 + a] = at[a];
                r[1 + ndim + a] = a0 - begin;
                r[1 + 2 * ndim + a] = a0 - box[1 + a];
                r[1 + 3 * ndim + a] = end - a0;
            }
            r += width;
            Py_ssize_t a = ndim - 1;
            while (a >= 0 && ++at[a] > last[a]) {
                at[a] = first[a];
                a--;
            }
            if (a < 0) break;
        }
    }
done:
    PyBuffer_Release(&boxes);
    PyBuffer_Release(&shape);
    PyBuffer_Release(&unit);
    return out;
}

typedef struct {
    int64_t id;
    int64_t row;
} id_row;

static int cmp_id_row(const void *pa, const void *pb) {
    const id_row *x = pa, *y = pb;
    if (x->id != y->id) return x->id < y->id ? -1 : 1;
    return x->row < y->row ? -1 : x->row > y->row;
}

/*
 * unique_units(rows, width, column, grid): rows is int64 (n, width) whose columns column to
 * column + ndim - 1 hold a unit's coordinates in a grid of units ``grid`` (int64, ndim;
 * every coordinate inside it, the grid's size below 2**62). Returns (units, inverse) as
 * bytearrays of int64: the distinct units (m, ndim) in C order, and each row's index in them.
 */
PyObject *dm_py_unique_units(PyObject *self, PyObject *args) {
    Py_buffer rows, grid;
    Py_ssize_t width, column;
    if (!PyArg_ParseTuple(args, "y*nny*", &rows, &width, &column, &grid)) return NULL;
    PyObject *units = NULL, *inverse = NULL, *result = NULL;
    id_row *ids = NULL;
    Py_ssize_t ndim = grid.len / (Py_ssize_t)sizeof(int64_t);
    const int64_t *g = grid.buf, *r = rows.buf;
    if (ndim < 1 || ndim > MAX_NDIM || width < 1 || column < 0 || column + ndim > width) {
        PyErr_SetString(PyExc_ValueError, "unique_units: the coordinates are not inside a row");
        goto done;
    }
    if (int64_args(&rows, width, "unique_units") < 0) goto done;
    for (Py_ssize_t a = 0, cells = 1; a < ndim; a++) { /* ids are C-order positions in the grid */
        if (g[a] < 1 || __builtin_mul_overflow(cells, g[a], &cells) || cells >= (Py_ssize_t)1 << 62) {
            PyErr_SetString(PyExc_ValueError, "unique_units: the grid needs fewer than 2**62 units, each axis at least 1");
            goto done;
        }
    }
    Py_ssize_t n = rows.len / (Py_ssize_t)sizeof(int64_t) / width;
    ids = malloc(sizeof *ids * (size_t)(n ? n : 1));
    if (!ids) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t id = 0;
        for (Py_ssize_t a = 0; a < ndim; a++) {
            int64_t c = r[i * width + column + a];
            if (c < 0 || c >= g[a]) {
                PyErr_Format(PyExc_ValueError, "unique_units: row %zd's unit is outside the grid on axis %zd", i, a);
                goto done;
            }
            id = id * g[a] + c;
        }
        ids[i].id = id;
        ids[i].row = i;
    }
    qsort(ids, (size_t)n, sizeof *ids, cmp_id_row);
    Py_ssize_t m = 0;
    for (Py_ssize_t i = 0; i < n; i++) m += i == 0 || ids[i].id != ids[i - 1].id;
    units = PyByteArray_FromStringAndSize(NULL, m * ndim * (Py_ssize_t)sizeof(int64_t));
    inverse = PyByteArray_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(int64_t));
    if (!units || !inverse) goto done;
    int64_t *u = (int64_t *)PyByteArray_AS_STRING(units), *inv = (int64_t *)PyByteArray_AS_STRING(inverse);
    Py_ssize_t k = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i == 0 || ids[i].id != ids[i - 1].id) {
            k++;
            memcpy(u + k * ndim, r + ids[i].row * width + column, sizeof(int64_t) * (size_t)ndim);
        }
        inv[ids[i].row] = k;
    }
    result = PyTuple_Pack(2, units, inverse);
done:
    free(ids);
    Py_XDECREF(units);
    Py_XDECREF(inverse);
    PyBuffer_Release(&rows);
    PyBuffer_Release(&grid);
    return result;
}

typedef struct {
    int64_t owner, offset, unit;
} unit_place;

static int cmp_place(const void *pa, const void *pb) {
    const unit_place *x = pa, *y = pb;
    if (x->owner != y->owner) return x->owner < y->owner ? -1 : 1;
    if (x->offset != y->offset) return x->offset < y->offset ? -1 : 1;
    return x->unit < y->unit ? -1 : x->unit > y->unit;
}

static int cmp_int64(const void *pa, const void *pb) {
    int64_t x = *(const int64_t *)pa, y = *(const int64_t *)pb;
    return x < y ? -1 : x > y;
}

/*
 * plan_table(rows, ndim, inverse, hit, dropped, missing, owners, offsets, nbytes): one
 * array's copy table, from its rows (int64 (r, 1 + 4 * ndim), as box_rows makes them), each
 * row's unit (inverse, int64 (r,), into m units), per unit whether the chunk cache holds it
 * (hit: bool (m,), or empty: none), per sample whether it failed (dropped: bool, or empty:
 * none; samples past its end stand), and per unit whether it is stored (missing: bool (m,))
 * and where (owners, offsets, nbytes: int64 (m,)). Rows of dropped samples are left out;
 * rows of missing units leave their samples to the fill value. Returns (order, table,
 * spans, bounds, fills, n_hit) as bytearrays of int64 but n_hit:
 *   order   the units copied from: those the cache holds first (by index), then the others
 *           by owner, offset, index;
 *   table   the copies (k, 2 + 3 * ndim): position in order, sample, then per axis the
 *           source start, destination start, extent; grouped by position, rows in their
 *           order within a position;
 *   spans   per position (offset, stored bytes) (offset 0 where nothing is stored);
 *   bounds  per position the first row of its copies, and the table's length;
 *   fills   the samples that read a missing unit, ascending, once each.
 * plan/planner.py's _plan_table_numpy is the form it equals.
 */
PyObject *dm_py_plan_table(PyObject *self, PyObject *args) {
    Py_buffer rows, inverse, hit, dropped, missing, owners, offsets, nbytes;
    Py_ssize_t ndim;
    if (!PyArg_ParseTuple(args, "y*ny*y*y*y*y*y*y*", &rows, &ndim, &inverse, &hit, &dropped, &missing, &owners, &offsets, &nbytes))
        return NULL;
    PyObject *o_order = NULL, *o_table = NULL, *o_spans = NULL, *o_bounds = NULL, *o_fills = NULL, *result = NULL;
    int64_t *pos_of = NULL, *count = NULL, *fill_list = NULL;
    unit_place *places = NULL;
    unsigned char *used = NULL;
    Py_ssize_t width = 1 + 4 * ndim;
    if (ndim < 0 || ndim > MAX_NDIM) {
        PyErr_SetString(PyExc_ValueError, "plan_table: ndim must be 0 to 8");
        goto done;
    }
    if (int64_args(&rows, width, "plan_table") < 0) goto done;
    Py_ssize_t r = rows.len / (Py_ssize_t)sizeof(int64_t) / width;
    Py_ssize_t m = missing.len;
    if (inverse.len != r * (Py_ssize_t)sizeof(int64_t) || (hit.len != 0 && hit.len != m) ||
        owners.len != m * (Py_ssize_t)sizeof(int64_t) || offsets.len != owners.len || nbytes.len != owners.len) {
        PyErr_SetString(PyExc_ValueError, "plan_table: inverse needs a unit per row; hit, missing, owners, offsets and nbytes one entry per unit");
        goto done;
    }
    const int64_t *rw = rows.buf, *inv = inverse.buf, *own = owners.buf, *off = offsets.buf, *nb = nbytes.buf;
    const unsigned char *is_hit = hit.len ? hit.buf : NULL, *gone = missing.buf, *drop = dropped.buf;
    Py_ssize_t n_drop = dropped.len;
    used = calloc((size_t)(m ? m : 1), 1);
    pos_of = malloc(sizeof *pos_of * (size_t)(m ? m : 1));
    fill_list = malloc(sizeof *fill_list * (size_t)(r ? r : 1));
    if (!used || !pos_of || !fill_list) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t n_fill = 0, kept = 0;
    for (Py_ssize_t i = 0; i < r; i++) {
        int64_t s = rw[i * width], u = inv[i];
        if (u < 0 || u >= m) {
            PyErr_Format(PyExc_ValueError, "plan_table: row %zd's unit %lld is not one of the %zd units", i, (long long)u, m);
            goto done;
        }
        if (s >= 0 && s < n_drop && drop[s]) continue;
        if (gone[u]) {
            fill_list[n_fill++] = s;
        } else {
            used[u] = 1;
            kept++;
        }
    }
    /* the order: units in the cache first, then by where they are stored */
    Py_ssize_t n_used = 0, n_hit = 0;
    for (Py_ssize_t u = 0; u < m; u++) n_used += used[u];
    o_order = PyByteArray_FromStringAndSize(NULL, n_used * (Py_ssize_t)sizeof(int64_t));
    if (!o_order) goto done;
    int64_t *order = (int64_t *)PyByteArray_AS_STRING(o_order);
    places = malloc(sizeof *places * (size_t)(n_used ? n_used : 1));
    if (!places) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t n_rest = 0;
    for (Py_ssize_t u = 0; u < m; u++) {
        if (!used[u]) continue;
        if (is_hit && is_hit[u]) {
            order[n_hit++] = u;
        } else {
            places[n_rest].owner = own[u];
            places[n_rest].offset = off[u];
            places[n_rest].unit = u;
            n_rest++;
        }
    }
    qsort(places, (size_t)n_rest, sizeof *places, cmp_place);
    for (Py_ssize_t j = 0; j < n_rest; j++) order[n_hit + j] = places[j].unit;
    for (Py_ssize_t p = 0; p < n_used; p++) pos_of[order[p]] = p;
    /* the rows grouped by position, each group's rows in their order */
    o_bounds = PyByteArray_FromStringAndSize(NULL, (n_used + 1) * (Py_ssize_t)sizeof(int64_t));
    if (!o_bounds) goto done;
    int64_t *bounds = (int64_t *)PyByteArray_AS_STRING(o_bounds);
    count = calloc((size_t)n_used + 1, sizeof *count);
    if (!count) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < r; i++) {
        int64_t s = rw[i * width], u = inv[i];
        if ((s >= 0 && s < n_drop && drop[s]) || gone[u]) continue;
        count[pos_of[u] + 1]++;
    }
    for (Py_ssize_t p = 0; p < n_used; p++) count[p + 1] += count[p];
    memcpy(bounds, count, sizeof *count * ((size_t)n_used + 1));
    Py_ssize_t tw = 2 + 3 * ndim;
    o_table = PyByteArray_FromStringAndSize(NULL, kept * tw * (Py_ssize_t)sizeof(int64_t));
    if (!o_table) goto done;
    int64_t *table = (int64_t *)PyByteArray_AS_STRING(o_table);
    for (Py_ssize_t i = 0; i < r; i++) {
        const int64_t *row = rw + i * width;
        int64_t s = row[0], u = inv[i];
        if ((s >= 0 && s < n_drop && drop[s]) || gone[u]) continue;
        int64_t p = pos_of[u];
        int64_t *t = table + count[p]++ * tw;
        t[0] = p;
        t[1] = s;
        memcpy(t + 2, row + 1 + ndim, sizeof(int64_t) * 3 * (size_t)ndim);
    }
    o_spans = PyByteArray_FromStringAndSize(NULL, n_used * 2 * (Py_ssize_t)sizeof(int64_t));
    if (!o_spans) goto done;
    int64_t *spans = (int64_t *)PyByteArray_AS_STRING(o_spans);
    for (Py_ssize_t p = 0; p < n_used; p++) {
        int64_t u = order[p];
        spans[2 * p] = nb[u] < 0 ? 0 : off[u];
        spans[2 * p + 1] = nb[u];
    }
    qsort(fill_list, (size_t)n_fill, sizeof *fill_list, cmp_int64);
    Py_ssize_t n_distinct = 0;
    for (Py_ssize_t i = 0; i < n_fill; i++)
        if (i == 0 || fill_list[i] != fill_list[i - 1]) fill_list[n_distinct++] = fill_list[i];
    o_fills = PyByteArray_FromStringAndSize((const char *)fill_list, n_distinct * (Py_ssize_t)sizeof(int64_t));
    if (!o_fills) goto done;
    result = Py_BuildValue("OOOOOn", o_order, o_table, o_spans, o_bounds, o_fills, n_hit);
done:
    free(used);
    free(pos_of);
    free(count);
    free(fill_list);
    free(places);
    Py_XDECREF(o_order);
    Py_XDECREF(o_table);
    Py_XDECREF(o_spans);
    Py_XDECREF(o_bounds);
    Py_XDECREF(o_fills);
    PyBuffer_Release(&rows);
    PyBuffer_Release(&inverse);
    PyBuffer_Release(&hit);
    PyBuffer_Release(&dropped);
    PyBuffer_Release(&missing);
    PyBuffer_Release(&owners);
    PyBuffer_Release(&offsets);
    PyBuffer_Release(&nbytes);
    return result;
}

/*
 * merge_reads(owners, offsets, nbytes, gap, most, most_units): a table's units to read, in
 * plan order (the units of one object together, by offset), grouped into reads: a unit joins
 * the read before it when both are of one object (owners: an int64 naming each unit's), it
 * starts at most gap bytes after that read's end, the read then spans at most most bytes and
 * holds fewer than most_units units; a unit stored as a whole object (nbytes -1) is a read of
 * its own. Returns (starts, ends) as bytearrays of int64:
 * per read its first unit, then the count of units; per read the end of its bytes in its
 * object (-1 for a whole object). plan/reads.py's merge_reads_numpy is the form it equals.
 */
PyObject *dm_py_merge_reads(PyObject *self, PyObject *args) {
    Py_buffer owners, offsets, nbytes;
    long long gap, most, most_units;
    if (!PyArg_ParseTuple(args, "y*y*y*LLL", &owners, &offsets, &nbytes, &gap, &most, &most_units)) return NULL;
    PyObject *o_starts = NULL, *o_ends = NULL, *result = NULL;
    Py_ssize_t n = owners.len / (Py_ssize_t)sizeof(int64_t);
    if (owners.len % (Py_ssize_t)sizeof(int64_t) || offsets.len != owners.len || nbytes.len != owners.len) {
        PyErr_SetString(PyExc_ValueError, "merge_reads: owners, offsets and nbytes need an int64 per unit");
        goto done;
    }
    const int64_t *own = owners.buf, *off = offsets.buf, *nb = nbytes.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (nb[i] >= 0 && (off[i] < 0 || off[i] > PLAN_LIMIT || nb[i] > PLAN_LIMIT)) {
            PyErr_Format(PyExc_ValueError, "merge_reads: unit %zd's range is negative or beyond 2**62", i);
            goto done;
        }
    }
    o_starts = PyByteArray_FromStringAndSize(NULL, (n + 1) * (Py_ssize_t)sizeof(int64_t));
    o_ends = PyByteArray_FromStringAndSize(NULL, (n ? n : 1) * (Py_ssize_t)sizeof(int64_t));
    if (!o_starts || !o_ends) goto done;
    int64_t *starts = (int64_t *)PyByteArray_AS_STRING(o_starts), *ends = (int64_t *)PyByteArray_AS_STRING(o_ends);
    Py_ssize_t g = 0;  /* reads so far; the current one is g - 1 while open */
    int open = 0;
    int64_t first = 0, end = 0, held = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (nb[i] < 0) {
            starts[g] = i;
            ends[g++] = -1;
            open = 0;
            continue;
        }
        int64_t stop = off[i] + nb[i];
        if (open && own[i] == own[starts[g - 1]] && off[i] - end <= gap && stop - first <= most && held < most_units) {
            if (stop > end) end = stop;
            ends[g - 1] = end;
            held++;
            continue;
        }
        starts[g] = i;
        first = off[i];
        end = stop;
        ends[g++] = end;
        held = 1;
        open = 1;
    }
    starts[g] = n;
    if (PyByteArray_Resize(o_starts, (g + 1) * (Py_ssize_t)sizeof(int64_t)) < 0 ||
        PyByteArray_Resize(o_ends, g * (Py_ssize_t)sizeof(int64_t)) < 0)
        goto done;
    result = Py_BuildValue("OO", o_starts, o_ends);
done:
    Py_XDECREF(o_starts);
    Py_XDECREF(o_ends);
    PyBuffer_Release(&owners);
    PyBuffer_Release(&offsets);
    PyBuffer_Release(&nbytes);
    return result;
}
