"""The batch engine and what it owns: batches planned, executed and delivered in order with
the error policies (batches), the slots they are assembled into (slots), and the memory
budget and stage figures executors share (budget)."""
