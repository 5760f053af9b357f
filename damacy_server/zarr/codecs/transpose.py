"""``transpose``: the chunk is stored with its axes permuted."""

from __future__ import annotations

from typing import Any

import numpy as np

from damacy_protocol.errors import MetadataError
from damacy_server.zarr.codecs.base import ArrayArrayCodec, ChunkSpec


class TransposeCodec(ArrayArrayCodec):
    name = "transpose"

    def __init__(self, order: tuple[int, ...]) -> None:
        self.order = order
        self.inverse = tuple(int(i) for i in np.argsort(order))

    @classmethod
    def from_config(cls, config: dict[str, Any], spec: ChunkSpec, uri: str) -> TransposeCodec:
        ndim = len(spec.shape)
        order = config.get("order")
        # "C" and "F" are what writers produced before the spec settled on a permutation.
        if order == "C":
            order = list(range(ndim))
        elif order == "F":
            order = list(range(ndim))[::-1]
        if (
            not isinstance(order, (list, tuple))
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in order)
            or sorted(order) != list(range(ndim))
        ):
            raise MetadataError(
                f"codec 'transpose': order {config.get('order')!r} is not a permutation of {ndim} axes",
                uri=uri,
            )
        return cls(tuple(order))

    def describe(self) -> str:
        return f"transpose({list(self.order)})"

    def encoded_spec(self, spec: ChunkSpec) -> ChunkSpec:
        return ChunkSpec(tuple(spec.shape[i] for i in self.order), spec.dtype, spec.fill_value)

    def decode(self, arr: np.ndarray, spec: ChunkSpec) -> np.ndarray:
        return arr.transpose(self.inverse)
