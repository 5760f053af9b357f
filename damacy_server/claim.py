"""Which pipeline a component serves: a planner or an executor serves one open pipeline at a
time (the seed API's ownership rule), and any pipeline once that one is closed or gone."""

from __future__ import annotations

import weakref
from typing import Any

from damacy_protocol.errors import InvalidArgument


class Claim:
    """The pipeline holding a component (a weak reference: a pipeline dropped unclosed lets
    go of it too)."""

    __slots__ = ("_holder",)

    def __init__(self) -> None:
        self._holder: weakref.ref | None = None

    def take(self, owner: Any, refusal: str) -> None:
        """``owner`` holds it now; InvalidArgument(``refusal``) while another open pipeline does."""
        holder = self._holder() if self._holder is not None else None
        if holder is not None and holder is not owner and not getattr(holder, "closed", True):
            raise InvalidArgument(refusal)
        self._holder = weakref.ref(owner)

    def give_back(self, owner: Any) -> bool:
        """``owner`` is done with it; True when it held it (or nothing did)."""
        holder = self._holder() if self._holder is not None else None
        if holder is owner or holder is None:
            self._holder = None
            return True
        return False
