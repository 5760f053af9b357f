#include "native.h"

/* check_lz4(block, size) -> None, or why the LZ4 block (raw, as Blosc stores a stream) is not
 * one that decodes to exactly `size` bytes: every literal run and match inside the input and
 * the output, every match offset inside what is already decoded, no match in the last 12
 * bytes or reaching into the last 5, the input ending with a literal run. nvCOMP's behaviour on corrupt input is undefined, so its LZ4 streams are
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
        /* LZ4's end of block: the last 12 bytes start no match, the last 5 are literals (the
         * reference decoder, C-Blosc's, refuses a block that breaks them; decoders may copy
         * past a match's end within that margin) */
        if (size < 12 || out > size - 12)
            return "a match starts in the last 12 bytes of the chunk (LZ4 leaves them to literals)";
        if (match > size - 5 - out)
            return "a match ends in the last 5 bytes of the chunk (LZ4 ends a block with 5 literals)";
        out += match;
        if (i >= n)
            return "the block ends with a match, not literals";
    }
    return out == size ? NULL : "the block decodes to fewer bytes than the chunk holds";
}

PyObject *dm_py_check_lz4(PyObject *self, PyObject *args) {
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
