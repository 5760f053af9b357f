/*
 * The only place where the GPU build and the host twin differ: function qualifiers, the
 * thread and block indices, and the bounds check. Kernel bodies (the other headers here)
 * contain no #ifdef __CUDACC__: gcc compiles the same bodies into the host twin, which the
 * CPU tests run, and nvcc/NVRTC into the kernels the CUDA executor launches.
 *
 * A kernel is written as DAMACY_KERNEL name(args) { ... } over a 1-d grid: the body uses
 * DAMACY_BLOCK, DAMACY_THREAD, DAMACY_BLOCK_DIM and DAMACY_GRID_DIM, strides over its work by
 * DAMACY_BLOCK_DIM, never synchronises threads and writes each output element from exactly
 * one thread, so running the threads of a block one after another (the twin) computes
 * what the GPU computes.
 */
#ifndef DAMACY_DEVICE_H
#define DAMACY_DEVICE_H

#ifdef __CUDACC__
#ifdef __CUDACC_RTC__
/* NVRTC has no libc headers: the fixed-width types are declared here */
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;
#else
#include <stdint.h>
#endif
#define DAMACY_FN __device__ static __forceinline__
#define DAMACY_KERNEL extern "C" __global__ void
#define DAMACY_BLOCK ((int64_t)blockIdx.x)
#define DAMACY_THREAD ((int64_t)threadIdx.x)
#define DAMACY_BLOCK_DIM ((int64_t)blockDim.x)
#define DAMACY_GRID_DIM ((int64_t)gridDim.x)
/* the host checked the table (damacy_server/cuda/tables.py); the GPU does not re-check */
#define DAMACY_CHECK(cond) ((void)0)
/* memcpy is built into device code (NVRTC knows no __builtin_memcpy) */
#define DAMACY_MEMCPY(d, s, n) memcpy((d), (s), (n))
/* arithmetic rounded once per operation, never contracted into a fused multiply-add */
#define DAMACY_FSUB(a, b) __fsub_rn((a), (b))
#define DAMACY_FMUL(a, b) __fmul_rn((a), (b))
#define DAMACY_DSUB(a, b) __dsub_rn((a), (b))
#define DAMACY_DMUL(a, b) __dmul_rn((a), (b))
#else
#include <stdint.h>
#include <string.h>
#define DAMACY_FN static inline
#define DAMACY_KERNEL static void
/* the twin's launcher sets these before each (block, thread) it runs */
extern _Thread_local int64_t damacy_twin_block, damacy_twin_thread, damacy_twin_block_dim, damacy_twin_grid_dim;
extern _Thread_local int damacy_twin_fault;
#define DAMACY_BLOCK damacy_twin_block
#define DAMACY_THREAD damacy_twin_thread
#define DAMACY_BLOCK_DIM damacy_twin_block_dim
#define DAMACY_GRID_DIM damacy_twin_grid_dim
/* live in the twin: an index out of its buffer stops the thread and fails the launch */
#define DAMACY_CHECK(cond)                                                                 \
    do {                                                                                   \
        if (!(cond)) {                                                                     \
            damacy_twin_fault = 1;                                                         \
            return;                                                                        \
        }                                                                                  \
    } while (0)
#define DAMACY_MEMCPY(d, s, n) memcpy((d), (s), (n))
/* x86-64 and aarch64 evaluate float in float (FLT_EVAL_METHOD 0); ISO C modes do not
 * contract (a - b) * c, which is no multiply-add anyway */
#define DAMACY_FSUB(a, b) ((float)(a) - (float)(b))
#define DAMACY_FMUL(a, b) ((float)(a) * (float)(b))
#define DAMACY_DSUB(a, b) ((double)(a) - (double)(b))
#define DAMACY_DMUL(a, b) ((double)(a) * (double)(b))
#endif

#endif
