"""damacyd's logs: text for people (the default) or one JSON object a line for machines
(``--log-format json``): ``time``, ``level``, ``event`` (a stable name: ``start``,
``stale_segments`` (shared memory of dead damacyd processes, removed before ``start``),
``metrics``, ``session_start``, ``session_end``, ``reclaimed`` (a dead or silent client's
session, before its ``session_end``), ``slow_batch``, ``refused_client``,
``refused_session``, ``refused_path``, ``protocol_error``, ``stop``, or ``log`` for the
rest), ``message``, ``pid``, and where they apply ``session``, ``client_pid``, ``rank``,
``uri``, ``error`` (the exception's type), ``batch`` and ``seconds``."""

from __future__ import annotations

import json
import logging
import time

#: the record attributes a log call may set through ``extra=`` and that JSON lines carry
FIELDS = ("event", "session", "client_pid", "rank", "uri", "error", "batch", "seconds")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "event": getattr(record, "event", "log"),
            "message": record.getMessage(),
            "pid": record.process,
        }
        for name in FIELDS[1:]:
            value = getattr(record, name, None)
            if value is not None:
                out[name] = value
        if record.exc_info:
            out["error"] = out.get("error") or record.exc_info[0].__name__
            out["traceback"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup(level: str, fmt: str) -> None:
    """Log to standard error at ``level``, as ``fmt`` ("text" or "json")."""
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s damacyd[%(process)d] %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
