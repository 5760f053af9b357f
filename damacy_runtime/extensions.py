"""The optional compiled extensions (``_assemble``, ``_twin``, ``_dlpack``), looked up by name.

Each is built at install time when a C compiler is present and skipped otherwise; damacy
then runs the same on numpy alone. ``from package import _module`` cannot tell a module that
was not built from one that fails to import (both are ``ImportError``, and inside the
package's own ``__init__`` the message speaks of a partially initialized module), so every
extension is imported through :func:`optional`, which can.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def optional(name: str) -> ModuleType | None:
    """The extension module ``name`` (dotted), or None when it was not built; any other
    import error (a broken build, a missing symbol) is raised."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:
            raise
        return None
