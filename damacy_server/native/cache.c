/*
 * CacheIndex: the chunk cache's keys, values, order and admission in C, so that a batch's
 * lookups (hundreds of units) cost a C loop over a hash table, not several dict passes.
 *
 * It plays exactly the rules of damacy_server/cache.py's LRUCache (the reference, which the
 * tests hold it to, operation by operation): least recently used first out, bounded by
 * entries and/or bytes; with `adaptive`, admission by frequency or by recency, chosen by a
 * key-only shadow that plays the other rule on the same lookups, counts halved every
 * 10 x entries lookups. The rule's numbers are given by the caller (cache.py is their home).
 *
 * Keys are any hashable objects; an int (or an object with __index__, as numpy's ints) that
 * fits in 64 bits is held as that number, not as an object: it is hashed and compared
 * without touching an object, and a key array (an int64 buffer: the planner's, a batch's
 * units at once) is looked up without a Python object per key. (A float equal to such an int
 * is another key, unlike in a dict.) Values are any objects, each with the address a put
 * gave it (0: none), handed back by get_hits so that native copies need no buffer lookup
 * per value. Every method runs with the GIL held and calls no Python code for int or
 * tuple-of-int keys; values that leave are released only once the index is consistent again
 * (their deallocation may run code).
 */
#include "native.h"

#define NONE -1

enum { K_FREE, K_INT, K_OBJ };

/* a key: an int held as its number (obj NULL), or any other object (borrowed) */
typedef struct {
    PyObject *obj;
    int64_t i;
    Py_hash_t hash;
} ckey_t;

typedef struct {
    PyObject *key;   /* owned, K_OBJ keys only */
    PyObject *value; /* owned (the entries' table only) */
    int64_t ikey;    /* K_INT keys */
    Py_hash_t hash;
    int64_t size;        /* bytes (entries, shadow) or the count (frequencies) */
    int64_t address;     /* the value's, as put gave it (entries only; 0: none) */
    int32_t prev, next;  /* the order, oldest first (entries, shadow); next also links free nodes */
    int8_t kind;         /* K_FREE: the node is free */
} node_t;

/* a key of an object: an int that fits in 64 bits held as its number; 0, or -1 (an error set) */
static int key_of(PyObject *o, ckey_t *k) {
    if (PyLong_Check(o) || (!PyFloat_Check(o) && PyIndex_Check(o))) {
        PyObject *num = PyLong_Check(o) ? (Py_INCREF(o), o) : PyNumber_Index(o);
        if (!num) return -1;
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(num, &overflow);
        Py_DECREF(num);
        if (v == -1 && PyErr_Occurred()) return -1;
        if (!overflow) {
            k->obj = NULL;
            k->i = v;
            k->hash = (Py_hash_t)v;
            return 0;
        }
    }
    k->obj = o;
    k->i = 0;
    k->hash = PyObject_Hash(o);
    return k->hash == -1 && PyErr_Occurred() ? -1 : 0;
}

/* a node's key (borrowed) */
static ckey_t node_key(const node_t *n) {
    ckey_t k = {n->kind == K_OBJ ? n->key : NULL, n->ikey, n->hash};
    return k;
}

/* a node's key as an object (a new reference) */
static PyObject *key_object(const node_t *n) {
    if (n->kind == K_INT) return PyLong_FromLongLong(n->ikey);
    Py_INCREF(n->key);
    return n->key;
}

/* the keys a method is given: a sequence of objects, or an int64 buffer (a key array) */
typedef struct {
    PyObject *fast;
    Py_buffer buf;
    int is_buf;
    Py_ssize_t n;
} keys_in;

static int keys_open(PyObject *arg, keys_in *ks, const char *what) {
    memset(ks, 0, sizeof *ks);
    if (PyObject_CheckBuffer(arg) && !PyBytes_Check(arg) && !PyByteArray_Check(arg)) {
        if (PyObject_GetBuffer(arg, &ks->buf, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
        ks->is_buf = 1;
        const char *f = ks->buf.format ? ks->buf.format : "B";
        if (*f == '<' || *f == '=' || *f == '@') f++;
        if (ks->buf.itemsize != 8 || (strcmp(f, "q") && strcmp(f, "l"))) {
            PyBuffer_Release(&ks->buf);
            PyErr_Format(PyExc_TypeError, "%s: a key array must hold int64s", what);
            return -1;
        }
        ks->n = ks->buf.len / 8;
        return 0;
    }
    ks->fast = PySequence_Fast(arg, what);
    if (!ks->fast) return -1;
    ks->n = PySequence_Fast_GET_SIZE(ks->fast);
    return 0;
}

static int keys_get(keys_in *ks, Py_ssize_t i, ckey_t *k) {
    if (ks->is_buf) {
        k->obj = NULL;
        k->i = ((const int64_t *)ks->buf.buf)[i];
        k->hash = (Py_hash_t)k->i;
        return 0;
    }
    return key_of(PySequence_Fast_ITEMS(ks->fast)[i], k);
}

static void keys_close(keys_in *ks) {
    if (ks->is_buf) PyBuffer_Release(&ks->buf);
    Py_XDECREF(ks->fast);
}

typedef struct {
    node_t *nodes;
    int32_t cap, top, used, free; /* nodes allocated, ever handed out, live; first free */
    int32_t *slots;               /* open addressing, linear probing: a node or NONE */
    size_t mask;                  /* slots - 1 (0: no slots yet) */
    int32_t head, tail;           /* oldest, newest */
} table_t;

/* objects to release once a method is done with the index */
typedef struct {
    PyObject **items;
    Py_ssize_t n, cap;
} dead_t;

static int dead_add(dead_t *d, PyObject *o) {
    if (!o) return 0;
    if (d->n == d->cap) {
        Py_ssize_t cap = d->cap ? 2 * d->cap : 16;
        PyObject **items = PyMem_Realloc(d->items, cap * sizeof(PyObject *));
        if (!items) {
            Py_DECREF(o); /* (no room to defer: released now) */
            return -1;
        }
        d->items = items;
        d->cap = cap;
    }
    d->items[d->n++] = o;
    return 0;
}

static void dead_release(dead_t *d) {
    for (Py_ssize_t i = 0; i < d->n; i++) Py_DECREF(d->items[i]);
    PyMem_Free(d->items);
    d->items = NULL;
    d->n = d->cap = 0;
}

static void table_init(table_t *t) {
    memset(t, 0, sizeof(*t));
    t->free = t->head = t->tail = NONE;
}

static void table_free(table_t *t, dead_t *dead) {
    for (int32_t i = 0; i < t->top; i++) {
        if (t->nodes[i].kind != K_FREE) {
            if (t->nodes[i].kind == K_OBJ) dead_add(dead, t->nodes[i].key);
            dead_add(dead, t->nodes[i].value);
        }
    }
    PyMem_Free(t->nodes);
    PyMem_Free(t->slots);
    table_init(t);
}

/* a key's first slot: its hash mixed (splitmix64's finaliser), as the planner's keys are
 * runs of consecutive ints that differ between arrays only in their high bits */
static size_t home(Py_hash_t hash, size_t mask) {
    uint64_t x = (uint64_t)hash;
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return (size_t)x & mask;
}

/* 1 equal, 0 not, -1 error; int keys are compared as numbers, no object touched */
static int same_key(const node_t *n, const ckey_t *k) {
    if (n->hash != k->hash) return 0;
    if (!k->obj) return n->kind == K_INT && n->ikey == k->i;
    if (n->kind != K_OBJ) return 0;
    if (n->key == k->obj) return 1;
    return PyObject_RichCompareBool(n->key, k->obj, Py_EQ);
}

/* the slot holding `key`, or the empty slot where it would go (*found 0); -1: error */
static Py_ssize_t table_slot(table_t *t, const ckey_t *key, int *found) {
    size_t i = home(key->hash, t->mask);
    *found = 0;
    if (!t->mask) return 0;
    for (;;) {
        int32_t n = t->slots[i];
        if (n == NONE) return (Py_ssize_t)i;
        int eq = same_key(&t->nodes[n], key);
        if (eq < 0) return -1;
        if (eq) {
            *found = 1;
            return (Py_ssize_t)i;
        }
        i = (i + 1) & t->mask;
    }
}

/* the node of `key`, NONE if absent, or -2 on error */
static int32_t table_find(table_t *t, const ckey_t *key) {
    int found;
    Py_ssize_t s = table_slot(t, key, &found);
    if (s < 0) return -2;
    return found ? t->slots[s] : NONE;
}

static int table_resize(table_t *t, size_t nslots) {
    int32_t *slots = PyMem_Malloc(nslots * sizeof(int32_t));
    if (!slots) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t i = 0; i < nslots; i++) slots[i] = NONE;
    size_t mask = nslots - 1;
    for (int32_t n = 0; n < t->top; n++) {
        if (t->nodes[n].kind == K_FREE) continue;
        size_t i = home(t->nodes[n].hash, mask);
        while (slots[i] != NONE) i = (i + 1) & mask;
        slots[i] = n;
    }
    PyMem_Free(t->slots);
    t->slots = slots;
    t->mask = mask;
    return 0;
}

static void link_tail(table_t *t, int32_t n) {
    node_t *x = &t->nodes[n];
    x->prev = t->tail;
    x->next = NONE;
    if (t->tail != NONE) t->nodes[t->tail].next = n;
    else t->head = n;
    t->tail = n;
}

static void link_head(table_t *t, int32_t n) {
    node_t *x = &t->nodes[n];
    x->next = t->head;
    x->prev = NONE;
    if (t->head != NONE) t->nodes[t->head].prev = n;
    else t->tail = n;
    t->head = n;
}

static void unlink_node(table_t *t, int32_t n) {
    node_t *x = &t->nodes[n];
    if (x->prev != NONE) t->nodes[x->prev].next = x->next;
    else t->head = x->next;
    if (x->next != NONE) t->nodes[x->next].prev = x->prev;
    else t->tail = x->prev;
}

static void move_to_end(table_t *t, int32_t n) {
    if (t->tail == n) return;
    unlink_node(t, n);
    link_tail(t, n);
}

/* a new node for `key` (absent: the caller looked) at the end of the order; -1: no memory */
static int32_t table_insert(table_t *t, const ckey_t *key) {
    if ((size_t)(t->used + 1) * 2 > (t->mask ? t->mask + 1 : 0)) {
        size_t nslots = t->mask ? 2 * (t->mask + 1) : 16;
        while ((size_t)(t->used + 1) * 2 > nslots) nslots *= 2;
        if (table_resize(t, nslots) < 0) return -1;
    }
    int32_t n;
    if (t->free != NONE) {
        n = t->free;
        t->free = t->nodes[n].next;
    } else {
        if (t->top == t->cap) {
            int32_t cap = t->cap ? 2 * t->cap : 16;
            node_t *nodes = PyMem_Realloc(t->nodes, (size_t)cap * sizeof(node_t));
            if (!nodes) {
                PyErr_NoMemory();
                return -1;
            }
            t->nodes = nodes;
            t->cap = cap;
        }
        n = t->top++;
    }
    node_t *x = &t->nodes[n];
    x->kind = key->obj ? K_OBJ : K_INT;
    x->key = key->obj;
    Py_XINCREF(key->obj);
    x->ikey = key->i;
    x->value = NULL;
    x->hash = key->hash;
    x->size = 0;
    x->address = 0;
    size_t i = home(key->hash, t->mask);
    while (t->slots[i] != NONE) i = (i + 1) & t->mask;
    t->slots[i] = n;
    t->used++;
    link_tail(t, n);
    return n;
}

/* take node `n` (in slot `s`) out; its key and value go to `dead` */
static void table_remove_at(table_t *t, Py_ssize_t s, int32_t n, dead_t *dead) {
    /* backward-shift deletion: no tombstones */
    size_t i = (size_t)s, j = i;
    for (;;) {
        j = (j + 1) & t->mask;
        int32_t m = t->slots[j];
        if (m == NONE) break;
        size_t k = home(t->nodes[m].hash, t->mask); /* where m would like to be */
        /* m may move to i when i lies cyclically in [k, j) */
        if ((j > i && (k <= i || k > j)) || (j < i && (k <= i && k > j))) {
            t->slots[i] = m;
            i = j;
        }
    }
    t->slots[i] = NONE;
    unlink_node(t, n);
    node_t *x = &t->nodes[n];
    if (x->kind == K_OBJ) dead_add(dead, x->key);
    dead_add(dead, x->value);
    x->key = x->value = NULL;
    x->kind = K_FREE;
    x->next = t->free;
    t->free = n;
    t->used--;
}

/* remove the node of `key` if present: 1 removed (its size in *size), 0 absent, -1 error */
static int table_pop(table_t *t, const ckey_t *key, int64_t *size, dead_t *dead) {
    int found;
    Py_ssize_t s = table_slot(t, key, &found);
    if (s < 0) return -1;
    if (!found) return 0;
    int32_t n = t->slots[s];
    *size = t->nodes[n].size;
    table_remove_at(t, s, n, dead);
    return 1;
}

/* the slot of node `n` (in the table): found by its place, no key compared */
static Py_ssize_t slot_of(table_t *t, int32_t n) {
    size_t i = home(t->nodes[n].hash, t->mask);
    while (t->slots[i] != n) i = (i + 1) & t->mask;
    return (Py_ssize_t)i;
}

static void table_pop_oldest(table_t *t, int64_t *size, dead_t *dead) {
    int32_t n = t->head;
    *size = t->nodes[n].size;
    table_remove_at(t, slot_of(t, n), n, dead);
}

/* ---- the index ----------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    table_t data, shadow, freq;
    long long max_entries, max_bytes; /* -1: no bound */
    long long bytes, shadow_bytes;
    long long hits, misses, evictions, rejections, switches;
    long long lookups, seen, period_hits, shadow_hits, wins;
    int adaptive, by_frequency;
    /* the rules (cache.py): margin, the shadow's win (ratio as num/den, minimum hits), periods */
    long long margin, ratio_num, ratio_den, min_hits, periods_frequency, periods_recency;
} index_t;

static int full(index_t *c, long long extra, long long entries, long long nbytes) {
    return (c->max_entries >= 0 && entries > c->max_entries) || (c->max_bytes >= 0 && nbytes + extra > c->max_bytes);
}

static long long count_of(index_t *c, const ckey_t *key, int *err) {
    int32_t n = table_find(&c->freq, key);
    if (n == -2) {
        *err = 1;
        return 0;
    }
    return n == NONE ? 0 : c->freq.nodes[n].size;
}

/* whether a cache holding table `t` (`nbytes`) under a rule admits `key`: 1, 0, -1 error */
static int admits(index_t *c, const ckey_t *key, long long size, int by_frequency, table_t *t, long long nbytes) {
    if (!by_frequency || t->used == 0) return 1;
    int32_t n = table_find(t, key);
    if (n == -2) return -1;
    if (n != NONE || !full(c, size, (long long)t->used + 1, nbytes)) return 1;
    int err = 0;
    ckey_t oldest = node_key(&t->nodes[t->head]);
    long long mine = count_of(c, key, &err);
    long long theirs = count_of(c, &oldest, &err);
    if (err) return -1;
    return mine > theirs + c->margin;
}

static int play_shadow(index_t *c, const ckey_t *key, long long size, dead_t *dead) {
    table_t *s = &c->shadow;
    int32_t n = table_find(s, key);
    if (n == -2) return -1;
    if (n != NONE) return 0;
    int ok = admits(c, key, size, !c->by_frequency, s, c->shadow_bytes);
    if (ok <= 0) return ok;
    n = table_insert(s, key);
    if (n < 0) return -1;
    s->nodes[n].size = size;
    c->shadow_bytes += size;
    while (s->used && full(c, 0, s->used, c->shadow_bytes)) {
        int64_t gone;
        table_pop_oldest(s, &gone, dead);
        c->shadow_bytes -= gone;
    }
    return 0;
}

/* the shadow's rule taken (see LRUCache._switch) */
static int switch_rule(index_t *c, dead_t *dead) {
    table_t *d = &c->data, *s = &c->shadow;
    c->by_frequency = !c->by_frequency;
    c->switches++;
    c->wins = 0;
    /* entries the shadow does not hold go to the front, keeping their order: walk from the
     * newest, each one found moved to the head */
    int32_t n = d->tail;
    int32_t front = NONE; /* the first node moved: the walk stops before reaching it again */
    while (n != NONE && n != front) {
        int32_t prev = d->nodes[n].prev;
        ckey_t k = node_key(&d->nodes[n]);
        int32_t in = table_find(s, &k);
        if (in == -2) return -1;
        if (in == NONE) {
            unlink_node(d, n);
            link_head(d, n);
            if (front == NONE) front = n;
        }
        n = prev;
    }
    table_free(s, dead);
    for (n = d->head; n != NONE; n = d->nodes[n].next) {
        ckey_t k = node_key(&d->nodes[n]);
        int32_t m = table_insert(s, &k);
        if (m < 0) return -1;
        s->nodes[m].size = d->nodes[n].size;
    }
    c->shadow_bytes = c->bytes;
    return 0;
}

static void age_counts(index_t *c, dead_t *dead) {
    table_t *f = &c->freq;
    for (int32_t n = 0; n < f->top; n++) {
        node_t *x = &f->nodes[n];
        if (x->kind == K_FREE) continue;
        if (x->size > 1) {
            x->size >>= 1;
        } else {
            table_remove_at(f, slot_of(f, n), n, dead);
        }
    }
}

/* one lookup counted for admission (see LRUCache._count) */
static int count_lookup(index_t *c, const ckey_t *key, int hit, long long span, dead_t *dead) {
    table_t *f = &c->freq;
    int32_t n = table_find(f, key);
    if (n == -2) return -1;
    if (n == NONE && (n = table_insert(f, key)) < 0) return -1;
    f->nodes[n].size++;
    if (++c->lookups >= 10 * span) {
        c->lookups = 0;
        age_counts(c, dead);
    }
    c->seen++;
    c->period_hits += hit;
    int32_t m = table_find(&c->shadow, key);
    if (m == -2) return -1;
    if (m != NONE) {
        c->shadow_hits++;
        move_to_end(&c->shadow, m);
    }
    if (c->seen >= span) {
        int won = c->shadow_hits >= c->min_hits && c->shadow_hits * c->ratio_den > c->period_hits * c->ratio_num;
        c->wins = won ? c->wins + 1 : 0;
        c->seen = c->period_hits = c->shadow_hits = 0;
        if (c->wins >= (c->by_frequency ? c->periods_recency : c->periods_frequency) && switch_rule(c, dead) < 0) return -1;
    }
    return 0;
}

static PyObject *index_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kw[] = {"max_entries", "max_bytes", "adaptive", "rules", NULL};
    long long max_entries, max_bytes;
    int adaptive;
    long long r[6];
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "LLp(LLLLLL)", kw, &max_entries, &max_bytes, &adaptive, &r[0], &r[1], &r[2],
                                     &r[3], &r[4], &r[5]))
        return NULL;
    if (r[2] <= 0) {
        PyErr_SetString(PyExc_ValueError, "CacheIndex: the ratio's denominator must be positive");
        return NULL;
    }
    index_t *c = (index_t *)type->tp_alloc(type, 0);
    if (!c) return NULL;
    table_init(&c->data);
    table_init(&c->shadow);
    table_init(&c->freq);
    c->max_entries = max_entries;
    c->max_bytes = max_bytes;
    c->adaptive = adaptive;
    c->margin = r[0];
    c->ratio_num = r[1];
    c->ratio_den = r[2];
    c->min_hits = r[3];
    c->periods_frequency = r[4];
    c->periods_recency = r[5];
    return (PyObject *)c;
}

static void index_dealloc(index_t *c) {
    dead_t dead = {0};
    table_free(&c->data, &dead);
    table_free(&c->shadow, &dead);
    table_free(&c->freq, &dead);
    Py_TYPE(c)->tp_free((PyObject *)c);
    dead_release(&dead);
}

/* get_hits(keys): (per key 1 if held else 0, as bytes; the values held, in the keys' order;
 * their addresses as put gave them, int64 bytes, 0 where none was given); each held one
 * becomes the newest; hits and misses counted; with `adaptive` the lookups counted for
 * admission. `keys`: a sequence, or an int64 buffer. */
static PyObject *index_get_hits(index_t *c, PyObject *arg) {
    keys_in ks;
    if (keys_open(arg, &ks, "get_hits needs a sequence of keys or an int64 key array") < 0) return NULL;
    Py_ssize_t n = ks.n;
    PyObject *mask = PyBytes_FromStringAndSize(NULL, n);
    PyObject *values = PyList_New(n);
    PyObject *addresses = PyBytes_FromStringAndSize(NULL, 8 * n);
    ckey_t *keys = PyMem_Malloc((n ? n : 1) * sizeof(ckey_t));
    dead_t dead = {0};
    PyObject *out = NULL;
    Py_ssize_t found = 0;
    if (!mask || !values || !addresses || !keys) {
        if (!keys) PyErr_NoMemory();
        goto done;
    }
    char *held = PyBytes_AS_STRING(mask);
    int64_t *at = (int64_t *)PyBytes_AS_STRING(addresses);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (keys_get(&ks, i, &keys[i]) < 0) goto done;
        int32_t k = table_find(&c->data, &keys[i]);
        if (k == -2) goto done;
        held[i] = k != NONE;
        if (k != NONE) {
            node_t *x = &c->data.nodes[k];
            move_to_end(&c->data, k);
            Py_INCREF(x->value);
            PyList_SET_ITEM(values, found, x->value);
            at[found++] = x->address;
        }
    }
    c->hits += found;
    c->misses += n - found;
    if (c->adaptive) {
        long long span = c->data.used > 64 ? c->data.used : 64; /* lookups do not change the size */
        for (Py_ssize_t i = 0; i < n; i++)
            if (count_lookup(c, &keys[i], held[i], span, &dead) < 0) goto done;
    }
    if (PyList_SetSlice(values, found, n, NULL) < 0 || _PyBytes_Resize(&addresses, 8 * found) < 0) goto done;
    out = PyTuple_Pack(3, mask, values, addresses);
done:
    if (!out && values) /* the slots not filled: the list must not release them */
        for (Py_ssize_t i = found; i < n; i++) PyList_SET_ITEM(values, i, Py_NewRef(Py_None));
    keys_close(&ks);
    Py_XDECREF(mask);
    Py_XDECREF(values);
    Py_XDECREF(addresses);
    PyMem_Free(keys);
    dead_release(&dead);
    return out;
}

/* peek_many(keys): the value of each key, None where not held; nothing counted or moved */
static PyObject *index_peek_many(index_t *c, PyObject *arg) {
    keys_in ks;
    if (keys_open(arg, &ks, "peek_many needs a sequence of keys or an int64 key array") < 0) return NULL;
    PyObject *out = PyList_New(ks.n);
    if (!out) goto fail;
    for (Py_ssize_t i = 0; i < ks.n; i++) {
        ckey_t key;
        int32_t k = keys_get(&ks, i, &key) < 0 ? -2 : table_find(&c->data, &key);
        if (k == -2) {
            for (; i < ks.n; i++) PyList_SET_ITEM(out, i, Py_NewRef(Py_None));
            goto fail;
        }
        PyObject *v = k == NONE ? Py_None : c->data.nodes[k].value;
        PyList_SET_ITEM(out, i, Py_NewRef(v));
    }
    keys_close(&ks);
    return out;
fail:
    keys_close(&ks);
    Py_XDECREF(out);
    return NULL;
}

/* whether put would keep a value of `size` under `key` now (the shadow plays it): 1, 0, -1 error */
static int would_admit_one(index_t *c, const ckey_t *key, long long size, dead_t *dead) {
    if (c->max_entries == 0 || (c->max_bytes >= 0 && size > c->max_bytes)) return 0;
    if (!c->adaptive) return 1;
    int ok = play_shadow(c, key, size, dead);
    if (ok == 0) ok = admits(c, key, size, c->by_frequency, &c->data, c->bytes);
    return ok;
}

/* keep `value` (of `size`, at `address`) under `key`: 1 kept, 0 not admitted (or the cache is
 * off), -1 error */
static int put_one(index_t *c, const ckey_t *key, PyObject *value, long long size, int64_t address, dead_t *dead) {
    if (c->max_entries == 0 || (c->max_bytes >= 0 && size > c->max_bytes)) return 0;
    int64_t old;
    int had = table_pop(&c->data, key, &old, dead);
    if (had < 0) return -1;
    if (had) {
        c->bytes -= old;
    } else if (c->adaptive) {
        int ok = play_shadow(c, key, size, dead);
        if (ok == 0) ok = admits(c, key, size, c->by_frequency, &c->data, c->bytes);
        if (ok < 0) return -1;
        if (!ok) {
            c->rejections++;
            return 0;
        }
    }
    int32_t n = table_insert(&c->data, key);
    if (n < 0) return -1;
    node_t *x = &c->data.nodes[n];
    x->value = Py_NewRef(value);
    x->size = size;
    x->address = address;
    c->bytes += size;
    while (full(c, 0, c->data.used, c->bytes)) {
        int64_t gone;
        table_pop_oldest(&c->data, &gone, dead);
        c->bytes -= gone;
        c->evictions++;
    }
    return 1;
}

/* would_admit(key, size): whether put would keep a value of `size` now (the shadow plays it) */
static PyObject *index_would_admit(index_t *c, PyObject *args) {
    PyObject *obj;
    long long size;
    ckey_t key;
    if (!PyArg_ParseTuple(args, "OL", &obj, &size) || key_of(obj, &key) < 0) return NULL;
    dead_t dead = {0};
    int ok = would_admit_one(c, &key, size, &dead);
    dead_release(&dead);
    return ok < 0 ? NULL : PyBool_FromLong(ok);
}

/* would_admit_many(keys, size): would_admit of each key in turn, as bytes (1: admitted) */
static PyObject *index_would_admit_many(index_t *c, PyObject *args) {
    PyObject *seq;
    long long size;
    keys_in ks;
    if (!PyArg_ParseTuple(args, "OL", &seq, &size)) return NULL;
    if (keys_open(seq, &ks, "would_admit_many needs a sequence of keys or an int64 key array") < 0) return NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, ks.n);
    dead_t dead = {0};
    for (Py_ssize_t i = 0; out && i < ks.n; i++) {
        ckey_t key;
        int ok = keys_get(&ks, i, &key) < 0 ? -1 : would_admit_one(c, &key, size, &dead);
        if (ok < 0) Py_CLEAR(out);
        else PyBytes_AS_STRING(out)[i] = (char)ok;
    }
    keys_close(&ks);
    dead_release(&dead);
    return out;
}

/* put(key, value, size[, address]): keep the value (at `address`, handed back by get_hits;
 * 0: none); False when it was not admitted (or the cache is off) */
static PyObject *index_put(index_t *c, PyObject *args) {
    PyObject *obj, *value;
    long long size, address = 0;
    ckey_t key;
    if (!PyArg_ParseTuple(args, "OOL|L", &obj, &value, &size, &address) || key_of(obj, &key) < 0) return NULL;
    dead_t dead = {0};
    int ok = put_one(c, &key, value, size, address, &dead);
    dead_release(&dead);
    return ok < 0 ? NULL : PyBool_FromLong(ok);
}

/* put_many(keys, values, size[, addresses]): put of each (key, value) in turn, every value of
 * `size` bytes (`addresses`: an int64 buffer, one per value; absent or None: none); how many
 * were kept */
static PyObject *index_put_many(index_t *c, PyObject *args) {
    PyObject *kseq, *vseq, *aobj = Py_None;
    long long size;
    if (!PyArg_ParseTuple(args, "OOL|O", &kseq, &vseq, &size, &aobj)) return NULL;
    keys_in ks;
    if (keys_open(kseq, &ks, "put_many needs a sequence of keys or an int64 key array") < 0) return NULL;
    PyObject *vf = PySequence_Fast(vseq, "put_many needs a sequence of values");
    Py_buffer ab = {0};
    int has_addresses = 0;
    PyObject *out = NULL;
    if (!vf) goto done;
    if (aobj != Py_None) {
        if (PyObject_GetBuffer(aobj, &ab, PyBUF_C_CONTIGUOUS) < 0) goto done;
        has_addresses = 1;
        if (ab.len != 8 * PySequence_Fast_GET_SIZE(vf)) {
            PyErr_SetString(PyExc_ValueError, "put_many: an address (int64) per value");
            goto done;
        }
    }
    if (PySequence_Fast_GET_SIZE(vf) != ks.n) {
        PyErr_SetString(PyExc_ValueError, "put_many: as many values as keys");
        goto done;
    }
    dead_t dead = {0};
    long long kept = 0;
    int ok = 0;
    const int64_t *at = has_addresses ? (const int64_t *)ab.buf : NULL;
    for (Py_ssize_t i = 0; i < ks.n && ok >= 0; i++) {
        ckey_t key;
        ok = keys_get(&ks, i, &key) < 0 ? -1 : put_one(c, &key, PySequence_Fast_ITEMS(vf)[i], size, at ? at[i] : 0, &dead);
        kept += ok > 0;
    }
    dead_release(&dead);
    if (ok >= 0) out = PyLong_FromLongLong(kept);
done:
    if (has_addresses) PyBuffer_Release(&ab);
    keys_close(&ks);
    Py_XDECREF(vf);
    return out;
}

/* has_room(size): whether a value of `size` fits without evicting anything */
static PyObject *index_has_room(index_t *c, PyObject *arg) {
    long long size = PyLong_AsLongLong(arg);
    if (size == -1 && PyErr_Occurred()) return NULL;
    return PyBool_FromLong(!full(c, size, (long long)c->data.used + 1, c->bytes));
}

/* clear(): every entry forgotten (the counts, the shadow and the figures stay, as LRUCache's) */
static PyObject *index_clear(index_t *c, PyObject *noargs) {
    dead_t dead = {0};
    table_free(&c->data, &dead);
    c->bytes = 0;
    dead_release(&dead);
    Py_RETURN_NONE;
}

/* discard(keys): those keys forgotten, from the entries and the shadow; how many entries went */
static PyObject *index_discard(index_t *c, PyObject *arg) {
    keys_in ks;
    if (keys_open(arg, &ks, "discard needs a sequence of keys or an int64 key array") < 0) return NULL;
    dead_t dead = {0};
    long long gone = 0;
    int failed = 0;
    for (Py_ssize_t i = 0; i < ks.n && !failed; i++) {
        ckey_t key;
        int64_t size;
        int r;
        if (keys_get(&ks, i, &key) < 0 || (r = table_pop(&c->data, &key, &size, &dead)) < 0) {
            failed = 1;
            break;
        }
        if (r) {
            c->bytes -= size;
            gone++;
        }
        if ((r = table_pop(&c->shadow, &key, &size, &dead)) < 0) failed = 1;
        else if (r) c->shadow_bytes -= size;
    }
    keys_close(&ks);
    dead_release(&dead);
    return failed ? NULL : PyLong_FromLongLong(gone);
}

enum { KEYS, KEY_VALUE, KEY_SIZE };

/* a table in order, oldest first: its keys, (key, value) or (key, size) pairs */
static PyObject *walk(table_t *t, int form) {
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    for (int32_t n = t->head; n != NONE; n = t->nodes[n].next) {
        node_t *x = &t->nodes[n];
        PyObject *key = key_object(x);
        PyObject *item = !key               ? NULL
                         : form == KEYS      ? Py_NewRef(key)
                         : form == KEY_VALUE ? PyTuple_Pack(2, key, x->value)
                                             : Py_BuildValue("(OL)", key, (long long)x->size);
        Py_XDECREF(key);
        if (!item || PyList_Append(out, item) < 0) {
            Py_XDECREF(item);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(item);
    }
    return out;
}

/* keys(), items(), shadow(): the entries' keys, the entries' (key, value) pairs, the
 * shadow's (key, size) pairs, oldest first */
static PyObject *index_keys(index_t *c, PyObject *noargs) { return walk(&c->data, KEYS); }
static PyObject *index_items(index_t *c, PyObject *noargs) { return walk(&c->data, KEY_VALUE); }
static PyObject *index_shadow(index_t *c, PyObject *noargs) { return walk(&c->shadow, KEY_SIZE); }

/* counts(): the admission counts, a dict */
static PyObject *index_counts(index_t *c, PyObject *noargs) {
    PyObject *out = PyDict_New();
    if (!out) return NULL;
    for (int32_t n = 0; n < c->freq.top; n++) {
        node_t *x = &c->freq.nodes[n];
        if (x->kind == K_FREE) continue;
        PyObject *k = key_object(x);
        PyObject *v = k ? PyLong_FromLongLong(x->size) : NULL;
        int bad = !v || PyDict_SetItem(out, k, v) < 0;
        Py_XDECREF(k);
        Py_XDECREF(v);
        if (bad) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

/* state(): the bounds (-1: none), the figures and the admission state, a dict */
static PyObject *index_state(index_t *c, PyObject *noargs) {
    return Py_BuildValue(
        "{sLsLsOsLsLsLsLsLsLsLsLsLsLsLsLsLsLsO}", "max_entries", c->max_entries, "max_bytes", c->max_bytes, "adaptive",
        c->adaptive ? Py_True : Py_False, "entries", (long long)c->data.used, "bytes", c->bytes, "hits", c->hits, "misses",
        c->misses, "evictions", c->evictions, "rejections", c->rejections, "switches", c->switches, "lookups", c->lookups,
        "seen", c->seen, "period_hits", c->period_hits, "shadow_hits", c->shadow_hits, "wins", c->wins, "shadow_bytes",
        c->shadow_bytes, "shadow_entries", (long long)c->shadow.used, "by_frequency", c->by_frequency ? Py_True : Py_False);
}

static Py_ssize_t index_len(index_t *c) { return c->data.used; }

static PyObject *index_nbytes(index_t *c, void *closure) { return PyLong_FromLongLong(c->bytes); }

static PyMethodDef index_methods[] = {
    {"get_hits", (PyCFunction)index_get_hits, METH_O, "Look keys up, counted: (held mask as bytes, their values in order, their addresses as int64 bytes)."},
    {"peek_many", (PyCFunction)index_peek_many, METH_O, "The value of each key (None: not held), nothing counted."},
    {"would_admit", (PyCFunction)index_would_admit, METH_VARARGS, "Whether put(key, value, size) would keep the value now."},
    {"would_admit_many", (PyCFunction)index_would_admit_many, METH_VARARGS, "would_admit of each key in turn (bytes: 1 admitted)."},
    {"put", (PyCFunction)index_put, METH_VARARGS, "Keep a value of size bytes (at address) under key; False when not admitted."},
    {"put_many", (PyCFunction)index_put_many, METH_VARARGS, "put of each (key, value[, address]) in turn, each of size bytes; how many were kept."},
    {"has_room", (PyCFunction)index_has_room, METH_O, "Whether a value of size bytes fits without evicting."},
    {"clear", (PyCFunction)index_clear, METH_NOARGS, "Forget every entry."},
    {"discard", (PyCFunction)index_discard, METH_O, "Forget these keys (entries and shadow); how many entries went."},
    {"keys", (PyCFunction)index_keys, METH_NOARGS, "The entries' keys, oldest first."},
    {"items", (PyCFunction)index_items, METH_NOARGS, "The entries' (key, value) pairs, oldest first."},
    {"shadow", (PyCFunction)index_shadow, METH_NOARGS, "The shadow's (key, size) pairs, oldest first."},
    {"counts", (PyCFunction)index_counts, METH_NOARGS, "The admission counts (a dict)."},
    {"state", (PyCFunction)index_state, METH_NOARGS, "The figures and the admission state (a dict)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef index_getset[] = {
    {"nbytes", (getter)index_nbytes, NULL, "The bytes held.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods index_sequence = {.sq_length = (lenfunc)index_len};

static PyTypeObject IndexType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "damacy_server.native._assemble.CacheIndex",
    .tp_basicsize = sizeof(index_t),
    .tp_dealloc = (destructor)index_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "CacheIndex(max_entries, max_bytes, adaptive, rules): an LRU cache's index with adaptive admission (-1: no bound).",
    .tp_methods = index_methods,
    .tp_getset = index_getset,
    .tp_as_sequence = &index_sequence,
    .tp_new = index_new,
};

/* the type readied and added to the module as CacheIndex (its tp_name's last part) */
int dm_cache_ready(PyObject *module) { return PyModule_AddType(module, &IndexType); }
