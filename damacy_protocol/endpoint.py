"""Where clients look for damacyd when not told."""

from __future__ import annotations

import os


def default_endpoint() -> str:
    """``$DAMACY_ENDPOINT``, else an ipc socket under the user's runtime directory
    (``$XDG_RUNTIME_DIR``, else /tmp): ``ipc://DIR/damacy-UID/damacyd.sock``."""
    env = os.environ.get("DAMACY_ENDPOINT")
    if env:
        return env
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    return f"ipc://{base}/damacy-{os.getuid()}/damacyd.sock"
