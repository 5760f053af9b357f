/*
 * Blosc's block filters undone on decoded streams: byte unshuffle, bit unshuffle, and plain
 * copies of blocks stored as they are. One CUDA block per Blosc block; each thread writes
 * whole output bytes. The numpy reference is damacy_server/zarr/codecs/blosc.py,
 * unshuffle_block: a bit-shuffled block whose element count is not a multiple of 8 was
 * stored as it is, and the bytes past the last whole element are copied.
 */
#ifndef DAMACY_SHUFFLE_CUH
#define DAMACY_SHUFFLE_CUH

#include "device.h"

enum { SHUFFLE_NONE = 0, SHUFFLE_BYTE = 1, SHUFFLE_BIT = 2 };

/* block k: src[k] (its decoded streams, in order) -> dst[k], size[k] bytes */
DAMACY_KERNEL damacy_unshuffle(const char *const *src, char *const *dst, const int64_t *size, int64_t n_blocks,
                               int64_t typesize, int mode)
{
    int64_t k = DAMACY_BLOCK;
    if (k >= n_blocks) return;
    DAMACY_CHECK(typesize >= 1);
    const uint8_t *in = (const uint8_t *)src[k];
    uint8_t *out = (uint8_t *)dst[k];
    int64_t nbytes = size[k], n = nbytes / typesize, whole = n * typesize;
    if (mode == SHUFFLE_BIT && n % 8 != 0) mode = SHUFFLE_NONE;
    if (mode == SHUFFLE_BYTE && typesize == 1) mode = SHUFFLE_NONE;
    for (int64_t o = DAMACY_THREAD; o < nbytes; o += DAMACY_BLOCK_DIM) {
        if (mode == SHUFFLE_NONE || o >= whole) {
            out[o] = in[o];
            continue;
        }
        int64_t i = o / typesize, j = o % typesize; /* byte j of element i */
        if (mode == SHUFFLE_BYTE) {
            out[o] = in[j * n + i];
            continue;
        }
        /* bit b of byte j of element i is bit (i % 8) of byte i / 8 of row j * 8 + b */
        uint8_t v = 0;
        int64_t row_bytes = n / 8;
        for (int b = 0; b < 8; b++) {
            uint8_t byte = in[(j * 8 + b) * row_bytes + i / 8];
            v = (uint8_t)(v | (((byte >> (i % 8)) & 1u) << b));
        }
        out[o] = v;
    }
}

#endif
