"""ssh keep-alives for the deepspeed launcher: without them, a host cut off mid-run keeps pdsh's ssh to it (and so
the launcher) waiting as long as the cut lasts, since an idle TCP connection notices nothing. With
``ServerAliveInterval=10`` and ``ServerAliveCountMax=3`` ssh gives up after 30 s of silence from the host, pdsh
reports it and the launcher exits. pdsh's ssh module appends ``PDSH_SSH_ARGS_APPEND`` to every ssh it runs; it is
read on the launching host, so it goes in that shell's environment (not in .deepspeed_env, which the ranks read).
"""

from __future__ import annotations

KEEPALIVE = "-o ServerAliveInterval=10 -o ServerAliveCountMax=3"
VARIABLE = "PDSH_SSH_ARGS_APPEND"


def advice(environ: dict[str, str]) -> str:
    """The line preflight prints for the deepspeed launcher: what to export, or that it is already set."""
    current = environ.get(VARIABLE, "")
    if "ServerAliveInterval" in current:
        return f"deepspeed launcher: {VARIABLE} has ssh keep-alives ({current!r}): a cut host ends the launcher"
    wanted = f"{current} {KEEPALIVE}".strip()
    return (
        f"deepspeed launcher: export {VARIABLE}='{wanted}' before `deepspeed --hostfile ...`, so that a host "
        f"cut off mid-run ends the launcher within 30 s instead of for as long as the cut lasts"
    )
