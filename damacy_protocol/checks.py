"""Field constraints as types (msgspec ``Meta``), and one check that words their errors.

Config, the executor's and planner's limits, the reader and the metadata cache all state
their numeric fields with these types; :func:`checked` validates a value against one and
raises :class:`InvalidArgument` naming the field.
"""

from __future__ import annotations

import types
import typing
from typing import Annotated, Any, Literal

import msgspec

from damacy_protocol.errors import InvalidArgument

Count = Annotated[int, msgspec.Meta(ge=1)]  # threads, slots, samples: at least one
Size = Annotated[int, msgspec.Meta(ge=0)]  # bytes or entries, 0 allowed (off)
Seconds = Annotated[float, msgspec.Meta(gt=0)]


def describe(tp: Any) -> str:
    """What a value of ``tp`` must be, in words: "an integer >= 1", "one of ('a', 'b')"."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        parts = [describe(a) for a in typing.get_args(tp) if a is not type(None)]
        none = type(None) in typing.get_args(tp)
        return " or ".join(parts) + (" or None" if none else "")
    if origin is Annotated:
        base, *metas = typing.get_args(tp)
        words = describe(base)
        for meta in metas:
            if isinstance(meta, msgspec.Meta):
                if meta.ge is not None:
                    words += f" >= {meta.ge}"
                if meta.gt is not None:
                    words = "a positive number" if meta.gt == 0 and base is float else f"{words} > {meta.gt}"
        return words
    if origin is Literal:
        return f"one of {typing.get_args(tp)}"
    if origin is tuple:
        first, _, rest = describe(typing.get_args(tp)[0]).partition(" ")[2].partition(" ")
        return f"a tuple of {first}s{' ' + rest if rest else ''}"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is bool:
        return "True or False"
    if tp is str:
        return "a string"
    return getattr(tp, "__name__", str(tp))


def checked(owner: str, name: str, value: Any, tp: Any) -> Any:
    """``value`` as ``tp`` (a tuple from a list, a float from an int), or InvalidArgument
    "``owner.name`` must be ..., got ...". Booleans are not integers here."""
    try:
        return msgspec.convert(value, tp)
    except msgspec.ValidationError:
        raise InvalidArgument(f"{owner}.{name} must be {describe(tp)}, got {value!r}") from None


def check_fields(obj: Any, hints: dict[str, Any], owner: str | None = None) -> None:
    """Check (and normalize in place) each attribute of ``obj`` named in ``hints``."""
    owner = owner or type(obj).__name__
    for name, tp in hints.items():
        object.__setattr__(obj, name, checked(owner, name, getattr(obj, name), tp))
