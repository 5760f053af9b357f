"""Where clients look for damacyd when not told, and whether they may trust what they find.

The node's default endpoint is the same for every process of a user whatever its
environment (shell, container entry point, SLURM step, ``sudo -u``): an ipc socket in a
folder of the user's own under /tmp. ``$DAMACY_ENDPOINT`` overrides it on both sides.
"""

from __future__ import annotations

import os
import stat

from damacy_protocol.errors import InvalidArgument


def node_endpoint() -> str:
    """The node's default endpoint for this user: ``ipc:///tmp/damacy-UID/damacyd.sock``."""
    return f"ipc:///tmp/damacy-{os.geteuid()}/damacyd.sock"


def default_endpoint() -> str:
    """``$DAMACY_ENDPOINT``, else :func:`node_endpoint`."""
    return os.environ.get("DAMACY_ENDPOINT") or node_endpoint()


def check_private_folder(folder: str) -> None:
    """A socket's folder must be this user's and writable by no one else: otherwise another
    user could have put a socket of theirs where a client looks for damacyd."""
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise InvalidArgument(
            f"{folder} is not a private folder of this user (owner uid {st.st_uid}, mode {stat.filemode(st.st_mode)}); "
            "remove it, or choose another endpoint"
        )
