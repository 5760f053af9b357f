"""The engine's error policy: what a sample that failed does to its batch.

``on_error`` (:class:`~damacy_protocol.enums.ErrorPolicy`): "stop" and "raise" fail the
batch (its pop raises the first error, listing them all; "stop" then ends the stream, which
the front end does), "fill" writes the fill value in the sample's place (``batch.info``
names it), "skip" drops it and asks the front end for a replacement: the batch becomes a
:class:`Patch` (its good samples compacted in its slot, in order) that the front end refills
with the next samples it has, or discards (``drop_last``, too few left). ``out_of_bounds``
(:class:`~damacy_protocol.enums.BoundsPolicy`) is the planner's to apply.

:class:`PolicyRounds` is the part of :class:`~damacy_server.engine.batches.BatchEngine` that
applies it once a round of a batch is executed: it acts on the engine's state (its lock
``cond``, the batches waiting for replacements, its slots), and hands a batch back to the
engine to run again (``_run``) or to deliver (``_finish``, ``_deliver``).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from damacy_protocol.enums import BoundsPolicy, ErrorPolicy
from damacy_protocol.errors import DamacyError
from damacy_server.decode import contract
from damacy_server.decode.chunks import cast_fill

#: the delivery of a batch whose samples were all skipped: passed over
SKIPPED = object()


@dataclass(frozen=True)
class Policy:
    """What the engine does about what goes wrong, beside what a batch is (a
    :class:`~damacy_protocol.limits.BatchSpec`): ``on_error`` ("stop" and "raise": the
    batch's pop raises the error; "fill"; "skip": :class:`ErrorPolicy`) and ``out_of_bounds``
    ("error", "pad": :class:`BoundsPolicy`), given as members or their strings."""

    on_error: ErrorPolicy = ErrorPolicy.STOP
    out_of_bounds: BoundsPolicy = BoundsPolicy.ERROR

    def __post_init__(self) -> None:
        object.__setattr__(self, "on_error", ErrorPolicy.coerce(self.on_error))
        object.__setattr__(self, "out_of_bounds", BoundsPolicy.coerce(self.out_of_bounds))


class Patch:
    """A batch whose failed samples were dropped (``on_error="skip"``): it wants ``needed``
    samples in their place (the front end gives what it has, possibly none)."""

    def __init__(self, pending: Any, dropped: list[tuple[Any, DamacyError]]) -> None:
        self.pending = pending
        self.dropped = dropped
        self.needed = len(dropped)


class PolicyRounds:
    """The error policy applied to a batch's rounds (mixed into the batch engine, whose state
    it shares: see the module's docstring)."""

    cond: threading.Condition
    policy: Policy
    executor: Any
    sample_errors: int
    _patches: deque
    _dry: bool
    _on_errors: Any

    if TYPE_CHECKING:  # the engine's, which this part hands batches back to

        def _run(self, pending: Any, positions: list[int]) -> None: ...
        def _finish(self, pending: Any) -> None: ...
        def _pass_over(self, pending: Any) -> None: ...
        def _changed(self) -> None: ...
        def slot_view(self, slot: Any, dtype: np.dtype) -> np.ndarray: ...

    def _apply_policy(
        self, pending: Any, positions: list[int], plan: Any, errors: dict[int, DamacyError], targets: list
    ) -> bool:
        """Record a round's failed samples on ``pending`` and apply the policy to them:
        fill their places, or note them as holes; True when the batch now waits for
        replacements (on_error="skip"), False when it is done (the engine delivers it)."""
        policy = self.policy.on_error
        if errors:
            with self.cond:
                self.sample_errors += len(errors)
            if self._on_errors is not None:
                self._on_errors(list(errors.values()))
        for i, err in errors.items():
            pos = positions[i]
            pending.errors[pos] = err
            if policy is ErrorPolicy.FILL:
                meta = plan.metas[i]
                # normalised as its elements would be (not when the sample failed for wanting a non-float batch)
                norm = getattr(plan.samples[i], "normalize", None)
                dtype = targets[i].dtype
                norm = norm if contract.is_float(dtype) else None
                self.executor.fill(targets[i], cast_fill(meta.fill_value if meta is not None else 0, dtype, norm))
            elif policy is ErrorPolicy.SKIP:
                pending.holes.append(pos)
        if policy is ErrorPolicy.SKIP and pending.holes:
            with self.cond:
                self._patches.append(pending)
                self.cond.notify_all()
            self._changed()
            return True
        return False

    def _failed_whole(self, pending: Any) -> bool:
        """Does the batch fail as a whole (on_error "stop" or "raise" and a sample failed)?"""
        return self.policy.on_error in (ErrorPolicy.STOP, ErrorPolicy.RAISE) and bool(pending.errors)

    # -- on_error="skip": the front end's side ----------------------------------------------
    def patches_waiting(self) -> bool:
        with self.cond:
            return bool(self._patches)

    def take_patch(self) -> Patch | None:
        """The next batch whose failed samples are dropped, compacted in its slot (the good
        samples move up, keeping their order), waiting for replacements."""
        with self.cond:
            if not self._patches:
                return None
            pending = self._patches.popleft()
        holes = set(pending.holes)
        pending.holes = []
        dropped = [(pending.samples[p], pending.errors[p]) for p in sorted(holes) if p in pending.errors]
        pending.skipped.extend(dropped)
        keep = [p for p in range(len(pending.samples)) if p not in holes]
        view = self.slot_view(pending.slot, pending.dtype or np.dtype("float32"))
        for new, old in enumerate(keep):
            if new != old:
                self.executor.move(view[new], view[old])
        pending.samples = [pending.samples[p] for p in keep]
        pending.metas = [pending.metas[p] for p in keep]
        pending.errors = {}
        return Patch(pending, dropped)

    def refill(self, patch: Patch, samples: list[Any]) -> None:
        """Put ``samples`` (at most ``patch.needed``) where the dropped ones were; with none,
        the batch is delivered short."""
        pending = patch.pending
        if len(samples) < patch.needed:  # the input ran out
            with self.cond:
                self._dry = True
        positions = list(range(len(pending.samples), len(pending.samples) + len(samples)))
        pending.samples.extend(samples)
        pending.metas.extend([None] * len(samples))
        if positions:
            self._run(pending, positions)
        else:
            self._finish(pending)

    def discard(self, patch: Patch, samples: list[Any]) -> list[Any]:
        """Leave out a batch that too few replacements would leave short (``drop_last``):
        its slot goes back, it is passed over as a batch all skipped is (the next batch
        handed out lists its skipped samples); returns its good samples and ``samples``
        (the rest of the input), which are not delivered."""
        pending = patch.pending
        gone = [*pending.samples, *samples]
        pending.samples = []
        with self.cond:
            self._dry = True
        pending.slot.release()
        self._pass_over(pending)
        return gone
