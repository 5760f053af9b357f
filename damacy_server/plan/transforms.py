"""A sample's flip and transpose: checked against its selection's axes, and made by the
view its copies write through (no pass of their own)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from damacy_protocol.errors import InvalidArgument


def transform_of(sample: Any, shape: tuple[int, ...], drop: Sequence[int]) -> tuple | None:
    """A sample's (flip, transpose, dropped axes), checked against the axes of its result
    (``shape`` without the ``drop`` ped ones, which integers select); None: none."""
    flip, order = sample.flip, sample.transpose
    if not flip and order is None:
        return None
    ndim = len(shape) - len(drop)
    if flip and flip[-1] >= ndim:
        raise InvalidArgument(f"flip names axis {flip[-1]}, the selection has {ndim} axes")
    if order is not None and len(order) != ndim:
        raise InvalidArgument(f"transpose {order} names {len(order)} axes, the selection has {ndim}")
    return flip, order, tuple(drop)


def sample_view(target: Any, shape: tuple[int, ...], transform: tuple | None) -> Any:
    """Sample ``target`` (its slot's region, numpy or device memory) as the executors write
    it: in the selection's axis order and ``shape``. A transformed sample's view is permuted
    and reversed so that writing the selection as it is stores
    ``np.transpose(np.flip(selection, flip), transpose)`` in the slot: the copies make the
    transform, no pass of its own."""
    if transform is None:
        return target.reshape(shape)
    flip, order, drop = transform
    result = tuple(n for a, n in enumerate(shape) if a not in drop)  # the axes the sample has
    if order is None:
        view = target.reshape(result)
    else:
        view = target.reshape(tuple(result[a] for a in order)).transpose(tuple(int(a) for a in np.argsort(order)))
    if flip:
        view = np.flip(view, flip) if isinstance(view, np.ndarray) else view.flip(flip)
    if drop:  # the axes an integer selects, back as length-1 axes
        view = np.expand_dims(view, tuple(drop)) if isinstance(view, np.ndarray) else view.expand_dims(tuple(drop))
    return view
