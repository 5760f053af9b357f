/* Element conversions under damacy's numeric contract (../cuda/kernels/convert.cuh, whose
 * code the GPU kernels run: f16 and bf16 bits, integers clamped to the output's range): for
 * every pair offered, a row copy, a gather from an index list and a scatter to one, plain
 * or normalising, and the tables that name them. */
#include "native.h"

#include <string.h>

#include "../cuda/kernels/convert.cuh"

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

/* the plain rows: EXPR, then the C conversion to DT (for integer outputs of an integer
 * EXPR's result is in DT's range; for float outputs from integers and f32, a conversion
 * rounded once to nearest even) */
#define SETUP_PLAIN (void)nm
#define PLAIN_VALUE(T, EXPR, x) ((T)(EXPR(x)))
#define ROW(NAME, LOAD, SRC_SIZE, DT, EXPR) ROW_FAMILY(NAME, LOAD, SRC_SIZE, DT, SETUP_PLAIN, PLAIN_VALUE, DT, EXPR)

#define AS_IS(v) (v)
#define AS_BOOL(v) ((v) != 0)
#define AS_HALF(v) float_to_half((float)(v))
#define AS_BF16(v) float_to_bf16((float)(v)) /* through f32: from 32- and 64-bit integers two roundings */

/* integer to integer: x (of the source's C type T, the range of type S, signed or not: CLAMP)
 * clamped to type D's range in T's own arithmetic (convert.cuh's DAMACY_CLAMP_SIGNED and
 * _UNSIGNED: at most a max and a min, which vectorise; none where S's range is within D's) */
#define CLAMP_FN(SRC, T, S, CLAMP, DST, D)                                             \
    static inline T SRC##_clamp_##DST(T x) { return CLAMP(T, x, S, D); }

/* every source to: f32, f64, bool, integers (integer and bool sources only), f16, bf16 */
#define ROWS_FOR(SRC, LOAD, SIZE)                                                      \
    ROW(SRC##_to_f4, LOAD, SIZE, float, AS_IS)                                         \
    ROW(SRC##_to_f8, LOAD, SIZE, double, AS_IS)                                        \
    ROW(SRC##_to_b1, LOAD, SIZE, uint8_t, AS_BOOL)                                     \
    ROW(SRC##_to_f2, LOAD, SIZE, uint16_t, AS_HALF)                                    \
    ROW(SRC##_to_bf, LOAD, SIZE, uint16_t, AS_BF16)
#define INT_ROW(SRC, T, S, CLAMP, LOAD, SIZE, DST, DT, D)                              \
    CLAMP_FN(SRC, T, S, CLAMP, DST, D)                                                 \
    ROW(SRC##_to_##DST, LOAD, SIZE, DT, SRC##_clamp_##DST)
#define INT_ROWS_FOR(SRC, T, S, CLAMP, LOAD, SIZE)                                     \
    ROWS_FOR(SRC, LOAD, SIZE)                                                          \
    INT_ROW(SRC, T, S, CLAMP, LOAD, SIZE, i1, int8_t, I1)                              \
    INT_ROW(SRC, T, S, CLAMP, LOAD, SIZE, u1, uint8_t, U1)                             \
    INT_ROW(SRC, T, S, CLAMP, LOAD, SIZE, i2, int16_t, I2)                             \
    INT_ROW(SRC, T, S, CLAMP, LOAD, SIZE, u2, uint16_t, U2)                            \
    INT_ROW(SRC, T, S, CLAMP, LOAD, SIZE, i4, int32_t, I4)                             \
    INT_ROW(SRC, T, S, CLAMP, LOAD, SIZE, u4, uint32_t, U4)                            \
    INT_ROW(SRC, T, S, CLAMP, LOAD, SIZE, i8, int64_t, I8)                             \
    INT_ROW(SRC, T, S, CLAMP, LOAD, SIZE, u8, uint64_t, U8)

INT_ROWS_FOR(b1, uint8_t, B1, DAMACY_CLAMP_UNSIGNED, load_bool, 1)
INT_ROWS_FOR(i1, int8_t, I1, DAMACY_CLAMP_SIGNED, load_int8_t, 1)
INT_ROWS_FOR(u1, uint8_t, U1, DAMACY_CLAMP_UNSIGNED, load_uint8_t, 1)
INT_ROWS_FOR(i2, int16_t, I2, DAMACY_CLAMP_SIGNED, load_int16_t, 2)
INT_ROWS_FOR(u2, uint16_t, U2, DAMACY_CLAMP_UNSIGNED, load_uint16_t, 2)
INT_ROWS_FOR(i4, int32_t, I4, DAMACY_CLAMP_SIGNED, load_int32_t, 4)
INT_ROWS_FOR(u4, uint32_t, U4, DAMACY_CLAMP_UNSIGNED, load_uint32_t, 4)
INT_ROWS_FOR(i8, int64_t, I8, DAMACY_CLAMP_SIGNED, load_int64_t, 8)
INT_ROWS_FOR(u8, uint64_t, U8, DAMACY_CLAMP_UNSIGNED, load_uint64_t, 8)
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

/* [src][dst]: a row copy, a gather from an index list and a scatter to one; NONE: left to
 * the numpy path (damacy_server/decode/contract.py, the same rules) */
#define K(S, D) {S##_to_##D, S##_to_##D##_g, S##_to_##D##_s}
#define NONE {NULL, NULL, NULL}
#define INT_TABLE(S) \
    {K(S, b1), K(S, i1), K(S, u1), K(S, i2), K(S, u2), K(S, i4), K(S, u4), K(S, i8), K(S, u8), K(S, f2), K(S, f4), K(S, f8), K(S, bf)}
const conv_t dm_conv[T_COUNT][T_COUNT] = {
    /* bool: numpy copies a bool's byte to bool and ml_dtypes takes it as a number for bf16 */
    {NONE, K(b1, i1), K(b1, u1), K(b1, i2), K(b1, u2), K(b1, i4), K(b1, u4), K(b1, i8), K(b1, u8), K(b1, f2), K(b1, f4), K(b1, f8), NONE},
    INT_TABLE(i1), INT_TABLE(u1), INT_TABLE(i2), INT_TABLE(u2), INT_TABLE(i4), INT_TABLE(u4), INT_TABLE(i8), INT_TABLE(u8),
    /* floats: not to integers (truncated and saturated by the numpy path: a C conversion of
     * an out-of-range float is undefined) */
    /* f16 to f64 through f32 would quieten signalling NaNs numpy keeps */
    {K(f2, b1), NONE, NONE, NONE, NONE, NONE, NONE, NONE, NONE, K(f2, f2), K(f2, f4), NONE, K(f2, bf)},
    /* f64 to f16/bf16 would round twice through f32 (the contract rounds it once) */
    {K(f4, b1), NONE, NONE, NONE, NONE, NONE, NONE, NONE, NONE, K(f4, f2), K(f4, f4), K(f4, f8), K(f4, bf)},
    {K(f8, b1), NONE, NONE, NONE, NONE, NONE, NONE, NONE, NONE, NONE, K(f8, f4), K(f8, f8), NONE},
};

/* [src]: the normalising conversions to each float output (any other output: NONE) */
#define NK(S, D) {S##_norm_##D, S##_norm_##D##_g, S##_norm_##D##_s}
#define NORM_TABLE(S) \
    {NONE, NONE, NONE, NONE, NONE, NONE, NONE, NONE, NONE, NK(S, f2), NK(S, f4), NK(S, f8), NK(S, bf)}
const conv_t dm_nconv[T_COUNT][T_COUNT] = {
    NORM_TABLE(b1), NORM_TABLE(i1), NORM_TABLE(u1), NORM_TABLE(i2), NORM_TABLE(u2), NORM_TABLE(i4), NORM_TABLE(u4),
    NORM_TABLE(i8), NORM_TABLE(u8), NORM_TABLE(f2), NORM_TABLE(f4), NORM_TABLE(f8),
};
