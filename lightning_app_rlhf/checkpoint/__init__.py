"""The checkpoint format: files, checksums, per-role layout, shards."""
