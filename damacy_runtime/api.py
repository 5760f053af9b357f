"""What every pipeline offers on top of ``pop``/``close``: iteration and context management.

Shared by the embedded pipeline and the daemon client, so both behave alike.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

from damacy_runtime.batch import Batch
from damacy_protocol.errors import PipelineDrained


class PipelineAPI(ABC):
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
        try:
            self.close()
        except Exception:  # noqa: BLE001 - half-built object or interpreter shutdown
            pass
