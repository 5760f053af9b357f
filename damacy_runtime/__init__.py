"""What runs in the training process whichever front end serves it, and nothing else.

``Batch`` (DLPack over a slot view), ``BatchInfo`` and ``Slot``; the pipeline interface both
front ends implement; and two small I/O helpers both the daemon and its clients use (the
self-pipe waker of their socket loops, and the probe that asks whether a daemon answers).
It imports neither ``damacy_server`` nor ``damacy_client``: both import it.
"""
