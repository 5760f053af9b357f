// Every damacy kernel, for nvcc (the compile test) and NVRTC (cupy.RawModule). The host twin
// compiles the same headers as C: damacy_server/cuda/_twin.c.
#include "assemble.cuh"
#include "shuffle.cuh"
