"""Decode: a read unit's bytes through its codec chain into an array (chunks), and the
numeric contract every path casts by (contract)."""
