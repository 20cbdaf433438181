"""The errors a user's bad input raises: the launcher prints ``str(e)`` as one line and exits 2 (no traceback).
No imports: the config checks raise them before torch is loaded."""

# A message quoting the user's value can be as long as the value (a 39 MB line for a YAML alias bomb, before its
# size was bounded): the line keeps its start (the key) and its end (what would be valid), at most MAX_LINE long.
MAX_LINE = 2000


def _clipped(message) -> str:
    text = str(message)
    if len(text) <= MAX_LINE:
        return text
    cut = len(text) - MAX_LINE + 40
    return f"{text[: MAX_LINE * 3 // 4]} ...[{cut} characters cut]... {text[-(MAX_LINE // 4 - 40) :]}"


class ConfigError(ValueError):
    """A bad configuration; ``str(e)`` is a single line meant for the user, at most MAX_LINE characters."""

    def __init__(self, message="", *args):
        super().__init__(_clipped(message), *args)


class CheckpointError(Exception):
    """A checkpoint (or Hugging Face folder) that cannot be used; ``str(e)`` is one line naming the file and the
    problem, at most MAX_LINE characters. engine/checkpoint/format.py re-exports it, where most code imports it
    from."""

    def __init__(self, message="", *args):
        super().__init__(_clipped(message), *args)
