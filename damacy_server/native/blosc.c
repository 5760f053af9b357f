/* Blosc 1, through the C-Blosc that numcodecs carries (its symbols are exported): a frame's
 * structure checked where blosc_getitem would read it unchecked, then the blocks a copy needs. */
#include "native.h"

#include <dlfcn.h>
#include <string.h>

blosc_getitem_t dm_blosc_getitem;
blosc_decompress_t dm_blosc_decompress;

/* Check the frame's structure where blosc_getitem would read it unchecked: the header, the
 * block table and every stream of the blocks that hold bytes [b0, b1). */
int dm_blosc_frame_ok(const unsigned char *p, Py_ssize_t len, Py_ssize_t nbytes_expected, int64_t b0, int64_t b1) {
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

/* use_blosc(path): take blosc_getitem from the (already loaded) library at path */
PyObject *dm_py_use_blosc(PyObject *self, PyObject *args) {
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path)) return NULL;
    if (!dm_blosc_getitem) {
        void *lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
        if (!lib) lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (lib) {
            dm_blosc_decompress = (blosc_decompress_t)dlsym(lib, "blosc_decompress_ctx");
            dm_blosc_getitem = (blosc_getitem_t)dlsym(lib, "blosc_getitem");
        }
    }
    return PyBool_FromLong(dm_blosc_getitem != NULL && dm_blosc_decompress != NULL);
}
