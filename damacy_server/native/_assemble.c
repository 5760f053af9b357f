/*
 * damacy_server.native._assemble: decode read units and copy their boxes into batch slots,
 * with the cast, for a whole decode task in one call that releases the GIL.
 *
 * The Python side (damacy_server/native/__init__.py) hands over:
 *   - the units' encoded bytes (a list of buffers) and, per unit, the codec and sizes;
 *   - an op table (int64): per copy the unit, the sample, and per axis the source start,
 *     the destination start and the extent;
 *   - per sample the destination's address and strides (elements of the output dtype).
 * zstd is reached through the system's libzstd (dlopen, no build-time dependency). Every
 * element conversion follows numpy's rules for the pairs offered here; pairs with other
 * semantics (float to integer, wide integers to bf16/f16 from f64) are left to numpy.
 */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE /* preadv2 */
#include <Python.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../cuda/kernels/convert.cuh"
#define MAX_NDIM 8

/* dtype codes shared with Python */
enum { T_BOOL, T_I1, T_U1, T_I2, T_U2, T_I4, T_U4, T_I8, T_U8, T_F2, T_F4, T_F8, T_BF16, T_COUNT };
static const int ITEMSIZE[T_COUNT] = {1, 1, 1, 2, 2, 4, 4, 8, 8, 2, 4, 8, 2};

enum { CODEC_RAW = 0, CODEC_ZSTD = 1, CODEC_BLOSC = 2 };
enum { OK = 0, E_ZSTD = 1, E_SIZE = 2, E_NOZSTD = 3, E_BLOSC = 4, E_OPS = 5, E_MEMORY = 6 };

/* ---- zstd, found at run time ------------------------------------------------------- */
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
static zstd_content_size_t zstd_content_size;
static zstd_frame_size_t zstd_frame_size;
static zstd_stream_t zstd_stream;
static zstd_reset_t zstd_reset;
static zstd_create_t zstd_create;
static zstd_free_t zstd_free;
static zstd_decompress_t zstd_decompress;
static zstd_iserror_t zstd_iserror;
static zstd_errname_t zstd_errname;

/* one decompression context per thread, kept for the thread's life (they are pool workers) */
static pthread_key_t dctx_key;
static pthread_once_t dctx_once = PTHREAD_ONCE_INIT;
static void free_dctx(void *dctx) {
    if (dctx && zstd_free) zstd_free(dctx);
}
static void make_dctx_key(void) { pthread_key_create(&dctx_key, free_dctx); }
static void *thread_dctx(void) {
    pthread_once(&dctx_once, make_dctx_key);
    void *dctx = pthread_getspecific(dctx_key);
    if (!dctx) {
        dctx = zstd_create();
        if (dctx) pthread_setspecific(dctx_key, dctx);
    }
    return dctx;
}

static int load_zstd(void) {
    void *lib = dlopen("libzstd.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) lib = dlopen("libzstd.so", RTLD_NOW | RTLD_LOCAL);
    if (!lib) return 0;
    zstd_create = (zstd_create_t)dlsym(lib, "ZSTD_createDCtx");
    zstd_free = (zstd_free_t)dlsym(lib, "ZSTD_freeDCtx");
    zstd_decompress = (zstd_decompress_t)dlsym(lib, "ZSTD_decompressDCtx");
    zstd_iserror = (zstd_iserror_t)dlsym(lib, "ZSTD_isError");
    zstd_errname = (zstd_errname_t)dlsym(lib, "ZSTD_getErrorName");
    zstd_stream = (zstd_stream_t)dlsym(lib, "ZSTD_decompressStream");
    zstd_reset = (zstd_reset_t)dlsym(lib, "ZSTD_DCtx_reset");
    zstd_content_size = (zstd_content_size_t)dlsym(lib, "ZSTD_getFrameContentSize");
    zstd_frame_size = (zstd_frame_size_t)dlsym(lib, "ZSTD_findFrameCompressedSize");
    return zstd_create && zstd_free && zstd_decompress && zstd_iserror && zstd_errname && zstd_stream && zstd_reset &&
           zstd_content_size && zstd_frame_size;
}

/* Does this zstd frame carry a content checksum? (Frame_Header_Descriptor bit 2) */
static int zstd_has_checksum(const unsigned char *p, size_t n) {
    return n >= 5 && p[0] == 0x28 && p[1] == 0xb5 && p[2] == 0x2f && p[3] == 0xfd && (p[4] & 0x04);
}

/*
 * Decode at least the first `need` bytes of a frame whose full size is `full`. When the
 * copies only use the start of a chunk, decoding stops after the zstd block that covers it
 * (blocks are at most 128 KiB), which saves work on boxes that end inside a chunk. A frame
 * with a checksum is always decoded whole, so the checksum is always verified.
 * Returns 0 or a zstd error code; *got is set to the bytes produced.
 */
#define ZSTD_BLOCK_MAX (128 * 1024)

static size_t zstd_prefix(void *dctx, char *dst, size_t full, size_t need, const void *src, size_t len, size_t *got,
                          int *whole) {
    /* Streaming costs a copy through zstd's window: worth it only when a whole block can go.
     * A prefix is decoded only from a single, whole frame of the expected size (its block
     * headers are walked, so truncation and broken block sizes are still errors); frames
     * with a checksum are always decoded whole so the checksum is verified. */
    if (need + ZSTD_BLOCK_MAX > full || zstd_has_checksum((const unsigned char *)src, len) ||
        zstd_content_size(src, len) != (unsigned long long)full || zstd_frame_size(src, len) != len) {
        size_t r = zstd_decompress(dctx, dst, full, src, len);
        if (zstd_iserror(r)) return r;
        *got = r;
        *whole = 1; /* decoded whole: it must be all of the chunk */
        return 0;
    }
    size_t r = zstd_reset(dctx, 1 /* ZSTD_reset_session_only */);
    if (zstd_iserror(r)) return r;
    zstd_in in = {src, len, 0};
    zstd_out out = {dst, need, 0};
    while (out.pos < need) {
        r = zstd_stream(dctx, &out, &in);
        if (zstd_iserror(r)) return r;
        if (r == 0 || (in.pos == in.size && out.pos < out.size)) break; /* frame (or input) ended */
    }
    *got = out.pos < need ? out.pos : need;
    return 0;
}

/* ---- element conversions (numpy's rounding) --------------------------------------- */
static inline uint16_t bswap16(uint16_t v) { return (uint16_t)((v >> 8) | (v << 8)); }
static inline uint32_t bswap32(uint32_t v) { return __builtin_bswap32(v); }
static inline uint64_t bswap64(uint64_t v) { return __builtin_bswap64(v); }

/* f16 and bf16 bits as damacy's numeric contract defines them: the same code the GPU
 * kernels run (../cuda/kernels/convert.cuh) */
#define half_to_float f16_to_f32
#define float_to_half f32_to_f16
#define float_to_bf16 f32_to_bf16

/* loads: the element at p as its C type, byte-swapped when the data is big endian */
#define LOAD_INT(T, U, SW)                                                              \
    static inline T load_##T(const char *p, int swap) {                                 \
        U u;                                                                            \
        memcpy(&u, p, sizeof(U));                                                       \
        if (swap) u = SW(u);                                                            \
        T v;                                                                            \
        memcpy(&v, &u, sizeof(T));                                                      \
        return v;                                                                       \
    }
static inline uint8_t noswap8(uint8_t v) { return v; }
LOAD_INT(int8_t, uint8_t, noswap8)
LOAD_INT(uint8_t, uint8_t, noswap8)
LOAD_INT(int16_t, uint16_t, bswap16)
LOAD_INT(uint16_t, uint16_t, bswap16)
LOAD_INT(int32_t, uint32_t, bswap32)
LOAD_INT(uint32_t, uint32_t, bswap32)
LOAD_INT(int64_t, uint64_t, bswap64)
LOAD_INT(uint64_t, uint64_t, bswap64)
LOAD_INT(float, uint32_t, bswap32)
LOAD_INT(double, uint64_t, bswap64)
static inline float load_half(const char *p, int swap) { return half_to_float(load_uint16_t(p, swap)); }
static inline uint8_t load_bool(const char *p, int swap) { (void)swap; return *p != 0; }

/* nm: the sample's normalisation (offset, scale) for the normalising rows (NROW), ignored by
 * the others */
typedef void (*row_fn)(const char *src, char *dst, Py_ssize_t n, int swap, const double *nm);
typedef void (*gather_fn)(const char *src, const int64_t *index, char *dst, Py_ssize_t n, int swap, const double *nm);
typedef void (*scatter_fn)(const char *src, int64_t src_start, const int64_t *src_index, char *dst,
                           const int64_t *dst_index, Py_ssize_t n, int swap, const double *nm);

/* One row: n elements from contiguous src to contiguous dst; the byte-order test is out of
 * the loop so the common case vectorises. _g: element i comes from src[index[i]]; _s: element
 * i goes to dst[dst_index[i]], from src[s0 + i] or src[src_index[i]]. SETUP is a statement
 * run once per call (the normalising rows' constants from nm), VALUE(A, B, x) the output
 * element of a loaded element x. */
#define ROW_FAMILY(NAME, LOAD, SRC_SIZE, DT, SETUP, VALUE, A, B)                       \
    static void __attribute__((unused)) NAME(const char *s, char *d, Py_ssize_t n, int swap, const double *nm) { \
        SETUP;                                                                         \
        DT *out = (DT *)d;                                                             \
        if (swap) {                                                                    \
            for (Py_ssize_t i = 0; i < n; i++) {                                       \
                DT v = VALUE(A, B, LOAD(s + i * (SRC_SIZE), 1));                       \
                memcpy(out + i, &v, sizeof(DT));                                       \
            }                                                                          \
        } else {                                                                       \
            for (Py_ssize_t i = 0; i < n; i++) {                                       \
                DT v = VALUE(A, B, LOAD(s + i * (SRC_SIZE), 0));                       \
                memcpy(out + i, &v, sizeof(DT));                                       \
            }                                                                          \
        }                                                                              \
    }                                                                                  \
    static void __attribute__((unused)) NAME##_g(const char *s, const int64_t *ix, char *d, Py_ssize_t n, int swap, \
                                                 const double *nm) {                   \
        SETUP;                                                                         \
        DT *out = (DT *)d;                                                             \
        for (Py_ssize_t i = 0; i < n; i++) {                                           \
            DT v = VALUE(A, B, LOAD(s + ix[i] * (SRC_SIZE), swap));                    \
            memcpy(out + i, &v, sizeof(DT));                                           \
        }                                                                              \
    }                                                                                  \
    static void __attribute__((unused)) NAME##_s(const char *s, int64_t s0, const int64_t *six, char *d,      \
                                                 const int64_t *dix, Py_ssize_t n, int swap, const double *nm) { \
        SETUP;                                                                         \
        DT *out = (DT *)d;                                                             \
        for (Py_ssize_t i = 0; i < n; i++) {                                           \
            DT v = VALUE(A, B, LOAD(s + (six ? six[i] : s0 + i) * (SRC_SIZE), swap));   \
            memcpy(out + dix[i], &v, sizeof(DT));                                      \
        }                                                                              \
    }

/* the plain rows: numpy's cast (EXPR, then the C conversion to DT) */
#define SETUP_PLAIN (void)nm
#define PLAIN_VALUE(T, EXPR, x) ((T)(EXPR(x)))
#define ROW(NAME, LOAD, SRC_SIZE, DT, EXPR) ROW_FAMILY(NAME, LOAD, SRC_SIZE, DT, SETUP_PLAIN, PLAIN_VALUE, DT, EXPR)

#define AS_IS(v) (v)
#define AS_BOOL(v) ((v) != 0)
#define AS_HALF(v) float_to_half((float)(v))
#define AS_BF16(v) float_to_bf16((float)(v))

/* every source to: f32, f64, bool, integers (integer and bool sources only), f16, bf16 */
#define ROWS_FOR(SRC, LOAD, SIZE)                                                      \
    ROW(SRC##_to_f4, LOAD, SIZE, float, AS_IS)                                         \
    ROW(SRC##_to_f8, LOAD, SIZE, double, AS_IS)                                        \
    ROW(SRC##_to_b1, LOAD, SIZE, uint8_t, AS_BOOL)                                     \
    ROW(SRC##_to_f2, LOAD, SIZE, uint16_t, AS_HALF)                                    \
    ROW(SRC##_to_bf, LOAD, SIZE, uint16_t, AS_BF16)
#define INT_ROWS_FOR(SRC, LOAD, SIZE)                                                  \
    ROWS_FOR(SRC, LOAD, SIZE)                                                          \
    ROW(SRC##_to_i1, LOAD, SIZE, int8_t, AS_IS)                                        \
    ROW(SRC##_to_u1, LOAD, SIZE, uint8_t, AS_IS)                                       \
    ROW(SRC##_to_i2, LOAD, SIZE, int16_t, AS_IS)                                       \
    ROW(SRC##_to_u2, LOAD, SIZE, uint16_t, AS_IS)                                      \
    ROW(SRC##_to_i4, LOAD, SIZE, int32_t, AS_IS)                                       \
    ROW(SRC##_to_u4, LOAD, SIZE, uint32_t, AS_IS)                                      \
    ROW(SRC##_to_i8, LOAD, SIZE, int64_t, AS_IS)                                       \
    ROW(SRC##_to_u8, LOAD, SIZE, uint64_t, AS_IS)

INT_ROWS_FOR(b1, load_bool, 1)
INT_ROWS_FOR(i1, load_int8_t, 1)
INT_ROWS_FOR(u1, load_uint8_t, 1)
INT_ROWS_FOR(i2, load_int16_t, 2)
INT_ROWS_FOR(u2, load_uint16_t, 2)
INT_ROWS_FOR(i4, load_int32_t, 4)
INT_ROWS_FOR(u4, load_uint32_t, 4)
INT_ROWS_FOR(i8, load_int64_t, 8)
INT_ROWS_FOR(u8, load_uint64_t, 8)
ROWS_FOR(f2, load_half, 2)
ROWS_FOR(f4, load_float, 4)
ROWS_FOR(f8, load_double, 8)

/* Normalising rows: (x - offset) * scale in f32 (f64 for f64 outputs), as convert.cuh's
 * normalize_value defines it: the element, the offset and the scale each converted to that
 * type (rounded once), each operation rounded once, then STORE to the output type. To f32:
 * integers and f32 by a C conversion (in range, rounded once), f64 by convert.cuh's
 * f64_to_f32 (a C conversion of an out-of-range double is undefined). */
#define TO_F32(v) _Generic((v), double: f64_to_f32, default: to_f32_plain)(v)
static inline float to_f32_plain(float v) { return v; }
#define TO_F64(v) ((double)(v))
#define SETUP_F32 const float o = TO_F32(nm[0]), k = TO_F32(nm[1])
#define SETUP_F64 const double o = TO_F64(nm[0]), k = TO_F64(nm[1])
#define F32_VALUE(STORE, unused, x) STORE(DAMACY_FMUL(DAMACY_FSUB(TO_F32(x), o), k))
#define F64_VALUE(STORE, unused, x) STORE(DAMACY_DMUL(DAMACY_DSUB(TO_F64(x), o), k))
#define KEEP(v) (v)
#define NROWS_FOR(SRC, LOAD, SIZE)                                                     \
    ROW_FAMILY(SRC##_norm_f4, LOAD, SIZE, float, SETUP_F32, F32_VALUE, KEEP, _)        \
    ROW_FAMILY(SRC##_norm_f2, LOAD, SIZE, uint16_t, SETUP_F32, F32_VALUE, float_to_half, _) \
    ROW_FAMILY(SRC##_norm_bf, LOAD, SIZE, uint16_t, SETUP_F32, F32_VALUE, float_to_bf16, _) \
    ROW_FAMILY(SRC##_norm_f8, LOAD, SIZE, double, SETUP_F64, F64_VALUE, KEEP, _)
NROWS_FOR(b1, load_bool, 1)
NROWS_FOR(i1, load_int8_t, 1)
NROWS_FOR(u1, load_uint8_t, 1)
NROWS_FOR(i2, load_int16_t, 2)
NROWS_FOR(u2, load_uint16_t, 2)
NROWS_FOR(i4, load_int32_t, 4)
NROWS_FOR(u4, load_uint32_t, 4)
NROWS_FOR(i8, load_int64_t, 8)
NROWS_FOR(u8, load_uint64_t, 8)
NROWS_FOR(f2, load_half, 2)
NROWS_FOR(f4, load_float, 4)
NROWS_FOR(f8, load_double, 8)

/* [src][dst]: a row copy, a gather from an index list and a scatter to one; NONE where
 * numpy's semantics differ or are undefined (left to numpy) */
typedef struct {
    row_fn row;
    gather_fn gather;
    scatter_fn scatter;
} conv_t;
#define K(S, D) {S##_to_##D, S##_to_##D##_g, S##_to_##D##_s}
#define NONE {NULL, NULL, NULL}
#define INT_TABLE(S) \
    {K(S, b1), K(S, i1), K(S, u1), K(S, i2), K(S, u2), K(S, i4), K(S, u4), K(S, i8), K(S, u8), K(S, f2), K(S, f4), K(S, f8), K(S, bf)}
static conv_t CONV[T_COUNT][T_COUNT] = {
    /* bool: numpy copies a bool's byte to bool and ml_dtypes takes it as a number for bf16 */
    {NONE, K(b1, i1), K(b1, u1), K(b1, i2), K(b1, u2), K(b1, i4), K(b1, u4), K(b1, i8), K(b1, u8), K(b1, f2), K(b1, f4), K(b1, f8), NONE},
    INT_TABLE(i1), INT_TABLE(u1), INT_TABLE(i2), INT_TABLE(u2),
    /* wide integers: not to bf16 (ml_dtypes may round differently past 2**24) */
    {K(i4, b1), K(i4, i1), K(i4, u1), K(i4, i2), K(i4, u2), K(i4, i4), K(i4, u4), K(i4, i8), K(i4, u8), K(i4, f2), K(i4, f4), K(i4, f8), NONE},
    {K(u4, b1), K(u4, i1), K(u4, u1), K(u4, i2), K(u4, u2), K(u4, i4), K(u4, u4), K(u4, i8), K(u4, u8), K(u4, f2), K(u4, f4), K(u4, f8), NONE},
    {K(i8, b1), K(i8, i1), K(i8, u1), K(i8, i2), K(i8, u2), K(i8, i4), K(i8, u4), K(i8, i8), K(i8, u8), K(i8, f2), K(i8, f4), K(i8, f8), NONE},
    {K(u8, b1), K(u8, i1), K(u8, u1), K(u8, i2), K(u8, u2), K(u8, i4), K(u8, u4), K(u8, i8), K(u8, u8), K(u8, f2), K(u8, f4), K(u8, f8), NONE},
    /* floats: not to integers (numpy's results there are platform-defined) */
    /* f16 to f64 through f32 would quieten signalling NaNs numpy keeps */
    {K(f2, b1), NONE, NONE, NONE, NONE, NONE, NONE, NONE, NONE, K(f2, f2), K(f2, f4), NONE, K(f2, bf)},
    /* f64 to f16/bf16 would round twice through f32 */
    {K(f4, b1), NONE, NONE, NONE, NONE, NONE, NONE, NONE, NONE, K(f4, f2), K(f4, f4), K(f4, f8), K(f4, bf)},
    {K(f8, b1), NONE, NONE, NONE, NONE, NONE, NONE, NONE, NONE, NONE, K(f8, f4), K(f8, f8), NONE},
};

/* [src]: the normalising conversions to each float output (any other output: NONE) */
#define NK(S, D) {S##_norm_##D, S##_norm_##D##_g, S##_norm_##D##_s}
#define NORM_TABLE(S) \
    {NONE, NONE, NONE, NONE, NONE, NONE, NONE, NONE, NONE, NK(S, f2), NK(S, f4), NK(S, f8), NK(S, bf)}
static conv_t NCONV[T_COUNT][T_COUNT] = {
    NORM_TABLE(b1), NORM_TABLE(i1), NORM_TABLE(u1), NORM_TABLE(i2), NORM_TABLE(u2), NORM_TABLE(i4), NORM_TABLE(u4),
    NORM_TABLE(i8), NORM_TABLE(u8), NORM_TABLE(f2), NORM_TABLE(f4), NORM_TABLE(f8),
};

/* ---- the task ----------------------------------------------------------------------- */
typedef struct {
    const char *src;  /* encoded bytes */
    Py_ssize_t src_len;
} unit_in;

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
static void copy_box(const char *chunk, const int64_t *unit_shape, int ndim, int src_size, char *dst_base,
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

static int zstd_ok = -1;

/* ---- Blosc 1, through the C-Blosc that numcodecs carries (its symbols are exported) ---- */
typedef int (*blosc_getitem_t)(const void *src, int start, int nitems, void *dest);
typedef int (*blosc_decompress_t)(const void *src, void *dest, size_t destsize, int numinternalthreads);
static blosc_getitem_t blosc_getitem_fn;
static blosc_decompress_t blosc_decompress_fn;

/* Check the frame's structure where blosc_getitem would read it unchecked: the header, the
 * block table and every stream of the blocks that hold bytes [b0, b1). */
static int blosc_frame_ok(const unsigned char *p, Py_ssize_t len, Py_ssize_t nbytes_expected, int64_t b0, int64_t b1) {
    if (len < 16) return 0;
    int32_t flags = p[2], typesize = p[3];
    int32_t nbytes, blocksize, cbytes;
    memcpy(&nbytes, p + 4, 4);
    memcpy(&blocksize, p + 8, 4);
    memcpy(&cbytes, p + 12, 4);
    if (cbytes != len || nbytes != nbytes_expected || typesize <= 0) return 0;
    if (flags & 0x02) return 16 + (Py_ssize_t)nbytes <= len; /* stored as it is */
    if (blocksize <= 0) return 0;
    int64_t nblocks = ((int64_t)nbytes + blocksize - 1) / blocksize;
    int64_t table_end = 16 + 4 * nblocks;
    if (table_end > len) return 0;
    int dont_split = (flags & 0x10) != 0;
    for (int64_t j = b0 / blocksize; j < nblocks && j * blocksize < b1; j++) {
        int32_t start;
        memcpy(&start, p + 16 + 4 * j, 4);
        int64_t bsize = nbytes - j * blocksize < blocksize ? nbytes - j * blocksize : blocksize;
        int leftover = bsize < blocksize;
        int split = !dont_split && typesize <= 16 && blocksize / typesize >= 128 && !leftover;
        int64_t pos = start;
        for (int k = 0; k < (split ? typesize : 1); k++) {
            if (pos < table_end || pos + 4 > len) return 0;
            int32_t size;
            memcpy(&size, p + pos, 4);
            pos += 4;
            if (size < 0 || pos + size > len) return 0;
            pos += size;
        }
    }
    return 1;
}

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

static void task_release(task_t *t) {
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
static int task_prepare(task_t *t) {
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
        !(CONV[t->src_type][t->dst_type].row || NCONV[t->src_type][t->dst_type].row) || t->ndim > MAX_NDIM) {
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
        if (tg[1 + 2 * t->ndim] && !NCONV[t->src_type][t->dst_type].row) {
            PyErr_SetString(PyExc_ValueError, "normalisation writes float outputs only");
            return -1;
        }
        if (tg[0] && !tg[1 + 2 * t->ndim] && !CONV[t->src_type][t->dst_type].row) {
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
    if (t->codec == CODEC_ZSTD && zstd_ok < 0) zstd_ok = load_zstd();
    return 0;
}

/* Each unit's bytes in data, which starts at data_offset of the object (a span reaching past
 * the end is cut there, one of length -1 reaches to the end). */
static void task_locate(task_t *t, const char *data, Py_ssize_t data_len, long long data_offset) {
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

/* Without the GIL: decode every unit and make its copies. */
static void task_assemble(task_t *t) {
    unit_in *views = t->views;
    int *status = t->status;
    size_t *err_codes = t->err_codes;
    const int64_t *ops = (const int64_t *)t->ops.buf;
    const int64_t *targets = (const int64_t *)t->targets.buf;
    const int64_t *unit_shape = (const int64_t *)t->shape.buf;
    const int64_t *pool = (const int64_t *)t->pool.buf;
    const int64_t pool_len = t->pool.len / 8;
    const int ndim = t->ndim, codec = t->codec, swap = t->swap;
    const Py_ssize_t n_units = t->n_units, n_ops = t->n_ops, n_targets = t->n_targets, width = t->width;
    const Py_ssize_t decoded_nbytes = t->decoded_nbytes;
    const int64_t base = t->base;
    const int64_t *keep = t->keep.len ? (const int64_t *)t->keep.buf : NULL;
    long long encoded = 0, elements = 0;
    const int src_type = t->src_type, dst_type = t->dst_type;
    row_fn row = CONV[t->src_type][t->dst_type].row;
    gather_fn gather = CONV[t->src_type][t->dst_type].gather;
    scatter_fn scatter = CONV[t->src_type][t->dst_type].scatter;
    int src_size = ITEMSIZE[t->src_type], dst_size = ITEMSIZE[t->dst_type];
    char *scratch = NULL;
    void *dctx = NULL;
    if (codec == CODEC_ZSTD && zstd_ok) {
        scratch = malloc((size_t)(decoded_nbytes ? decoded_nbytes : 1));
        dctx = thread_dctx();
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
        /* the bytes this unit's copies read: [first, need); every op is checked to stay
         * inside the unit (and its index lists inside the pool) */
        size_t need = 0, first = (size_t)decoded_nbytes;
        for (Py_ssize_t q = op; q < n_ops && ops[q * width] - base == u; q++) {
            const int64_t *o = ops + q * width;
            int64_t lo = 0, last = 0, empty = 0;
            /* the target: a sample with a view, whose shape bounds the destination side */
            const int64_t *tg = (o[1] >= 0 && o[1] < n_targets) ? targets + o[1] * TARGET_WIDTH(ndim) : NULL;
            if (!tg || tg[0] == 0) {
                status[u] = E_OPS;
                break;
            }
            for (int a = 0; a < ndim; a++) {
                int64_t st = o[2 + a], dst = o[2 + ndim + a], ext = o[2 + 2 * ndim + a], amin, amax;
                if (ext <= 0) {
                    empty = 1;
                    break;
                }
                /* source: a range inside the unit, or an index list inside the pool whose
                 * values lie inside the unit */
                if (!span_ok(st, ext, unit_shape[a], pool, pool_len, &amin, &amax) ||
                    !span_ok(dst, ext, tg[1 + ndim + a], pool, pool_len, NULL, NULL)) {
                    status[u] = E_OPS;
                    break;
                }
                lo += amin * unit_strides[a];
                last += amax * unit_strides[a];
            }
            if (empty || status[u] != OK) continue;
            size_t end = (size_t)(last + 1) * (size_t)src_size, begin = (size_t)lo * (size_t)src_size;
            if (end > need) need = end;
            if (begin < first) first = begin;
        }
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
            if (!blosc_getitem_fn || !blosc_decompress_fn) {
                status[u] = E_NOZSTD;
            } else if (views[u].src_len < 16 || !blosc_frame_ok(p, views[u].src_len, decoded_nbytes, 0, decoded_nbytes) ||
                       (r = blosc_decompress_fn(p, kept, (size_t)decoded_nbytes, 1)) != decoded_nbytes) {
                status[u] = E_BLOSC;
                err_codes[u] = (size_t)(r < 0 ? -r : r);
            }
            chunk = kept;
        } else if (kept && codec == CODEC_ZSTD) {
            if (!zstd_ok) {
                status[u] = E_NOZSTD;
            } else if (!dctx) {
                status[u] = E_MEMORY;
            } else {
                size_t r = zstd_decompress(dctx, kept, (size_t)decoded_nbytes, views[u].src, (size_t)views[u].src_len);
                if (zstd_iserror(r)) {
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
            if (!blosc_getitem_fn || !blosc_decompress_fn) {
                status[u] = E_NOZSTD;
            } else if (!scratch) {
                status[u] = E_MEMORY;
            } else if (ts == 0 || !blosc_frame_ok(p, views[u].src_len, decoded_nbytes, 0, 0)) {
                status[u] = E_BLOSC;
            } else if (need > first) {
                int64_t start = (int64_t)first / ts, stop = ((int64_t)need + ts - 1) / ts;
                int r;
                if (decoded_nbytes % ts != 0 || stop * ts > decoded_nbytes) {
                    /* items do not tile the chunk: decode it whole */
                    r = blosc_frame_ok(p, views[u].src_len, decoded_nbytes, 0, decoded_nbytes)
                            ? blosc_decompress_fn(p, scratch, (size_t)decoded_nbytes, 1)
                            : -1;
                    if (r != decoded_nbytes) {
                        status[u] = E_BLOSC;
                        err_codes[u] = (size_t)(r < 0 ? -r : r);
                    }
                } else if (!blosc_frame_ok(p, views[u].src_len, decoded_nbytes, start * ts, stop * ts)) {
                    status[u] = E_BLOSC;
                } else {
                    r = blosc_getitem_fn(p, (int)start, (int)(stop - start), scratch + start * ts);
                    if (r != (stop - start) * ts) {
                        status[u] = E_BLOSC;
                        err_codes[u] = (size_t)(r < 0 ? -r : r);
                    }
                }
                chunk = scratch;
            }
        } else if (codec == CODEC_ZSTD) {
            if (!zstd_ok) {
                status[u] = E_NOZSTD;
            } else if (!scratch || !dctx) {
                status[u] = E_MEMORY;
            } else if (need > 0) {
                size_t got = 0;
                int whole = 0;
                size_t r = zstd_prefix(dctx, scratch, (size_t)decoded_nbytes, need, views[u].src, (size_t)views[u].src_len, &got,
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
            if (status[u] == OK) {
                const int64_t *t = targets + o[1] * TARGET_WIDTH(ndim); /* checked above */
                if (t[1 + 2 * ndim]) {
                    const conv_t *nc = &NCONV[src_type][dst_type]; /* checked in task_prepare */
                    double nm[2];
                    memcpy(nm, t + 2 + 2 * ndim, sizeof nm);
                    copy_box(chunk, unit_shape, ndim, src_size, (char *)(intptr_t)t[0], t + 1, dst_size, o + 2,
                             o + 2 + ndim, o + 2 + 2 * ndim, pool, nc->row, nc->gather, nc->scatter, swap, nm);
                } else {
                    copy_box(chunk, unit_shape, ndim, src_size, (char *)(intptr_t)t[0], t + 1, dst_size, o + 2,
                             o + 2 + ndim, o + 2 + 2 * ndim, pool, row, gather, scatter, swap, NULL);
                }
                long long n = 1;
                for (int a = 0; a < ndim; a++) n *= o[2 + 2 * ndim + a] > 0 ? o[2 + 2 * ndim + a] : 0;
                elements += n;
            }
            op++;
        }
        if (status[u] == OK) encoded += views[u].src_len;
    }
    free(scratch);
    t->encoded = encoded;
    t->elements = elements;
}

/* With the GIL: (unit, status, detail) for each unit that failed; detail is the zstd error
 * name (E_ZSTD), the bytes decoded (E_SIZE), blosc's return code (E_BLOSC) or None. The
 * caller words the message (native/__init__.py, describe). */
static PyObject *task_failures(task_t *t) {
    Py_ssize_t n_units = t->n_units;
    int *status = t->status;
    size_t *err_codes = t->err_codes;
    PyObject *result = PyList_New(0);
    if (!result) return NULL;
    for (Py_ssize_t u = 0; u < n_units; u++) {
        if (status[u] == OK) continue;
        PyObject *item;
        if (status[u] == E_ZSTD)
            item = Py_BuildValue("(nis)", u, status[u], zstd_errname(err_codes[u]));
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

/* Assemble a prepared, located task without the GIL; (failures, encoded, elements) or NULL. */
static PyObject *task_run(task_t *t) {
    Py_BEGIN_ALLOW_THREADS;
    task_assemble(t);
    Py_END_ALLOW_THREADS;
    PyObject *failures = task_failures(t);
    return failures ? Py_BuildValue("(NLL)", failures, t->encoded, t->elements) : NULL;
}

#define TASK_FORMAT "y*y*Ly*y*iiiiny*|y*"
#define TASK_ARGS(t) &(t).spans, &(t).ops, &(t).base, &(t).targets, &(t).shape, &(t).src_type, &(t).dst_type, &(t).swap, \
                     &(t).codec, &(t).decoded_nbytes, &(t).pool, &(t).keep

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
static PyObject *run(PyObject *self, PyObject *args) {
    Py_buffer data_buf;
    long long data_offset;
    task_t t;
    memset(&t, 0, sizeof t);
    if (!PyArg_ParseTuple(args, "y*L" TASK_FORMAT, &data_buf, &data_offset, TASK_ARGS(t))) return NULL;
    PyObject *result = NULL;
    if (data_offset < 0) {
        PyErr_SetString(PyExc_ValueError, "a negative data offset");
    } else if (task_prepare(&t) == 0) {
        task_locate(&t, (const char *)data_buf.buf, data_buf.len, data_offset);
        result = task_run(&t);
    }
    task_release(&t);
    PyBuffer_Release(&data_buf);
    return result;
}

/*
 * run_decoded(sources, <the task arguments of run>): as run, for units already decoded (chunk
 * cache entries): sources is an int64 array (n_units) of the addresses of each unit's
 * decoded_nbytes bytes in the stored dtype; spans are not read and codec is ignored.
 */
static PyObject *run_decoded(PyObject *self, PyObject *args) {
    Py_buffer sources;
    task_t t;
    memset(&t, 0, sizeof t);
    if (!PyArg_ParseTuple(args, "y*" TASK_FORMAT, &sources, TASK_ARGS(t))) return NULL;
    PyObject *result = NULL;
    t.codec = CODEC_RAW;
    if (task_prepare(&t) == 0) {
        if (sources.len != t.n_units * 8 || t.keep.len) {
            PyErr_SetString(PyExc_ValueError, "run_decoded needs one source address per unit and nothing to keep");
        } else {
            const int64_t *src = (const int64_t *)sources.buf;
            for (Py_ssize_t u = 0; u < t.n_units; u++) {
                t.views[u].src = (const char *)(intptr_t)src[u];
                t.views[u].src_len = src[u] ? t.decoded_nbytes : 0;
            }
            result = task_run(&t);
        }
    }
    task_release(&t);
    PyBuffer_Release(&sources);
    return result;
}

/* ---- opening files inside the roots ------------------------------------------------
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

/* Open path for reading as FileStore.open does: a descriptor (the file's size in *size), or
 * -1 with *code set (an errno, -1 for not a regular file, -3 for outside the roots). */
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
static PyObject *py_open_checked(PyObject *self, PyObject *args) {
    PyObject *path_obj;
    int flags, code = 0, fd;
    long long size = 0;
    const char *roots = NULL;
    Py_ssize_t roots_len = 0;
    if (!PyArg_ParseTuple(args, "O&iz#", PyUnicode_FSConverter, &path_obj, &flags, &roots, &roots_len)) return NULL;
    const char *path = PyBytes_AS_STRING(path_obj);
    Py_BEGIN_ALLOW_THREADS;
    fd = open_checked(path, flags, roots, (size_t)roots_len, &code, &size);
    Py_END_ALLOW_THREADS;
    Py_DECREF(path_obj);
    return Py_BuildValue("(iiL)", fd, code, size);
}

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
#define RUN_FILE_MAX (16 << 20) /* the largest read run_file makes (module constant RUN_FILE_MAX) */

static PyObject *run_file(PyObject *self, PyObject *args) {
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
    if (task_prepare(&t) == 0) {
        const char *path = PyBytes_AS_STRING(path_obj);
        Py_BEGIN_ALLOW_THREADS;
        code = -1;
#ifdef RWF_NOWAIT
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        char *buf = NULL;
        long long size = -1;
        int fd = open_checked(path, flags, roots, (size_t)roots_len, &code, &size);
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
            task_locate(&t, buf, (Py_ssize_t)length, offset);
            task_assemble(&t);
        }
        free(buf);
#endif
        Py_END_ALLOW_THREADS;
        if (code == 0) {
            PyObject *failures = task_failures(&t);
            if (failures) result = Py_BuildValue("(iNLLLL)", 0, failures, read_ns, length, t.encoded, t.elements);
        } else {
            result = Py_BuildValue("(iOLLLL)", code, Py_None, read_ns, 0LL, 0LL, 0LL);
        }
    }
    task_release(&t);
    Py_DECREF(path_obj);
    return result;
}

/* supports(src, dst, normalized=0): whether the cast (or, normalized, the normalising one) is offered */
static PyObject *supports(PyObject *self, PyObject *args) {
    int src_type, dst_type, normalized = 0;
    if (!PyArg_ParseTuple(args, "ii|p", &src_type, &dst_type, &normalized)) return NULL;
    int ok = src_type >= 0 && src_type < T_COUNT && dst_type >= 0 && dst_type < T_COUNT &&
             (normalized ? NCONV[src_type][dst_type].row : CONV[src_type][dst_type].row);
    return PyBool_FromLong(ok);
}

static PyObject *has_zstd(PyObject *self, PyObject *noargs) {
    if (zstd_ok < 0) zstd_ok = load_zstd();
    return PyBool_FromLong(zstd_ok);
}

/* use_blosc(path): take blosc_getitem from the (already loaded) library at path */
static PyObject *use_blosc(PyObject *self, PyObject *args) {
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path)) return NULL;
    if (!blosc_getitem_fn) {
        void *lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
        if (!lib) lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (lib) {
            blosc_decompress_fn = (blosc_decompress_t)dlsym(lib, "blosc_decompress_ctx");
            blosc_getitem_fn = (blosc_getitem_t)dlsym(lib, "blosc_getitem");
        }
    }
    return PyBool_FromLong(blosc_getitem_fn != NULL && blosc_decompress_fn != NULL);
}

/* check_lz4(block, size) -> None, or why the LZ4 block (raw, as Blosc stores a stream) is not
 * one that decodes to exactly `size` bytes: every literal run and match inside the input and
 * the output, every match offset inside what is already decoded, the input ending with a
 * literal run. nvCOMP's behaviour on corrupt input is undefined, so its LZ4 streams are
 * checked here first. The Python twin is damacy_server.cuda.nvcomp.walk_lz4_block. */
static const char *lz4_walk(const uint8_t *in, size_t n, size_t size) {
    size_t i = 0, out = 0;
    if (n == 0)
        return "an empty block";
    for (;;) {
        uint8_t token = in[i++];
        size_t lit = token >> 4;
        if (lit == 15) {
            uint8_t b;
            do {
                if (i >= n)
                    return "a literal length runs past the block";
                b = in[i++];
                lit += b;
            } while (b == 255);
        }
        if (lit > n - i)
            return "literals run past the block";
        if (lit > size - out)
            return "the block decodes to more bytes than the chunk holds";
        i += lit;
        out += lit;
        if (i == n)
            break; /* the last sequence: literals only */
        if (n - i < 2)
            return "a truncated match offset";
        size_t offset = (size_t)in[i] | ((size_t)in[i + 1] << 8);
        i += 2;
        if (offset == 0 || offset > out)
            return "a match refers before the start of the output";
        size_t match = token & 15;
        if (match == 15) {
            uint8_t b;
            do {
                if (i >= n)
                    return "a match length runs past the block";
                b = in[i++];
                match += b;
            } while (b == 255);
        }
        match += 4;
        if (match > size - out)
            return "the block decodes to more bytes than the chunk holds";
        out += match;
        if (i >= n)
            return "the block ends with a match, not literals";
    }
    return out == size ? NULL : "the block decodes to fewer bytes than the chunk holds";
}

static PyObject *check_lz4(PyObject *self, PyObject *args) {
    Py_buffer block;
    Py_ssize_t size;
    if (!PyArg_ParseTuple(args, "y*n", &block, &size))
        return NULL;
    const char *why = size < 0 ? "a negative size" : lz4_walk((const uint8_t *)block.buf, (size_t)block.len, (size_t)size);
    PyBuffer_Release(&block);
    if (why == NULL)
        Py_RETURN_NONE;
    return PyUnicode_FromString(why);
}

static PyMethodDef methods[] = {
    {"run", run, METH_VARARGS, "Decode units and copy their boxes into the targets, without the GIL."},
    {"run_decoded", run_decoded, METH_VARARGS, "Copy the boxes of units already decoded into the targets, without the GIL."},
    {"run_file", run_file, METH_VARARGS, "Read a byte range from the page cache, then run, without the GIL."},
    {"supports", supports, METH_VARARGS, "Whether the cast (or with normalized=True the normalising one) from one dtype code to another is offered."},
    {"check_lz4", check_lz4, METH_VARARGS, "None, or why an LZ4 block does not decode to exactly the given size."},
    {"has_zstd", has_zstd, METH_NOARGS, "Whether libzstd could be loaded."},
    {"use_blosc", use_blosc, METH_VARARGS, "Take blosc_getitem from the C-Blosc library at the given path."},
    {"open_checked", py_open_checked, METH_VARARGS, "Open a regular file for reading, inside the roots when given."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_assemble", NULL, -1, methods};

PyMODINIT_FUNC PyInit__assemble(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "RUN_FILE_MAX", RUN_FILE_MAX) < 0) Py_CLEAR(m);
    return m;
}
