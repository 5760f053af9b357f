"""What a plan takes besides the public samples: a pushed item refused before planning (its
error goes to its pop like any bad sample's), and a selection already parsed
(``damacy.read``'s)."""

from __future__ import annotations

from typing import Any

from damacy_protocol.enums import BoundsPolicy
from damacy_protocol.errors import DamacyError, InvalidArgument
from damacy_protocol.samples import IndexQuery, Sample
from damacy_server.plan.selection import AxisSelection, resolve
from damacy_server.zarr.metadata import ArrayMetadata


class BadSample:
    """A sample that was refused before planning (e.g. a path the daemon may not serve); its
    pop reports ``error`` like any other bad sample."""

    __slots__ = ("uri", "error", "description")

    def __init__(self, uri: str | None, error: DamacyError, description: str | None = None) -> None:
        self.uri = uri
        self.error = error
        self.description = description or f"sample of {uri!r}"

    def __repr__(self) -> str:
        return self.description


class Selected:
    """A sample whose per-axis selection is already parsed (``damacy.read``'s): no level of
    its own, no transform."""

    __slots__ = ("uri", "axes")
    level = None
    flip: tuple[int, ...] = ()
    transpose = None
    normalize = None

    def __init__(self, uri: str, axes: list[AxisSelection]) -> None:
        self.uri = uri
        self.axes = axes

    def __repr__(self) -> str:
        return f"damacy.read({self.uri!r})"


def sample_axes(sample: Any, meta: ArrayMetadata, out_of_bounds: BoundsPolicy | str) -> list[AxisSelection]:
    """The per-axis selection of a :class:`Sample` or :class:`IndexQuery` on ``meta``."""
    if isinstance(sample, Selected):
        return sample.axes
    if isinstance(sample, (Sample, IndexQuery)):
        return resolve(sample.selection, meta.shape, out_of_bounds)[0]
    raise InvalidArgument(f"expected a Sample or an IndexQuery, got {type(sample).__name__}")
