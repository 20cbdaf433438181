"""The errors a user's bad input raises: the launcher prints ``str(e)`` as one line and exits 2 (no traceback).
No imports: the config checks raise them before torch is loaded."""


class ConfigError(ValueError):
    """A bad configuration; ``str(e)`` is a single line meant for the user."""


class CheckpointError(Exception):
    """A checkpoint (or Hugging Face folder) that cannot be used; ``str(e)`` is one line naming the file and the
    problem. engine/checkpoint/format.py re-exports it, where most code imports it from."""
