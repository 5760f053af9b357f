"""damacy's stderr log sink, beside the ``damacy`` logger.

damacy logs through :mod:`logging` (logger ``"damacy"``, a NullHandler attached on import,
so an application decides where records go). The sink is a handler of its own on that
logger that writes records at or above its threshold to stderr: ``set_log_level`` sets the
threshold (``LOG_TRACE`` .. ``LOG_FATAL``), ``set_log_quiet`` turns it off and on. A threshold
below the logger's level lowers the logger's level too (the records must be made), which
lets them reach the application's handlers as well.
"""

from __future__ import annotations

import logging
import sys

#: the seed API's level numbers
LOG_TRACE, LOG_DEBUG, LOG_INFO, LOG_WARN, LOG_ERROR, LOG_FATAL = range(6)

log = logging.getLogger("damacy")
#: the sink's threshold per level constant (TRACE is below DEBUG)
_LEVELS = {LOG_TRACE: 5, LOG_DEBUG: logging.DEBUG, LOG_INFO: logging.INFO, LOG_WARN: logging.WARNING,
           LOG_ERROR: logging.ERROR, LOG_FATAL: logging.CRITICAL}


class _StderrSink(logging.StreamHandler):
    def __init__(self) -> None:
        super().__init__()
        self.quiet = False
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if self.quiet:
            return
        self.stream = sys.stderr  # the stderr of now (tests and notebooks replace it)
        super().emit(record)

    def handle(self, record: logging.LogRecord) -> bool:  # quiet costs nothing
        return False if self.quiet else super().handle(record)


_sink = _StderrSink()
_sink.setLevel(logging.WARNING)


def install() -> None:
    """Attach the NullHandler and the sink to the ``damacy`` logger (once)."""
    if not any(isinstance(h, logging.NullHandler) for h in log.handlers):
        log.addHandler(logging.NullHandler())
    if _sink not in log.handlers:
        log.addHandler(_sink)


def set_log_level(level: int) -> None:
    """The threshold of damacy's stderr sink: ``LOG_TRACE`` (0) .. ``LOG_FATAL`` (5)
    (default ``LOG_WARN``); the ``damacy`` logger's other handlers keep their own."""
    if isinstance(level, bool) or level not in _LEVELS:
        raise ValueError(f"level must be one of LOG_TRACE..LOG_FATAL (0..5), got {level!r}")
    threshold = _LEVELS[level]
    _sink.setLevel(threshold)
    if log.getEffectiveLevel() > threshold:
        log.setLevel(threshold)


def set_log_quiet(quiet: bool) -> None:
    """Turn damacy's stderr sink off (``True``) or back on; the ``damacy`` logger's other
    handlers keep receiving records."""
    _sink.quiet = bool(quiet)
