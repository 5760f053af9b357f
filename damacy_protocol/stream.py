"""One session's stream of samples and batches, counted alike on both sides.

Each side applies the messages it sends and the ones it receives, in the order they travel,
so the client and the daemon hold the same state without asking each other:

- credits: the daemon grants ``Welcome.credits`` (the session's ``lookahead_samples``); a
  push of n samples spends n; a sample's credit returns when a reply names it gone from the
  session: delivered (``BatchReady.seqs``), dropped (``Consumed.seqs``) or used up by a failed
  batch (``Failed.consumed``). A push beyond the credits is refused on either side.
- pushes and finality: how many pushes, whether the last said the client's input is
  exhausted (for now), and which push that was.
- pops: the pops not yet answered, in the order sent; each is answered in turn, by a batch
  or by why it has none (its batch failed, or the stream is drained).
- lent batches: the batch ids handed to the client and not yet released. A release of a
  batch the session does not hold is refused on either side.

Whether a pop may be told "drained" is the stream's to say in part (:meth:`input_final`:
the client's input was exhausted when it asked, or a push sent after the pop said so) and
the engine's in part (nothing queued, nothing in flight); a client tells a stale "drained"
(one that predates pushes it has sent since) by :meth:`pushed_since`.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from damacy_protocol import messages as m
from damacy_protocol.errors import ProtocolError


class Stream:
    def __init__(self) -> None:
        self.granted = 0
        self.outstanding = 0  # samples pushed and not yet named gone by a reply
        self.pushes = 0
        self.final = False  # the last push said the client's input is exhausted (for now)
        self.final_at = -1  # the number of that push
        self.pops: deque[m.Pop] = deque()  # not yet answered, in order
        self.lent: set[int] = set()  # batch ids handed out and not released

    @property
    def credits(self) -> int:
        return self.granted - self.outstanding

    # -- requests (the client's sends, the daemon's receipts) -------------------------------
    def request(self, msg: Any) -> None:
        """Apply a request; :class:`ProtocolError` (nothing applied) when the stream refuses it."""
        if isinstance(msg, m.Push):
            n = len(msg.samples)
            if n > self.credits:
                raise ProtocolError(
                    f"a push of {n} samples exceeds the {self.credits} credits this session holds "
                    f"(lookahead_samples={self.granted}; {self.outstanding} pushed samples are still in the session)"
                )
            self.outstanding += n
            self.pushes += 1
            self.final = msg.final
            if msg.final:
                self.final_at = self.pushes
        elif isinstance(msg, m.Pop):
            self.pops.append(msg)
        elif isinstance(msg, m.Release):
            if msg.batch_id not in self.lent:
                raise ProtocolError(f"release of batch {msg.batch_id}, which this session does not hold")
            self.lent.discard(msg.batch_id)

    # -- replies (the daemon's sends, the client's receipts) --------------------------------
    def reply(self, msg: Any) -> m.Pop | None:
        """Apply a reply; returns the pop it answers, if it answers one (pops are answered in
        the order they were sent: a reply naming another pop breaks the contract)."""
        if isinstance(msg, m.Consumed):
            self.outstanding -= len(msg.seqs)
            return None
        if not isinstance(msg, (m.BatchReady, m.Failed)) or not self.pops or msg.reply_to != self.pops[0].id:
            if isinstance(msg, m.BatchReady) or (isinstance(msg, m.Failed) and any(p.id == msg.reply_to for p in self.pops)):
                raise ProtocolError(f"{type(msg).__name__} answers pop {msg.reply_to} before the pops sent ahead of it")
            if isinstance(msg, m.Failed):  # another request's failure (a push refused, a bad release)
                self.outstanding -= len(msg.consumed)
            return None
        pop = self.pops.popleft()
        if isinstance(msg, m.BatchReady):
            self.outstanding -= len(msg.seqs)
            self.lent.add(msg.batch_id)
        else:
            self.outstanding -= len(msg.consumed)
        return pop

    # -- questions ----------------------------------------------------------------------------
    def input_final(self, pop: m.Pop) -> bool:
        """Was the client's input exhausted for ``pop``: it said so when it asked, or a push
        sent after it did?"""
        return self.final and (pop.final or self.final_at > pop.pushes)

    def pushed_since(self, pop: m.Pop) -> bool:
        """Were pushes sent after ``pop``? Then a "drained" answer to it predates them."""
        return self.pushes > pop.pushes
