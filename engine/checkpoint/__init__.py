"""Sharded checkpoints: what a rank saves, the on-disk format, publishing, locking, signals."""
