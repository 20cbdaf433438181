"""A private sshd on a free loopback port with a throw-away key, for tests of launchers that go through ssh.

Nothing outside the test's temporary folder changes except /run/sshd, sshd's privilege-separation directory,
created when missing. The client side takes the key and port as options (ssh reads ~/.ssh from the passwd entry,
not $HOME, so the user's own ssh set-up is never touched). Skips, saying what is missing, where sshd cannot run:
install with `apt-get install -y openssh-server openssh-client pdsh` (.ci/run does; under CI=true they fail instead).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from engine.parallel.layout.spawn import free_port
from tests.hosts import unavailable

SSHD = "/usr/sbin/sshd"


@dataclass
class Sshd:
    port: int
    key: Path

    def options(self) -> list[str]:
        return [
            "-i",
            str(self.key),
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
            "-o",
            "LogLevel=ERROR",
            "-o",
            "BatchMode=yes",
            "-o",
            "ConnectTimeout=5",
        ]

    def ssh_command(self) -> list[str]:
        return ["ssh", "-p", str(self.port), *self.options()]

    def pdsh_env(self) -> dict[str, str]:
        """Environment for the deepspeed launcher: pdsh's ssh module appends these options (the port comes from
        the launcher's --ssh_port)."""
        return {**os.environ, "PDSH_SSH_ARGS_APPEND": " ".join(self.options())}


def _config(folder: Path, port: int) -> Path:
    path = folder / "sshd_config"
    path.write_text(
        "\n".join(
            [
                f"Port {port}",
                "ListenAddress 127.0.0.1",
                f"HostKey {folder / 'host_key'}",
                f"AuthorizedKeysFile {folder / 'authorized_keys'}",
                f"PidFile {folder / 'sshd.pid'}",
                "StrictModes no",
                "UsePAM no",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "PermitRootLogin prohibit-password",
                "",
            ]
        )
    )
    return path


@pytest.fixture(scope="module")
def local_sshd(tmp_path_factory):
    missing = [name for name in ("ssh", "ssh-keygen") if shutil.which(name) is None]
    missing += [SSHD] if not Path(SSHD).exists() else []
    if missing:
        unavailable(f"needs {', '.join(missing)}: apt-get install -y openssh-server openssh-client")
    try:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    except OSError as e:
        unavailable(f"sshd needs its privilege-separation directory /run/sshd and it cannot be made: {e}")
    folder = tmp_path_factory.mktemp("sshd")
    for name in ("id", "host_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(folder / name)], check=True)
    shutil.copy(folder / "id.pub", folder / "authorized_keys")
    server = Sshd(free_port(), folder / "id")
    log = (folder / "sshd.log").open("w")
    proc = subprocess.Popen(
        [SSHD, "-D", "-e", "-f", str(_config(folder, server.port))], stdout=log, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 15
        while subprocess.run([*server.ssh_command(), "localhost", "true"], capture_output=True).returncode != 0:
            if proc.poll() is not None or time.monotonic() > deadline:
                unavailable(f"a private sshd would not accept a key login: {(folder / 'sshd.log').read_text()[-500:]}")
            time.sleep(0.2)
        yield server
    finally:
        proc.terminate()
        proc.wait()
