"""The Zarr v3 format: metadata, data types, chunk keys, codecs, shard layout, NGFF."""
