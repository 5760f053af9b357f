"""The CUDA path, written so that the CPU checks almost all of it.

``kernels/``: every kernel once, in CUDA C that is also plain C (``device.h`` is the only
place the two builds differ): the numeric contract (``convert.cuh``), batch assembly from a
plan's copy table and fills (``assemble.cuh``), Blosc's unshuffle and bit-unshuffle
(``shuffle.cuh``); ``kernels.cu`` includes them for nvcc and NVRTC. ``_twin.c`` compiles the
same headers into a host twin that runs each kernel block by block, thread by thread
(:mod:`damacy_server.cuda.twin`); the tests check the twin bit for bit against the numpy
reference (:mod:`damacy_server.decode.contract`) and the CPU paths, and compile the kernels with
nvcc when it is installed. :mod:`damacy_server.cuda.tables` holds the host-side checks a
launch relies on (no two rows write one output element).
"""
