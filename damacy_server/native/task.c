/* A decode task: its tables checked (with the GIL), every unit decoded and its copies made
 * (without it), the failures reported; run and run_decoded, the module's entry points. */
#include "native.h"

#include <string.h>

void dm_task_release(task_t *t) {
    free(t->views);
    free(t->status);
    free(t->err_codes);
    PyBuffer_Release(&t->spans);
    PyBuffer_Release(&t->ops);
    PyBuffer_Release(&t->targets);
    PyBuffer_Release(&t->shape);
    PyBuffer_Release(&t->pool);
    PyBuffer_Release(&t->keep);
}

/* With the GIL: check the task's tables (a Python error and -1 when they are unusable). */
int dm_task_prepare(task_t *t) {
    t->n_units = t->spans.len / 16;
    t->ndim = (int)(t->shape.len / 8);
    size_t n = (size_t)(t->n_units ? t->n_units : 1);
    t->views = calloc(n, sizeof(unit_in));
    t->status = calloc(n, sizeof(int));
    t->err_codes = calloc(n, sizeof(size_t));
    if (!t->views || !t->status || !t->err_codes) {
        PyErr_NoMemory();
        return -1;
    }
    /* the plain conversion, or the normalising one when every target normalises (checked below) */
    if (t->src_type < 0 || t->src_type >= T_COUNT || t->dst_type < 0 || t->dst_type >= T_COUNT ||
        !(dm_conv[t->src_type][t->dst_type].row || dm_nconv[t->src_type][t->dst_type].row) || t->ndim > MAX_NDIM) {
        PyErr_SetString(PyExc_ValueError, "unsupported cast or rank for the native path");
        return -1;
    }
    t->width = 2 + 3 * (Py_ssize_t)t->ndim;
    t->n_ops = t->ops.len / (Py_ssize_t)(8 * t->width);
    t->n_targets = t->targets.len / (Py_ssize_t)(8 * TARGET_WIDTH(t->ndim));
    /* a normalising target needs the normalising conversion (float outputs) */
    const int64_t *tgs = (const int64_t *)t->targets.buf;
    for (Py_ssize_t k = 0; k < t->n_targets; k++) {
        const int64_t *tg = tgs + k * TARGET_WIDTH(t->ndim);
        if (tg[1 + 2 * t->ndim] && !dm_nconv[t->src_type][t->dst_type].row) {
            PyErr_SetString(PyExc_ValueError, "normalisation writes float outputs only");
            return -1;
        }
        if (tg[0] && !tg[1 + 2 * t->ndim] && !dm_conv[t->src_type][t->dst_type].row) {
            PyErr_SetString(PyExc_ValueError, "this cast is native only for normalised targets");
            return -1;
        }
    }
    /* the unit's elements must be what the decoded bytes hold */
    const int64_t *unit_shape = (const int64_t *)t->shape.buf;
    int64_t elements = 1;
    for (int a = 0; a < t->ndim; a++) {
        if (unit_shape[a] < 0 || __builtin_mul_overflow(elements, unit_shape[a], &elements)) elements = -1;
        if (elements < 0) break;
    }
    int64_t unit_bytes;
    if (elements < 0 || __builtin_mul_overflow(elements, (int64_t)ITEMSIZE[t->src_type], &unit_bytes) ||
        unit_bytes != t->decoded_nbytes) {
        PyErr_SetString(PyExc_ValueError, "the unit shape does not match the decoded size");
        return -1;
    }
    const int64_t *spans = (const int64_t *)t->spans.buf;
    for (Py_ssize_t u = 0; u < t->n_units; u++) {
        if (spans[2 * u] < 0 || spans[2 * u + 1] < -1) {
            PyErr_SetString(PyExc_ValueError, "a negative span");
            return -1;
        }
    }
    /* ops must be grouped by unit, in unit order, and name only the units given */
    const int64_t *ops = (const int64_t *)t->ops.buf;
    int64_t prev = 0;
    for (Py_ssize_t q = 0; q < t->n_ops; q++) {
        int64_t u;
        if (__builtin_sub_overflow(ops[q * t->width], (int64_t)t->base, &u) || u < 0 || u >= t->n_units || u < prev) {
            PyErr_SetString(PyExc_ValueError, "the op table is not grouped by unit in unit order");
            return -1;
        }
        prev = u;
    }
    if (t->keep.len != 0 && t->keep.len != t->n_units * 8) {
        PyErr_SetString(PyExc_ValueError, "keep needs one address (or 0) per unit");
        return -1;
    }
    if (t->codec == CODEC_ZSTD && dm_zstd_ok < 0) dm_zstd_ok = dm_zstd_load();
    return 0;
}

/* Each unit's bytes in data, which starts at data_offset of the object (a span reaching past
 * the end is cut there, one of length -1 reaches to the end). */
void dm_task_locate(task_t *t, const char *data, Py_ssize_t data_len, long long data_offset) {
    const int64_t *spans = (const int64_t *)t->spans.buf;
    for (Py_ssize_t u = 0; u < t->n_units; u++) {
        int64_t off = spans[2 * u] - data_offset, len = spans[2 * u + 1];
        if (off < 0 || off > data_len) off = data_len; /* outside the read: nothing */
        if (len < 0 || len > data_len - off) len = data_len - off;
        t->views[u].src = data + off;
        t->views[u].src_len = (Py_ssize_t)len;
    }
}

/* Does one side of an op along one axis stay inside [0, size)? A range start >= 0, or an
 * index list -(k + 1) of pool[k : k + ext] whose values do. Sets the lowest and highest
 * position used when asked. Written so that no sum can overflow. */
static int span_ok(int64_t start, int64_t ext, int64_t size, const int64_t *pool, int64_t pool_len, int64_t *lo,
                   int64_t *hi) {
    int64_t amin, amax;
    if (start >= 0) {
        if (ext > size || start > size - ext) return 0;
        amin = start;
        amax = start + ext - 1;
    } else {
        if (start == INT64_MIN || ext > pool_len || -(start + 1) > pool_len - ext) return 0;
        const int64_t *list = pool + (-(start + 1));
        amin = amax = list[0];
        for (int64_t i = 1; i < ext; i++) {
            if (list[i] < amin) amin = list[i];
            if (list[i] > amax) amax = list[i];
        }
        if (amin < 0 || amax >= size) return 0;
    }
    if (lo) *lo = amin;
    if (hi) *hi = amax;
    return 1;
}

/* Check the ops of unit u (those from op on): each stays inside the unit (its index lists
 * inside the pool and the unit) and inside its target, which must have a view. Returns OK or
 * E_OPS; widens [*first, *need) to the bytes of the unit the copies read. */
static int check_ops(const task_t *t, Py_ssize_t u, Py_ssize_t op, const int64_t *unit_strides, size_t *first, size_t *need) {
    const int64_t *ops = (const int64_t *)t->ops.buf;
    const int64_t *targets = (const int64_t *)t->targets.buf;
    const int64_t *unit_shape = (const int64_t *)t->shape.buf;
    const int64_t *pool = (const int64_t *)t->pool.buf;
    const int64_t pool_len = t->pool.len / 8;
    const int ndim = t->ndim, src_size = ITEMSIZE[t->src_type];
    for (Py_ssize_t q = op; q < t->n_ops && ops[q * t->width] - t->base == u; q++) {
        const int64_t *o = ops + q * t->width;
        int64_t lo = 0, last = 0, empty = 0;
        /* the target: a sample with a view, whose shape bounds the destination side */
        const int64_t *tg = (o[1] >= 0 && o[1] < t->n_targets) ? targets + o[1] * TARGET_WIDTH(ndim) : NULL;
        if (!tg || tg[0] == 0) return E_OPS;
        for (int a = 0; a < ndim; a++) {
            int64_t st = o[2 + a], dst = o[2 + ndim + a], ext = o[2 + 2 * ndim + a], amin, amax;
            if (ext <= 0) {
                empty = 1;
                break;
            }
            if (!span_ok(st, ext, unit_shape[a], pool, pool_len, &amin, &amax) ||
                !span_ok(dst, ext, tg[1 + ndim + a], pool, pool_len, NULL, NULL))
                return E_OPS;
            lo += amin * unit_strides[a];
            last += amax * unit_strides[a];
        }
        if (empty) continue;
        size_t end = (size_t)(last + 1) * (size_t)src_size, begin = (size_t)lo * (size_t)src_size;
        if (end > *need) *need = end;
        if (begin < *first) *first = begin;
    }
    return OK;
}

/* The conversion target tg takes: the normalising one (its offset and scale into nm, and
 * *nmp = nm) when it normalises, else the plain one (*nmp = NULL); both checked in
 * task_prepare. */
static const conv_t *target_conv(const task_t *t, const int64_t *tg, double nm[2], const double **nmp) {
    const int64_t *flag = tg + 1 + 2 * t->ndim;
    if (!*flag) {
        *nmp = NULL;
        return &dm_conv[t->src_type][t->dst_type];
    }
    memcpy(nm, flag + 1, 2 * sizeof(double));
    *nmp = nm;
    return &dm_nconv[t->src_type][t->dst_type];
}

/* The elements op o writes (0 when any extent is empty). */
static int64_t op_elements(const int64_t *o, int ndim) {
    int64_t n = 1;
    for (int a = 0; a < ndim; a++) n *= o[2 + 2 * ndim + a] > 0 ? o[2 + 2 * ndim + a] : 0;
    return n;
}

/* Make op o (checked) from the decoded unit at chunk, its box at a time (dm_copy_box). */
static void copy_op(const task_t *t, const char *chunk, const int64_t *o) {
    const int ndim = t->ndim;
    const int64_t *tg = (const int64_t *)t->targets.buf + o[1] * TARGET_WIDTH(ndim);
    double nm[2];
    const double *nmp;
    const conv_t *c = target_conv(t, tg, nm, &nmp);
    dm_copy_box(chunk, (const int64_t *)t->shape.buf, ndim, ITEMSIZE[t->src_type], (char *)(intptr_t)tg[0], tg + 1,
                ITEMSIZE[t->dst_type], o + 2, o + 2 + ndim, o + 2 + 2 * ndim, (const int64_t *)t->pool.buf, c->row, c->gather,
                c->scatter, t->swap, nmp);
}

/* Without the GIL: decode every unit and make its copies. */
void dm_task_assemble(task_t *t) {
    unit_in *views = t->views;
    int *status = t->status;
    size_t *err_codes = t->err_codes;
    const int64_t *ops = (const int64_t *)t->ops.buf;
    const int64_t *unit_shape = (const int64_t *)t->shape.buf;
    const int ndim = t->ndim, codec = t->codec;
    const Py_ssize_t n_units = t->n_units, n_ops = t->n_ops, width = t->width;
    const Py_ssize_t decoded_nbytes = t->decoded_nbytes;
    const int64_t base = t->base;
    const int64_t *keep = t->keep.len ? (const int64_t *)t->keep.buf : NULL;
    long long encoded = 0, elements = 0;
    char *scratch = NULL;
    void *dctx = NULL;
    if (codec == CODEC_ZSTD && dm_zstd_ok) {
        scratch = malloc((size_t)(decoded_nbytes ? decoded_nbytes : 1));
        dctx = dm_zstd_dctx();
    } else if (codec == CODEC_BLOSC) {
        scratch = malloc((size_t)(decoded_nbytes ? decoded_nbytes : 1) + 16);
    }
    int64_t unit_strides[MAX_NDIM];
    int64_t st = 1;
    for (int a = ndim - 1; a >= 0; a--) {
        unit_strides[a] = st;
        st *= unit_shape[a];
    }
    Py_ssize_t op = 0;
    for (Py_ssize_t u = 0; u < n_units; u++) {
        const char *chunk = (const char *)views[u].src;
        /* the bytes this unit's copies read: [first, need) */
        size_t need = 0, first = (size_t)decoded_nbytes;
        status[u] = check_ops(t, u, op, unit_strides, &first, &need);
        /* a unit to keep (a chunk cache entry) is decoded whole into its buffer, and its
         * copies read from there */
        char *kept = keep ? (char *)(intptr_t)keep[u] : NULL;
        if (kept) {
            first = 0;
            need = (size_t)decoded_nbytes;
        }
        if (status[u] != OK) {
            /* an op outside its unit: a planning error, reported, nothing copied */
        } else if (kept && codec == CODEC_BLOSC) {
            const unsigned char *p = (const unsigned char *)views[u].src;
            int r = -1;
            if (!dm_blosc_getitem || !dm_blosc_decompress) {
                status[u] = E_NOZSTD;
            } else if (views[u].src_len < 16 || !dm_blosc_frame_ok(p, views[u].src_len, decoded_nbytes, 0, decoded_nbytes) ||
                       (r = dm_blosc_decompress(p, kept, (size_t)decoded_nbytes, 1)) != decoded_nbytes) {
                status[u] = E_BLOSC;
                err_codes[u] = (size_t)(r < 0 ? -r : r);
            }
            chunk = kept;
        } else if (kept && codec == CODEC_ZSTD) {
            if (!dm_zstd_ok) {
                status[u] = E_NOZSTD;
            } else if (!dctx) {
                status[u] = E_MEMORY;
            } else {
                size_t r = dm_zstd_decompress(dctx, kept, (size_t)decoded_nbytes, views[u].src, (size_t)views[u].src_len);
                if (dm_zstd_iserror(r)) {
                    status[u] = E_ZSTD;
                    err_codes[u] = r;
                } else if ((Py_ssize_t)r != decoded_nbytes) {
                    status[u] = E_SIZE;
                    err_codes[u] = r;
                }
            }
            chunk = kept;
        } else if (kept) {
            if (views[u].src_len != decoded_nbytes) {
                status[u] = E_SIZE;
                err_codes[u] = (size_t)views[u].src_len;
            } else {
                memcpy(kept, views[u].src, (size_t)decoded_nbytes);
            }
            chunk = kept;
        } else if (codec == CODEC_BLOSC) {
            const unsigned char *p = (const unsigned char *)views[u].src;
            int ts = views[u].src_len >= 16 ? p[3] : 0;
            if (!dm_blosc_getitem || !dm_blosc_decompress) {
                status[u] = E_NOZSTD;
            } else if (!scratch) {
                status[u] = E_MEMORY;
            } else if (ts == 0 || !dm_blosc_frame_ok(p, views[u].src_len, decoded_nbytes, 0, 0)) {
                status[u] = E_BLOSC;
            } else if (need > first) {
                int64_t start = (int64_t)first / ts, stop = ((int64_t)need + ts - 1) / ts;
                int r;
                if (decoded_nbytes % ts != 0 || stop * ts > decoded_nbytes) {
                    /* items do not tile the chunk: decode it whole */
                    r = dm_blosc_frame_ok(p, views[u].src_len, decoded_nbytes, 0, decoded_nbytes)
                            ? dm_blosc_decompress(p, scratch, (size_t)decoded_nbytes, 1)
                            : -1;
                    if (r != decoded_nbytes) {
                        status[u] = E_BLOSC;
                        err_codes[u] = (size_t)(r < 0 ? -r : r);
                    }
                } else if (!dm_blosc_frame_ok(p, views[u].src_len, decoded_nbytes, start * ts, stop * ts)) {
                    status[u] = E_BLOSC;
                } else {
                    r = dm_blosc_getitem(p, (int)start, (int)(stop - start), scratch + start * ts);
                    if (r != (stop - start) * ts) {
                        status[u] = E_BLOSC;
                        err_codes[u] = (size_t)(r < 0 ? -r : r);
                    }
                }
                chunk = scratch;
            }
        } else if (codec == CODEC_ZSTD) {
            if (!dm_zstd_ok) {
                status[u] = E_NOZSTD;
            } else if (!scratch || !dctx) {
                status[u] = E_MEMORY;
            } else if (need > 0) {
                size_t got = 0;
                int whole = 0;
                size_t r = dm_zstd_prefix(dctx, scratch, (size_t)decoded_nbytes, need, views[u].src, (size_t)views[u].src_len, &got,
                                       &whole);
                if (r) {
                    status[u] = E_ZSTD;
                    err_codes[u] = r;
                } else if (got < need || (whole && (Py_ssize_t)got != decoded_nbytes)) {
                    status[u] = E_SIZE;
                    err_codes[u] = got;
                }
                chunk = scratch;
            }
        } else if (views[u].src_len != decoded_nbytes) {
            status[u] = E_SIZE;
            err_codes[u] = (size_t)views[u].src_len;
        }
        /* ops are grouped by unit, in unit order */
        while (op < n_ops && ops[op * width] - base == u) {
            const int64_t *o = ops + op * width;
            if (status[u] == OK) { /* its ops were checked above */
                copy_op(t, chunk, o);
                elements += op_elements(o, ndim);
            }
            op++;
        }
        if (status[u] == OK) encoded += views[u].src_len;
    }
    free(scratch);
    if (dctx) dm_zstd_trim();
    t->encoded = encoded;
    t->elements = elements;
}

/* A box copy (ranges on both sides) into a sample whose last axis is contiguous, keyed for
 * the destination's order: the sample, then the destination's start and extent on every
 * axis but the last (a strip: the rows the copy writes), then its start on the last. */
typedef struct {
    int64_t sample;
    int64_t rows[2 * (MAX_NDIM - 1)]; /* start, extent per leading axis */
    int64_t col;
    Py_ssize_t q; /* the op */
} strip_key;

static int cmp_strip(const void *pa, const void *pb) {
    const strip_key *a = pa, *b = pb;
    if (a->sample != b->sample) return a->sample < b->sample ? -1 : 1;
    int c = memcmp(a->rows, b->rows, sizeof a->rows); /* equal or not: order among strips is free */
    if (c) return c;
    return a->col < b->col ? -1 : a->col > b->col;
}

/* Without the GIL: the copies of units already decoded (views[u].src: the whole unit),
 * written in the destination's order. Box copies into contiguous rows are sorted into strips
 * and a strip is written row by row across its copies, so every destination row is written
 * front to back in one pass: copied a unit at a time, a row is written in pieces one unit
 * wide, each a row apart, which runs at about half the speed (64-wide units, u16 to f32).
 * Other copies (index lists, transformed views) are made unit by unit. */
static void assemble_decoded(task_t *t) {
    const int64_t *ops = (const int64_t *)t->ops.buf;
    const int64_t *targets = (const int64_t *)t->targets.buf;
    const int64_t *unit_shape = (const int64_t *)t->shape.buf;
    const int ndim = t->ndim, swap = t->swap, last = t->ndim - 1;
    const Py_ssize_t width = t->width;
    const int src_size = ITEMSIZE[t->src_type], dst_size = ITEMSIZE[t->dst_type];
    long long elements = 0;
    int64_t unit_strides[MAX_NDIM];
    int64_t st = 1;
    for (int a = ndim - 1; a >= 0; a--) {
        unit_strides[a] = st;
        st *= unit_shape[a];
    }
    strip_key *keys = ndim > 0 ? malloc(sizeof(strip_key) * (size_t)(t->n_ops ? t->n_ops : 1)) : NULL;
    Py_ssize_t n_keys = 0;
    long long encoded = 0;
    Py_ssize_t op = 0;
    for (Py_ssize_t u = 0; u < t->n_units; u++) {
        size_t need = 0, first = (size_t)t->decoded_nbytes;
        if (t->views[u].src_len != t->decoded_nbytes) {
            t->status[u] = E_SIZE;
            t->err_codes[u] = (size_t)t->views[u].src_len;
        } else {
            t->status[u] = check_ops(t, u, op, unit_strides, &first, &need);
        }
        if (t->status[u] == OK) encoded += t->views[u].src_len;
        for (; op < t->n_ops && ops[op * width] - t->base == u; op++) {
            if (t->status[u] != OK) continue;
            const int64_t *o = ops + op * width, *tg = targets + o[1] * TARGET_WIDTH(ndim);
            int64_t n = op_elements(o, ndim);
            if (n == 0) continue;
            int boxed = keys != NULL && tg[1 + last] == 1;
            for (int a = 0; a < ndim; a++) boxed = boxed && o[2 + a] >= 0 && o[2 + ndim + a] >= 0;
            elements += n;
            if (boxed) {
                strip_key *k = &keys[n_keys++];
                memset(k, 0, sizeof *k);
                k->sample = o[1];
                for (int a = 0; a < last; a++) {
                    k->rows[2 * a] = o[2 + ndim + a];
                    k->rows[2 * a + 1] = o[2 + 2 * ndim + a];
                }
                k->col = o[2 + ndim + last];
                k->q = op;
                continue;
            }
            copy_op(t, t->views[u].src, o);
        }
    }
    if (n_keys) qsort(keys, (size_t)n_keys, sizeof *keys, cmp_strip);
    for (Py_ssize_t i = 0, j; i < n_keys; i = j) {
        for (j = i + 1; j < n_keys && keys[j].sample == keys[i].sample && !memcmp(keys[j].rows, keys[i].rows, sizeof keys[i].rows); j++) {
        }
        const int64_t *tg = targets + keys[i].sample * TARGET_WIDTH(ndim), *dst_strides = tg + 1;
        double nm[2];
        const double *nmp;
        const conv_t *c = target_conv(t, tg, nm, &nmp);
        char *dst_base = (char *)(intptr_t)tg[0];
        int64_t idx[MAX_NDIM] = {0};
        for (;;) { /* one destination row of the strip: a piece from each copy, left to right */
            int64_t s_add = 0, d_add = 0;
            for (int a = 0; a < last; a++) {
                s_add += idx[a] * unit_strides[a];
                d_add += idx[a] * dst_strides[a];
            }
            for (Py_ssize_t k = i; k < j; k++) {
                const int64_t *o = ops + keys[k].q * width;
                int64_t so = s_add, dof = d_add;
                for (int a = 0; a < ndim; a++) {
                    so += o[2 + a] * unit_strides[a];
                    dof += o[2 + ndim + a] * dst_strides[a];
                }
                const char *src = t->views[o[0] - t->base].src;
                c->row(src + so * src_size, dst_base + dof * dst_size, (Py_ssize_t)o[2 + 2 * ndim + last], swap, nmp);
            }
            int a = last - 1;
            while (a >= 0) {
                if (++idx[a] < keys[i].rows[2 * a + 1]) break;
                idx[a] = 0;
                a--;
            }
            if (a < 0) break;
        }
    }
    free(keys);
    t->encoded = encoded;
    t->elements = elements;
}

/* With the GIL: (unit, status, detail) for each unit that failed; detail is the zstd error
 * name (E_ZSTD), the bytes decoded (E_SIZE), blosc's return code (E_BLOSC) or None. The
 * caller words the message (native/__init__.py, describe). */
PyObject *dm_task_failures(task_t *t) {
    Py_ssize_t n_units = t->n_units;
    int *status = t->status;
    size_t *err_codes = t->err_codes;
    PyObject *result = PyList_New(0);
    if (!result) return NULL;
    for (Py_ssize_t u = 0; u < n_units; u++) {
        if (status[u] == OK) continue;
        PyObject *item;
        if (status[u] == E_ZSTD)
            item = Py_BuildValue("(nis)", u, status[u], dm_zstd_errname(err_codes[u]));
        else if (status[u] == E_SIZE || status[u] == E_BLOSC)
            item = Py_BuildValue("(nin)", u, status[u], (Py_ssize_t)err_codes[u]);
        else
            item = Py_BuildValue("(niO)", u, status[u], Py_None);
        if (!item || PyList_Append(result, item) < 0) {
            Py_XDECREF(item);
            Py_CLEAR(result);
            return NULL;
        }
        Py_DECREF(item);
    }
    return result;
}

/* Assemble a prepared, located task without the GIL (decoding it, or copying units already
 * decoded); (failures, encoded, elements) or NULL. */
static PyObject *task_run(task_t *t, void (*assemble)(task_t *)) {
    Py_BEGIN_ALLOW_THREADS;
    assemble(t);
    Py_END_ALLOW_THREADS;
    PyObject *failures = dm_task_failures(t);
    return failures ? Py_BuildValue("(NLL)", failures, t->encoded, t->elements) : NULL;
}

/*
 * run(data, data_offset, spans, ops, base, targets, unit_shape, src_type, dst_type, swap, codec,
 *     decoded_nbytes, pool)
 *   data: one bytes-like read of an object, starting at data_offset of it
 *   spans: int64 array (n_units, 2): each unit's offset in the object and its length (-1: to the
 *          end of data; a span reaching past the end is cut there: a truncated read is
 *          reported, not read beyond)
 *   ops: int64 array (n_ops, 2 + 3 * ndim): unit, target, src_start[ndim], dst_start[ndim], extent[ndim];
 *        units are numbered from base (the first span); a negative start -(k + 1), on either
 *        side, means the index list pool[k : k + extent]
 *   targets: int64 array (n_targets, 4 + 2 * ndim): address (0: no target), strides in
 *        elements, shape; every destination is checked against the shape; then a flag
 *        (nonzero: normalise) and the f64 bits of offset and scale
 *   keep: empty, or int64 array (n_units): per unit 0, or the address of decoded_nbytes
 *        bytes the unit is decoded into whole (a chunk cache entry; valid only when the
 *        unit is not among the failures)
 * Returns (failures, encoded, elements): (unit, status, detail) for units that failed (their
 * copies are not made; unit counted from 0), and the bytes decoded and elements written for the rest.
 */
PyObject *dm_py_run(PyObject *self, PyObject *args) {
    Py_buffer data_buf;
    long long data_offset;
    task_t t;
    memset(&t, 0, sizeof t);
    if (!PyArg_ParseTuple(args, "y*L" TASK_FORMAT, &data_buf, &data_offset, TASK_ARGS(t))) return NULL;
    PyObject *result = NULL;
    if (data_offset < 0) {
        PyErr_SetString(PyExc_ValueError, "a negative data offset");
    } else if (dm_task_prepare(&t) == 0) {
        dm_task_locate(&t, (const char *)data_buf.buf, data_buf.len, data_offset);
        result = task_run(&t, dm_task_assemble);
    }
    dm_task_release(&t);
    PyBuffer_Release(&data_buf);
    return result;
}

/*
 * run_decoded(sources, <the task arguments of run>): as run, for units already decoded (chunk
 * cache entries): sources is an int64 array (n_units) of the addresses of each unit's
 * decoded_nbytes bytes in the stored dtype; spans are not read and codec is ignored.
 */
PyObject *dm_py_run_decoded(PyObject *self, PyObject *args) {
    Py_buffer sources;
    task_t t;
    memset(&t, 0, sizeof t);
    if (!PyArg_ParseTuple(args, "y*" TASK_FORMAT, &sources, TASK_ARGS(t))) return NULL;
    PyObject *result = NULL;
    t.codec = CODEC_RAW;
    if (dm_task_prepare(&t) == 0) {
        if (sources.len != t.n_units * 8 || t.keep.len) {
            PyErr_SetString(PyExc_ValueError, "run_decoded needs one source address per unit and nothing to keep");
        } else {
            const int64_t *src = (const int64_t *)sources.buf;
            for (Py_ssize_t u = 0; u < t.n_units; u++) {
                t.views[u].src = (const char *)(intptr_t)src[u];
                t.views[u].src_len = src[u] ? t.decoded_nbytes : 0;
            }
            result = task_run(&t, assemble_decoded);
        }
    }
    dm_task_release(&t);
    PyBuffer_Release(&sources);
    return result;
}
