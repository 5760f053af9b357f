"""Zarr v3 codecs, one module each, decode only; :func:`build_chain` parses a chain."""

from damacy_server.zarr.codecs.base import ChunkSpec, CorruptData
from damacy_server.zarr.codecs.chain import CodecChain, build_chain, registry

__all__ = ["ChunkSpec", "CodecChain", "CorruptData", "build_chain", "registry"]
