/* libzstd, found at run time (dlopen: no build-time dependency); one decompression context per
 * thread; a frame decoded only as far as the copies need. */
#include "native.h"

#include <dlfcn.h>
#include <pthread.h>

int dm_zstd_ok = -1; /* -1: not tried yet; 1: loaded; 0: not found */

static zstd_content_size_t zstd_content_size;
static zstd_frame_size_t zstd_frame_size;
static zstd_stream_t zstd_stream;
static zstd_reset_t zstd_reset;
static zstd_create_t zstd_create;
static zstd_free_t zstd_free;
static zstd_set_parameter_t zstd_set_parameter; /* optional: the window limit stays zstd's default without it */
static zstd_sizeof_t zstd_sizeof;               /* optional: a grown context is then kept */
zstd_decompress_t dm_zstd_decompress;
zstd_iserror_t dm_zstd_iserror;
zstd_errname_t dm_zstd_errname;

/* one decompression context per thread, kept for the thread's life (they are pool workers) */
static pthread_key_t dctx_key;
static pthread_once_t dctx_once = PTHREAD_ONCE_INIT;
static void free_dctx(void *dctx) {
    if (dctx && zstd_free) zstd_free(dctx);
}
static void make_dctx_key(void) { pthread_key_create(&dctx_key, free_dctx); }
void *dm_zstd_dctx(void) {
    pthread_once(&dctx_once, make_dctx_key);
    void *dctx = pthread_getspecific(dctx_key);
    if (!dctx) {
        dctx = zstd_create();
        /* streaming a prefix takes a window of the frame's: allow any a frame may declare
         * (ZSTD_d_windowLogMax, 100, up to 31 on 64-bit), as one-shot decoding does */
        if (dctx && zstd_set_parameter) zstd_set_parameter(dctx, 100, sizeof(size_t) == 8 ? 31 : 30);
        if (dctx) pthread_setspecific(dctx_key, dctx);
    }
    return dctx;
}

/* A context that streamed a large frame holds a window as large (zstd keeps it for the next
 * frame): past a few MiB it is freed at the end of the task that grew it, not held by the
 * thread outside the memory budget; the next task makes a new one. */
#define DCTX_KEEP_MAX (8u << 20)
void dm_zstd_trim(void) {
    if (!zstd_sizeof) return;
    pthread_once(&dctx_once, make_dctx_key);
    void *dctx = pthread_getspecific(dctx_key);
    if (dctx && zstd_sizeof(dctx) > DCTX_KEEP_MAX) {
        pthread_setspecific(dctx_key, NULL);
        zstd_free(dctx);
    }
}

int dm_zstd_load(void) {
    void *lib = dlopen("libzstd.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) lib = dlopen("libzstd.so", RTLD_NOW | RTLD_LOCAL);
    if (!lib) return 0;
    zstd_create = (zstd_create_t)dlsym(lib, "ZSTD_createDCtx");
    zstd_free = (zstd_free_t)dlsym(lib, "ZSTD_freeDCtx");
    dm_zstd_decompress = (zstd_decompress_t)dlsym(lib, "ZSTD_decompressDCtx");
    dm_zstd_iserror = (zstd_iserror_t)dlsym(lib, "ZSTD_isError");
    dm_zstd_errname = (zstd_errname_t)dlsym(lib, "ZSTD_getErrorName");
    zstd_stream = (zstd_stream_t)dlsym(lib, "ZSTD_decompressStream");
    zstd_reset = (zstd_reset_t)dlsym(lib, "ZSTD_DCtx_reset");
    zstd_content_size = (zstd_content_size_t)dlsym(lib, "ZSTD_getFrameContentSize");
    zstd_frame_size = (zstd_frame_size_t)dlsym(lib, "ZSTD_findFrameCompressedSize");
    zstd_set_parameter = (zstd_set_parameter_t)dlsym(lib, "ZSTD_DCtx_setParameter");
    zstd_sizeof = (zstd_sizeof_t)dlsym(lib, "ZSTD_sizeof_DCtx");
    return zstd_create && zstd_free && dm_zstd_decompress && dm_zstd_iserror && dm_zstd_errname && zstd_stream && zstd_reset &&
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

size_t dm_zstd_prefix(void *dctx, char *dst, size_t full, size_t need, const void *src, size_t len, size_t *got,
                          int *whole) {
    /* Streaming costs a copy through zstd's window: worth it only when a whole block can go.
     * A prefix is decoded only from a single, whole frame of the expected size (its block
     * headers are walked, so truncation and broken block sizes are still errors); frames
     * with a checksum are always decoded whole so the checksum is verified. */
    if (need + ZSTD_BLOCK_MAX > full || zstd_has_checksum((const unsigned char *)src, len) ||
        zstd_content_size(src, len) != (unsigned long long)full || zstd_frame_size(src, len) != len) {
        size_t r = dm_zstd_decompress(dctx, dst, full, src, len);
        if (dm_zstd_iserror(r)) return r;
        *got = r;
        *whole = 1; /* decoded whole: it must be all of the chunk */
        return 0;
    }
    size_t r = zstd_reset(dctx, 1 /* ZSTD_reset_session_only */);
    if (dm_zstd_iserror(r)) return r;
    zstd_in in = {src, len, 0};
    zstd_out out = {dst, need, 0};
    while (out.pos < need) {
        r = zstd_stream(dctx, &out, &in);
        if (dm_zstd_iserror(r)) return r;
        if (r == 0 || (in.pos == in.size && out.pos < out.size)) break; /* frame (or input) ended */
    }
    *got = out.pos < need ? out.pos : need;
    return 0;
}
