"""The light client of damacyd (ZeroMQ requests, shared-memory batches)."""
