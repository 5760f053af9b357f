/*
 * damacy's numeric contract: the value an element of one dtype becomes in another, the same
 * on every path (numpy reference: damacy_server/contract.py; CPU native loop; GPU).
 *
 * The rules for the sources and outputs of damacy's API (integers, f16 and f32 into the
 * integers, f32 and bf16):
 *
 *   integer -> integer values in range are kept; out of range clamped to the type's range
 *                      (a negative to 0 for an unsigned type), in integer arithmetic, never
 *                      through a float (numpy's astype wraps instead).
 *   float -> integer   truncated toward zero, then clamped to the type's range; NaN -> 0;
 *                      +inf -> the maximum, -inf -> the minimum (0 for an unsigned type).
 *                      What CUDA's saturating conversions do; numpy's is platform-defined.
 *   integer, f16 -> f32 rounded to nearest, ties to even (f32 kept as it is).
 *   -> bf16            through f32: the value rounded to f32 as above, then to bf16 to
 *                      nearest even (for 32- and 64-bit integers two roundings; ml_dtypes
 *                      rounds those once, through f64); every NaN becomes the quiet NaN
 *                      0x7fc0 with its sign.
 *
 * And for the dtypes damacy reads or writes beyond those (f64 sources, f16, f64 and bool
 * outputs), as numpy does where it defines the result:
 *
 *   f64 -> integer     as float -> integer above.
 *   f64 -> bf16        rounded once, to nearest even (not through f32: ml_dtypes rounds it
 *                      twice).
 *   f64 -> f32         rounded to nearest even; beyond the range -> +-inf; NaN keeps its
 *                      sign and its top 22 payload bits and becomes quiet.
 *   integer -> f64     rounded once, to nearest even.
 *   f32/f16 -> f64     exact; a NaN from f32 becomes quiet, a NaN from f16 keeps its bits.
 *   -> f16             rounded once to nearest even (also from f64 and integers, which
 *                      numpy does too); a NaN keeps its sign and its top 10 payload bits
 *                      (at least one set).
 *   -> bool            nonzero (NaN included) -> 1.
 *
 * Intensity normalisation, (x - offset) * scale fused into the conversion, writes float
 * types only. It computes in f32 (f64 for an f64 output): x, offset and scale are each
 * converted to that type (rounded once to nearest even), the difference and the product
 * each rounded once (no fused multiply-add), and the result stored as a value of that type
 * is. A NaN stays a NaN; its sign and payload are not kept (the GPU's arithmetic makes it
 * canonical, the CPU's keeps them).
 *
 * Every conversion below is explicit code on bits or on values known to be in range: no C
 * cast of a value that can be out of its target's range (undefined in C, saturating on the
 * GPU), so the host twin computes what the GPU computes.
 */
#ifndef DAMACY_CONVERT_CUH
#define DAMACY_CONVERT_CUH

#include "device.h"

/* dtype codes, shared with Python (damacy_server/native/_assemble.c uses the same) */
enum { DT_BOOL, DT_I1, DT_U1, DT_I2, DT_U2, DT_I4, DT_U4, DT_I8, DT_U8, DT_F2, DT_F4, DT_F8, DT_BF16, DT_COUNT };

/* ---- bits ---------------------------------------------------------------------------- */
DAMACY_FN uint32_t f32_bits(float f) { uint32_t u; DAMACY_MEMCPY(&u, &f, 4); return u; }
DAMACY_FN float bits_f32(uint32_t u) { float f; DAMACY_MEMCPY(&f, &u, 4); return f; }
DAMACY_FN uint64_t f64_bits(double d) { uint64_t u; DAMACY_MEMCPY(&u, &d, 8); return u; }
DAMACY_FN double bits_f64(uint64_t u) { double d; DAMACY_MEMCPY(&d, &u, 8); return d; }

DAMACY_FN uint16_t swap16(uint16_t v) { return (uint16_t)((v >> 8) | (v << 8)); }
DAMACY_FN uint32_t swap32(uint32_t v) {
    return (v >> 24) | ((v >> 8) & 0xff00u) | ((v << 8) & 0xff0000u) | (v << 24);
}
DAMACY_FN uint64_t swap64(uint64_t v) {
    return ((uint64_t)swap32((uint32_t)v) << 32) | swap32((uint32_t)(v >> 32));
}

/* ---- f16 ----------------------------------------------------------------------------- */
DAMACY_FN float f16_to_f32(uint16_t h) { /* exact; a NaN keeps its bits (numpy) */
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exp = 113;
            while (!(mant & 0x400u)) { mant <<= 1; exp--; }
            bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    }
    return bits_f32(bits);
}

DAMACY_FN double f16_to_f64(uint16_t h) { /* exact; a NaN keeps its bits (numpy) */
    uint64_t sign = (uint64_t)(h & 0x8000u) << 48;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    if (exp == 31) return bits_f64(sign | 0x7ff0000000000000ull | ((uint64_t)mant << 42));
    uint32_t f = f32_bits(f16_to_f32(h)); /* finite: exact in f32, then exact in f64 */
    uint64_t fe = (f >> 23) & 0xffu, fm = f & 0x7fffffu;
    if (fe == 0) return bits_f64(sign); /* zero (an f16 is never an f32 subnormal) */
    return bits_f64(sign | ((fe - 127 + 1023) << 52) | (fm << 29));
}

DAMACY_FN uint16_t f32_to_f16(float value) { /* round half to even, as numpy */
    uint32_t f = f32_bits(value);
    uint32_t f_exp = f & 0x7f800000u, f_sig;
    uint16_t h_sgn = (uint16_t)((f & 0x80000000u) >> 16), h_sig;
    if (f_exp >= 0x47800000u) {
        if (f_exp == 0x7f800000u && (f & 0x007fffffu)) { /* NaN: top payload bits, never 0 */
            uint16_t ret = (uint16_t)(0x7c00u + ((f & 0x007fffffu) >> 13));
            if (ret == 0x7c00u) ret++;
            return (uint16_t)(h_sgn + ret);
        }
        return (uint16_t)(h_sgn + 0x7c00u); /* inf, or too large */
    }
    if (f_exp <= 0x38000000u) { /* subnormal or zero */
        if (f_exp < 0x33000000u) return h_sgn;
        f_exp >>= 23;
        f_sig = 0x00800000u + (f & 0x007fffffu);
        f_sig >>= (113 - f_exp); /* the bits shifted out are checked below, in f */
        if (((f_sig & 0x00003fffu) != 0x00001000u) || (f & 0x000007ffu)) f_sig += 0x00001000u;
        h_sig = (uint16_t)(f_sig >> 13);
        return (uint16_t)(h_sgn + h_sig);
    }
    f_exp -= 0x38000000u;
    f_sig = f & 0x007fffffu;
    if ((f_sig & 0x00003fffu) != 0x00001000u) f_sig += 0x00001000u;
    h_sig = (uint16_t)(f_sig >> 13);
    h_sig = (uint16_t)(h_sig + (uint16_t)(f_exp >> 13)); /* a carry may reach inf: correct */
    return (uint16_t)(h_sgn + h_sig);
}

/* ---- f64 -> f32 ---------------------------------------------------------------------- */
#define DAMACY_F32_MAX 3.4028234663852886e+38

DAMACY_FN float f64_to_f32(double d) { /* nearest even; NaN quiet with its top 22 bits */
    uint64_t u = f64_bits(d);
    if ((u & 0x7fffffffffffffffull) > 0x7ff0000000000000ull) {
        uint32_t sign = (uint32_t)(u >> 32) & 0x80000000u;
        return bits_f32(sign | 0x7fc00000u | (uint32_t)((u >> 29) & 0x3fffffu));
    }
    if (d > DAMACY_F32_MAX || d < -DAMACY_F32_MAX) {
        /* beyond the largest f32: rounds to it up to half an ulp past, else to inf */
        double a = d < 0 ? -d : d;
        uint32_t sign = d < 0 ? 0x80000000u : 0u;
        if (a < 3.4028235677973366e+38) return bits_f32(sign | 0x7f7fffffu);
        return bits_f32(sign | 0x7f800000u);
    }
    return (float)d; /* in range: a defined conversion, to nearest even */
}

/* f64 -> f32 rounded to odd: truncated, with the last bit set when anything was lost.
 * Rounding that once more to a format at least two bits narrower (f16, bf16) gives the
 * value rounded once, directly. Finite input only. */
DAMACY_FN float f64_to_f32_odd(double d) {
    if (d > DAMACY_F32_MAX || d < -DAMACY_F32_MAX)
        return bits_f32((d < 0 ? 0x80000000u : 0u) | 0x7f800000u); /* inf: so are f16 and bf16 */
    float f = (float)d; /* in range: to nearest even */
    double back = (double)f;
    uint32_t b = f32_bits(f);
    if (back == d || (b & 1u)) return f;
    /* f is the even neighbour of d: take the other one, on d's side of f */
    uint32_t negative = b >> 31, toward_plus = back < d;
    return bits_f32(toward_plus != negative ? b + 1u : b - 1u);
}

DAMACY_FN uint16_t f64_to_f16(double d) { /* rounded once; NaN as numpy's double -> half */
    uint64_t u = f64_bits(d);
    if ((u & 0x7fffffffffffffffull) > 0x7ff0000000000000ull) {
        uint16_t sign = (uint16_t)((u >> 48) & 0x8000u);
        uint16_t ret = (uint16_t)(0x7c00u + ((u & 0x000fffffffffffffull) >> 42));
        if (ret == 0x7c00u) ret++;
        return (uint16_t)(sign + ret);
    }
    return f32_to_f16(f64_to_f32_odd(d));
}

/* ---- bf16 ---------------------------------------------------------------------------- */
DAMACY_FN uint16_t f32_to_bf16(float value) { /* nearest even; NaN -> quiet, sign kept */
    uint32_t f = f32_bits(value);
    if ((f & 0x7fffffffu) > 0x7f800000u) return (uint16_t)(((f >> 16) & 0x8000u) | 0x7fc0u);
    return (uint16_t)((f + 0x7fffu + ((f >> 16) & 1u)) >> 16);
}

DAMACY_FN uint16_t f64_to_bf16(double d) { /* rounded once */
    uint64_t u = f64_bits(d);
    if ((u & 0x7fffffffffffffffull) > 0x7ff0000000000000ull) return (uint16_t)(((u >> 48) & 0x8000u) | 0x7fc0u);
    return f32_to_bf16(f64_to_f32_odd(d));
}

/* ---- float -> integer: saturating --------------------------------------------------- */
#define DAMACY_SAT(NAME, T, LO, HI)                                                        \
    DAMACY_FN T NAME(double v) {                                                           \
        if (v != v) return (T)0;                                                           \
        if (v <= (double)(LO) - 1.0) return (T)(LO);                                       \
        if (v >= (double)(HI) + 1.0) return (T)(HI);                                       \
        return (T)v; /* within (LO - 1, HI + 1): truncation lands in range */               \
    }
DAMACY_SAT(sat_i1, int8_t, -128, 127)
DAMACY_SAT(sat_u1, uint8_t, 0, 255)
DAMACY_SAT(sat_i2, int16_t, -32768, 32767)
DAMACY_SAT(sat_u2, uint16_t, 0, 65535)
DAMACY_SAT(sat_i4, int32_t, -2147483647 - 1, 2147483647)
DAMACY_SAT(sat_u4, uint32_t, 0, 4294967295u)
/* 64-bit bounds: (double)MAX + 1 is 2**63 (2**64), and MIN - 1 rounds to MIN = -2**63 */
DAMACY_FN int64_t sat_i8(double v) {
    if (v != v) return 0;
    if (v < -9223372036854775808.0) return (int64_t)(-9223372036854775807ll - 1);
    if (v >= 9223372036854775808.0) return 9223372036854775807ll;
    return (int64_t)v;
}
DAMACY_FN uint64_t sat_u8(double v) {
    if (v != v) return 0;
    if (v <= -1.0) return 0;
    if (v >= 18446744073709551616.0) return 18446744073709551615ull;
    return (uint64_t)v;
}

/* ---- integer -> integer: clamped --------------------------------------------------- */
/* Each integer type's bounds: the minima as long long, the maxima as unsigned long long, so
 * that comparing two minima or two maxima is exact (every minimum is <= 0, every maximum
 * >= 0). DAMACY_CLAMP_LO(S, D) and DAMACY_CLAMP_HI(S, D) bound type D's range within type
 * S's, so both are values of S. DAMACY_CLAMP_SIGNED(T, x, S, D) clamps x, of the signed C
 * type T whose range is S's, to D's range in T's own arithmetic (no wider type, no float,
 * no comparison of mixed signedness), and the result converts to D exactly;
 * DAMACY_CLAMP_UNSIGNED the same for an unsigned T (never below any type's minimum). A
 * bound that is S's own is not tested (a constant false guard the compiler drops): a pair
 * whose range S is within D's is a plain copy. The native CPU loop (../../native/convert.c)
 * clamps each source in its own type (a max and a min: vectorised); store_value below
 * clamps the 64-bit form of a loaded integer (int64_t when signed, uint64_t when not). */
#define DAMACY_MIN_B1 0ll
#define DAMACY_MAX_B1 1ull
#define DAMACY_MIN_I1 (-128ll)
#define DAMACY_MAX_I1 127ull
#define DAMACY_MIN_U1 0ll
#define DAMACY_MAX_U1 255ull
#define DAMACY_MIN_I2 (-32768ll)
#define DAMACY_MAX_I2 32767ull
#define DAMACY_MIN_U2 0ll
#define DAMACY_MAX_U2 65535ull
#define DAMACY_MIN_I4 (-2147483647ll - 1)
#define DAMACY_MAX_I4 2147483647ull
#define DAMACY_MIN_U4 0ll
#define DAMACY_MAX_U4 4294967295ull
#define DAMACY_MIN_I8 (-9223372036854775807ll - 1)
#define DAMACY_MAX_I8 9223372036854775807ull
#define DAMACY_MIN_U8 0ll
#define DAMACY_MAX_U8 18446744073709551615ull
#define DAMACY_CLAMP_LO(S, D) (DAMACY_MIN_##D > DAMACY_MIN_##S ? DAMACY_MIN_##D : DAMACY_MIN_##S)
#define DAMACY_CLAMP_HI(S, D) (DAMACY_MAX_##D < DAMACY_MAX_##S ? DAMACY_MAX_##D : DAMACY_MAX_##S)
#define DAMACY_CLAMP_UNSIGNED(T, x, S, D) \
    ((DAMACY_MAX_##D < DAMACY_MAX_##S && (x) > (T)DAMACY_CLAMP_HI(S, D)) ? (T)DAMACY_CLAMP_HI(S, D) : (x))
#define DAMACY_CLAMP_SIGNED(T, x, S, D)                                                              \
    ((DAMACY_MIN_##D > DAMACY_MIN_##S && (x) < (T)DAMACY_CLAMP_LO(S, D)) ? (T)DAMACY_CLAMP_LO(S, D) \
                                                                        : DAMACY_CLAMP_UNSIGNED(T, x, S, D))

/* a loaded integer (its 64-bit form, sign-extended when signed) clamped to type D's range,
 * as the 64-bit form of the result */
DAMACY_FN int64_t as_i64(uint64_t v) { int64_t r; DAMACY_MEMCPY(&r, &v, 8); return r; }
#define DAMACY_CLAMP_VALUE(v, D)                                                              \
    ((v).is_signed ? (uint64_t)DAMACY_CLAMP_SIGNED(int64_t, as_i64((v).i), I8, D) : DAMACY_CLAMP_UNSIGNED(uint64_t, (v).i, U8, D))

/* an integer in the type's range, from its 64-bit form: its low bytes */
DAMACY_FN int8_t narrow_i1(uint64_t v) { uint8_t u = (uint8_t)v; int8_t r; DAMACY_MEMCPY(&r, &u, 1); return r; }
DAMACY_FN uint8_t narrow_u1(uint64_t v) { return (uint8_t)v; }
DAMACY_FN int16_t narrow_i2(uint64_t v) { uint16_t u = (uint16_t)v; int16_t r; DAMACY_MEMCPY(&r, &u, 2); return r; }
DAMACY_FN uint16_t narrow_u2(uint64_t v) { return (uint16_t)v; }
DAMACY_FN int32_t narrow_i4(uint64_t v) { uint32_t u = (uint32_t)v; int32_t r; DAMACY_MEMCPY(&r, &u, 4); return r; }
DAMACY_FN uint32_t narrow_u4(uint64_t v) { return (uint32_t)v; }
DAMACY_FN int64_t narrow_i8(uint64_t v) { return as_i64(v); }
DAMACY_FN uint64_t narrow_u8(uint64_t v) { return v; }

/* ---- one source element ------------------------------------------------------------- */
/* A loaded element: integers (and bools) as their two's complement bits widened to 64 (a
 * signed value sign-extended) with `is_signed`, floats as f64 (f32 and f16 exactly) with
 * the f16 and f32 bits kept for the conversions that need them. */
typedef struct {
    int kind; /* 0: integer or bool, 1: f16, 2: f32, 3: f64 */
    int is_signed;
    uint64_t i;
    double f;
    uint32_t bits; /* f16 or f32 bits */
} damacy_value;

DAMACY_FN damacy_value load_value(const char *p, int dt, int swap) {
    damacy_value v;
    v.kind = 0; v.is_signed = 0; v.i = 0; v.f = 0.0; v.bits = 0;
    switch (dt) {
    case DT_BOOL: { uint8_t b = (uint8_t)p[0]; v.i = b != 0; break; }
    case DT_I1: { int8_t x; DAMACY_MEMCPY(&x, p, 1); v.i = (uint64_t)(int64_t)x; v.is_signed = 1; break; }
    case DT_U1: { uint8_t x; DAMACY_MEMCPY(&x, p, 1); v.i = x; break; }
    case DT_I2: { uint16_t u; DAMACY_MEMCPY(&u, p, 2); if (swap) u = swap16(u); int16_t x; DAMACY_MEMCPY(&x, &u, 2); v.i = (uint64_t)(int64_t)x; v.is_signed = 1; break; }
    case DT_U2: { uint16_t u; DAMACY_MEMCPY(&u, p, 2); if (swap) u = swap16(u); v.i = u; break; }
    case DT_I4: { uint32_t u; DAMACY_MEMCPY(&u, p, 4); if (swap) u = swap32(u); int32_t x; DAMACY_MEMCPY(&x, &u, 4); v.i = (uint64_t)(int64_t)x; v.is_signed = 1; break; }
    case DT_U4: { uint32_t u; DAMACY_MEMCPY(&u, p, 4); if (swap) u = swap32(u); v.i = u; break; }
    case DT_I8: { uint64_t u; DAMACY_MEMCPY(&u, p, 8); if (swap) u = swap64(u); v.i = u; v.is_signed = 1; break; }
    case DT_U8: { uint64_t u; DAMACY_MEMCPY(&u, p, 8); if (swap) u = swap64(u); v.i = u; break; }
    case DT_F2: { uint16_t u; DAMACY_MEMCPY(&u, p, 2); if (swap) u = swap16(u); v.kind = 1; v.bits = u; v.f = f16_to_f64(u); break; }
    case DT_F4: { uint32_t u; DAMACY_MEMCPY(&u, p, 4); if (swap) u = swap32(u); v.kind = 2; v.bits = u; v.f = 0.0; break; }
    case DT_F8: { uint64_t u; DAMACY_MEMCPY(&u, p, 8); if (swap) u = swap64(u); v.kind = 3; v.f = bits_f64(u); break; }
    default: break;
    }
    if (v.kind == 2) { /* f32 -> f64: exact; a NaN becomes quiet, as x86 and numpy do */
        uint32_t b = v.bits;
        if ((b & 0x7fffffffu) > 0x7f800000u) {
            v.f = bits_f64(((uint64_t)(b & 0x80000000u) << 32) | 0x7ff8000000000000ull | ((uint64_t)(b & 0x7fffffu) << 29));
        } else {
            v.f = (double)bits_f32(b);
        }
    }
    return v;
}

DAMACY_FN int is_nan_value(damacy_value v) { return v.kind != 0 && v.f != v.f; }

/* the integer's value as f64 rounded once (exact below 2**53) */
DAMACY_FN double int_to_f64(damacy_value v) {
    if (v.is_signed) { int64_t s; DAMACY_MEMCPY(&s, &v.i, 8); return (double)s; }
    return (double)v.i;
}

/* the value as f32, rounded once (the conversion to an f32 output) */
DAMACY_FN float value_f32(damacy_value v) {
    if (v.kind == 0) {
        if (v.is_signed) { int64_t s; DAMACY_MEMCPY(&s, &v.i, 8); return (float)s; }
        return (float)v.i;
    }
    if (v.kind == 2) return bits_f32(v.bits);
    if (v.kind == 1) return f16_to_f32((uint16_t)v.bits);
    return f64_to_f32(v.f);
}

/* ---- intensity normalisation -------------------------------------------------------- */
/* (v - offset) * scale in the output's compute type, as an f32 (or f64) value to store */
DAMACY_FN damacy_value normalize_value(damacy_value v, int out_dtype, double offset, double scale) {
    damacy_value r;
    r.is_signed = 0; r.i = 0; r.bits = 0; r.f = 0.0;
    if (out_dtype == DT_F8) {
        r.kind = 3;
        r.f = DAMACY_DMUL(DAMACY_DSUB(v.kind == 0 ? int_to_f64(v) : v.f, offset), scale);
    } else {
        r.kind = 2;
        r.bits = f32_bits(DAMACY_FMUL(DAMACY_FSUB(value_f32(v), f64_to_f32(offset)), f64_to_f32(scale)));
    }
    return r;
}

/* ---- one output element ------------------------------------------------------------- */
DAMACY_FN void store_value(char *q, int dt, damacy_value v) {
    switch (dt) {
    case DT_BOOL: {
        uint8_t b = v.kind == 0 ? (v.i != 0) : (v.f != 0.0 || v.f != v.f);
        q[0] = (char)b;
        return;
    }
    case DT_F4: {
        float f = value_f32(v);
        DAMACY_MEMCPY(q, &f, 4);
        return;
    }
    case DT_F8: {
        double d = v.kind == 0 ? int_to_f64(v) : v.f;
        DAMACY_MEMCPY(q, &d, 8);
        return;
    }
    case DT_F2: {
        uint16_t h;
        if (v.kind == 1) h = (uint16_t)v.bits;
        else if (v.kind == 2) h = f32_to_f16(bits_f32(v.bits));
        else if (v.kind == 3) h = f64_to_f16(v.f);
        else h = f64_to_f16(int_to_f64(v)); /* |v| past 2**53 is far past f16's range */
        DAMACY_MEMCPY(q, &h, 2);
        return;
    }
    case DT_BF16: {
        uint16_t h;
        if (v.kind == 1) h = f32_to_bf16(f16_to_f32((uint16_t)v.bits));
        else if (v.kind == 2) h = f32_to_bf16(bits_f32(v.bits));
        else if (v.kind == 3) h = f64_to_bf16(v.f); /* f64: rounded once */
        else h = f32_to_bf16(value_f32(v)); /* an integer: through f32, two roundings */
        DAMACY_MEMCPY(q, &h, 2);
        return;
    }
    default: break;
    }
    /* integer outputs */
    if (v.kind == 0) {
        switch (dt) {
        case DT_I1: { int8_t r = narrow_i1(DAMACY_CLAMP_VALUE(v, I1)); DAMACY_MEMCPY(q, &r, 1); return; }
        case DT_U1: { uint8_t r = narrow_u1(DAMACY_CLAMP_VALUE(v, U1)); DAMACY_MEMCPY(q, &r, 1); return; }
        case DT_I2: { int16_t r = narrow_i2(DAMACY_CLAMP_VALUE(v, I2)); DAMACY_MEMCPY(q, &r, 2); return; }
        case DT_U2: { uint16_t r = narrow_u2(DAMACY_CLAMP_VALUE(v, U2)); DAMACY_MEMCPY(q, &r, 2); return; }
        case DT_I4: { int32_t r = narrow_i4(DAMACY_CLAMP_VALUE(v, I4)); DAMACY_MEMCPY(q, &r, 4); return; }
        case DT_U4: { uint32_t r = narrow_u4(DAMACY_CLAMP_VALUE(v, U4)); DAMACY_MEMCPY(q, &r, 4); return; }
        case DT_I8: { int64_t r = narrow_i8(DAMACY_CLAMP_VALUE(v, I8)); DAMACY_MEMCPY(q, &r, 8); return; }
        case DT_U8: { uint64_t r = narrow_u8(DAMACY_CLAMP_VALUE(v, U8)); DAMACY_MEMCPY(q, &r, 8); return; }
        default: return;
        }
    }
    {
        double f = v.f;
        switch (dt) {
        case DT_I1: { int8_t r = sat_i1(f); DAMACY_MEMCPY(q, &r, 1); return; }
        case DT_U1: { uint8_t r = sat_u1(f); DAMACY_MEMCPY(q, &r, 1); return; }
        case DT_I2: { int16_t r = sat_i2(f); DAMACY_MEMCPY(q, &r, 2); return; }
        case DT_U2: { uint16_t r = sat_u2(f); DAMACY_MEMCPY(q, &r, 2); return; }
        case DT_I4: { int32_t r = sat_i4(f); DAMACY_MEMCPY(q, &r, 4); return; }
        case DT_U4: { uint32_t r = sat_u4(f); DAMACY_MEMCPY(q, &r, 4); return; }
        case DT_I8: { int64_t r = sat_i8(f); DAMACY_MEMCPY(q, &r, 8); return; }
        case DT_U8: { uint64_t r = sat_u8(f); DAMACY_MEMCPY(q, &r, 8); return; }
        default: return;
        }
    }
}

#endif
