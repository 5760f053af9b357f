"""Option types the two command lines (``damacy``, ``damacyd``) share."""

from __future__ import annotations

import math
from typing import Any

import click


class Seconds(click.FloatRange):
    """A float range that also refuses NaN and infinities (a NaN timeout compares false with
    everything: a silence that is never long enough, a sleep that raises)."""

    name = "seconds"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        out = super().convert(value, param, ctx)
        if not math.isfinite(out):
            self.fail(f"{value!r} is not a finite number of seconds", param, ctx)
        return out
