"""DeepSpeed hostfiles: one host per line, ``HOSTNAME slots=N`` (N processes on that host), ``#`` comments.

The format is DeepSpeed's (``deepspeed.launcher.runner._parse_hostfile``), read more strictly so that a typo is
caught before a job starts: DeepSpeed accepts ``node1 slots=8x`` as 8 slots and ``node1 slots=0``; here every
non-blank line must be exactly ``HOSTNAME slots=N`` with N >= 1, optionally followed by a ``# comment``, and a
host may appear once. Errors name the file, the line number and the line, and say what is valid.

A host must be a host name (RFC 1123 labels; ``_`` allowed, as in /etc/hosts) or an IPv4/IPv6 address, with an
optional ``user@``: ssh and pdsh take their argument list from it, and a "host" such as ``-oProxyCommand=...`` or
``-Elog`` would reach ssh as an option and run or write what it says (DeepSpeed's launcher passes it on).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path

# A host as ssh and pdsh take it: a name or address, optionally user@; IPv6 addresses keep their colons.
_LINE = re.compile(r"^(?P<host>[A-Za-z0-9_.:@\[\]-]+)\s+slots=(?P<slots>\d+)$")
VALID = "each line must be 'HOSTNAME slots=N' with N >= 1 (blank lines and '#' comments are allowed)"
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9])?"
_NAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")
_USER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def host_problem(host: str) -> str | None:
    """Why ``host`` ([user@]name-or-address) is not one ssh can only read as a destination; None if it is."""
    if host.startswith("-"):
        return "it would reach ssh as an option"
    user, at, name = host.rpartition("@")
    if at and not _USER.fullmatch(user):
        return f"user {user!r} is not a user name"
    try:
        ipaddress.ip_address(name[1:-1] if name.startswith("[") and name.endswith("]") else name)
        return None
    except ValueError:
        pass
    if len(name) > 253 or not _NAME.fullmatch(name):
        return "it is not a host name or address"
    return None


class HostfileError(ValueError):
    """A hostfile that cannot be used; ``str(e)`` is one line naming the file, the line and what is valid."""


@dataclass(frozen=True)
class Host:
    name: str
    slots: int  # processes (GPUs) to start on this host
    line: int  # 1-based line number in the hostfile, for messages


def parse_hostfile_text(text: str, source: str = "hostfile") -> list[Host]:
    """Hosts in file order. ``source`` names the file in errors."""
    hosts: list[Host] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _LINE.match(line)
        if match is None:
            raise HostfileError(f"{source} line {number}: {raw.strip()!r} is not valid; {VALID}")
        name, slots = match["host"], int(match["slots"])
        problem = host_problem(name)
        if problem:
            raise HostfileError(
                f"{source} line {number}: host {name!r} is not valid ({problem}); a host is a name "
                f"such as node1 or node1.cluster, or an IPv4/IPv6 address, optionally user@ first"
            )
        if slots < 1:
            raise HostfileError(f"{source} line {number}: {raw.strip()!r} has slots={slots}; {VALID}")
        if name in seen:
            raise HostfileError(
                f"{source} line {number}: host {name!r} is already listed on line {seen[name]}; "
                f"list each host once with all its slots"
            )
        seen[name] = number
        hosts.append(Host(name, slots, number))
    if not hosts:
        raise HostfileError(f"{source} lists no hosts; {VALID}")
    return hosts


def parse_hostfile(path: str | Path) -> list[Host]:
    """Read and check a hostfile; a missing file is a HostfileError too."""
    path = Path(path)
    if path.is_dir():
        raise HostfileError(f"hostfile '{path}' is a directory; give a file with 'HOSTNAME slots=N' lines")
    if not path.is_file():
        raise HostfileError(f"hostfile '{path}' does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise HostfileError(f"hostfile '{path}' is not UTF-8 text (byte {e.start}); {VALID}") from None
    return parse_hostfile_text(text, str(path))
