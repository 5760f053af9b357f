"""What every pipeline offers on top of ``pop``/``close``: iteration and context management.

Shared by the embedded pipeline and the daemon client, so both behave alike.
"""

from __future__ import annotations

import itertools
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

from damacy_runtime.batch import Batch
from damacy_protocol.errors import DamacyError, PipelineDrained


class PipelineAPI(ABC):
    """Subclasses set ``_pid`` (the process that made the pipeline) and call
    :meth:`_check_process` in ``push``/``pop``/``stats``.

    After a fork the child holds a copy of the pipeline without its threads (and, for a
    daemon client, with sockets and a session that belong to the parent): using it raises at
    once, and closing it (explicitly or when it is collected) touches nothing the parent
    still uses."""

    _pid: int | None = None

    def _forked(self) -> bool:
        return self._pid is not None and self._pid != os.getpid()

    def _check_process(self) -> None:
        if self._forked():
            raise DamacyError(
                f"this pipeline was made in process {self._pid} and cannot be used in process {os.getpid()}, "
                "a fork of it: its threads and its daemon session stay with the parent. Make the pipeline in the "
                "process that uses it (in a DataLoader worker: on first use, not in Dataset.__init__; or num_workers=0)"
            )

    @abstractmethod
    def pop(self, timeout: float | None = None) -> Batch:
        """The next batch, in push order."""

    @abstractmethod
    def close(self) -> None:
        """Stop; never hangs."""

    def batches(self, n: int | None = None) -> Iterator[Batch]:
        """Yield ``n`` batches (all, when ``n`` is None), stopping early when drained."""
        for _ in itertools.count() if n is None else range(n):
            try:
                batch = self.pop()
            except PipelineDrained:
                return
            yield batch

    def __iter__(self) -> Iterator[Batch]:
        return self.batches()

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if self._forked():
            return
        try:
            self.close()
        except Exception:  # noqa: BLE001 - half-built object or interpreter shutdown
            pass
