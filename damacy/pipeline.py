"""``damacy.Pipeline``: the node's damacyd when one answers, else the engine in this process.

The choice is made once per pipeline, from ``endpoint=``/``embedded=``, ``$DAMACY_ENDPOINT``
and the node's default socket, and logged once per process (logger "damacy", level INFO).
"""

from __future__ import annotations

import logging
import os
from abc import ABCMeta
from typing import Any

from damacy_protocol.config import Config
from damacy_protocol.errors import DaemonUnavailable, InvalidArgument
from damacy_runtime.api import PipelineAPI

log = logging.getLogger("damacy")

_chosen: set[str] = set()  # what Pipeline() chose, logged once per process


def _say_once(what: str) -> None:
    if what not in _chosen:
        _chosen.add(what)
        log.info("damacy: %s", what)


#: how long Pipeline() waits for the node's damacyd to answer once a process listens on its
#: socket: a daemon busy serving ranks may take a while, and a rank that gave up on it would
#: read on its own, with memory of its own; a socket nobody listens on is told at once
NODE_PING_S = 5.0


def _node_daemon() -> str | None:
    """The node's default endpoint when a damacyd answers there (in a folder of this user's
    own), else None."""
    from damacy_runtime.endpoint import check_private_folder, node_endpoint

    endpoint = node_endpoint()
    path = endpoint[len("ipc://") :]
    if not os.path.exists(path):
        return None
    try:
        check_private_folder(os.path.dirname(path))
    except InvalidArgument as e:
        _say_once(f"not using the socket at {path}: {e}")
        return None
    if not _listening(path):  # left by a daemon that is gone
        return None
    from damacy_runtime.probe import ping

    if ping(endpoint, NODE_PING_S):
        return endpoint
    _say_once(f"a process listens on {path} but did not answer a ping in {NODE_PING_S:g} s")
    return None


def _listening(path: str) -> bool:
    """Does a process accept connections on the unix socket at ``path``? (refused at once
    when none does)"""
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(NODE_PING_S)
        try:
            s.connect(path)
        except OSError:
            return False
    return True


class _AnyPipeline(ABCMeta):
    """``isinstance(p, damacy.Pipeline)`` holds for both kinds (they share PipelineAPI)."""

    def __instancecheck__(cls, obj) -> bool:
        return PipelineAPI in type(obj).__mro__

    def __subclasscheck__(cls, sub) -> bool:  # (by the MRO: ABCMeta's check would ask this class again)
        return isinstance(sub, type) and PipelineAPI in sub.__mro__


class Pipeline(PipelineAPI, metaclass=_AnyPipeline):
    """A streaming pipeline: run by the node's damacyd when one answers, else in this process.

    ``Pipeline(config)`` uses the damacyd at ``$DAMACY_ENDPOINT`` when that is set, else the
    one at the node's default endpoint (``ipc:///tmp/damacy-UID/damacyd.sock``) when it
    answers, else runs the engine in this process; the choice is logged once (logger
    "damacy", level INFO). ``endpoint=...`` asks for that daemon; ``embedded=True`` runs here
    whatever answers, ``embedded=False`` requires a daemon. Composed from parts
    (``planner=..., executor=..., output=..., queues=...``, all four) it runs here, and takes
    ``pop_timeout_s`` (default 30 s; a Config has its own). Both kinds behave the same.
    """

    def __new__(
        cls,
        config: Config | None = None,
        *,
        planner: Any = None,
        executor: Any = None,
        output: Any = None,
        queues: Any = None,
        pop_timeout_s: float | None = 30.0,
        endpoint: str | None = None,
        embedded: bool | None = None,
        **extras: Any,
    ):
        parts = {"planner": planner, "executor": executor, "output": output, "queues": queues}
        given = {k: v for k, v in parts.items() if v is not None}
        if config is not None and given:
            raise TypeError("supply either Config or pipeline components")
        if config is None:
            if len(given) < 4:
                raise TypeError("planner, executor, output, and queues are required")
            return _composed({**parts, "pop_timeout_s": pop_timeout_s, **extras}, endpoint, embedded)
        if extras:
            raise TypeError(f"Pipeline(config) takes no {', '.join(sorted(extras))} (they are Config fields)")
        return _make_pipeline(config, endpoint, embedded)


def _composed(parts: dict, endpoint: str | None, embedded: bool | None):
    if endpoint is not None or embedded is False:
        raise InvalidArgument("a pipeline composed from parts runs in this process: it takes no endpoint")
    from damacy_server.pipeline import Pipeline as EmbeddedPipeline

    return EmbeddedPipeline(None, **parts)


def _make_pipeline(config: Config, endpoint: str | None, embedded: bool | None):
    if not isinstance(config, Config):
        raise TypeError(f"Pipeline takes a damacy.Config, got {type(config).__name__}")
    if embedded and endpoint is not None:
        raise InvalidArgument("a pipeline is embedded or has an endpoint, not both")
    if not embedded:
        if endpoint is None:
            endpoint = os.environ.get("DAMACY_ENDPOINT") or _node_daemon()
        if endpoint is None and embedded is False:
            from damacy_runtime.endpoint import node_endpoint

            raise DaemonUnavailable(f"no damacyd answers at {node_endpoint()} (and DAMACY_ENDPOINT is not set)")
    if endpoint is not None:
        from damacy_client.client import RemotePipeline

        pipe = RemotePipeline(config, endpoint)
        _say_once(f"using damacyd at {pipe.endpoint}")
        return pipe
    from damacy_server.pipeline import Pipeline as EmbeddedPipeline

    if not embedded:
        _say_once("no damacyd answers at the node's endpoint: running embedded")
    return EmbeddedPipeline(config)
