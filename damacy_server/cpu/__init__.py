"""The CPU executor: reads, decodes and assembles a plan into a slot (executor), the state of
one plan being executed (run), units shared by the batches that need them while decoded
(inflight), decode tasks through the native C loop (tasks) and the copy tables it runs, with
their numpy reference (optable)."""
