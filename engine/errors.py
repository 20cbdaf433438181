"""The error a user's bad input raises: the launcher prints ``str(e)`` as one line and exits 2 (no traceback)."""


class ConfigError(ValueError):
    """A bad configuration; ``str(e)`` is a single line meant for the user."""
