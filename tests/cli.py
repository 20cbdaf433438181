"""A launcher script run as a user runs it, ``python launch/X.py ARGS``, in a fork of the test process.

A fresh interpreter spends ~3 s (idle) to ~10 s (loaded 2-core machine) importing torch and the engine before a
bad-config test reaches its one line; the suite ran over a hundred such processes. The fork already holds those
imports. The script still runs whole as ``__main__`` (``runpy``), with its own argv, working directory and
environment, writing to its own stdout and stderr, and ending with its own exit status (``sys.exit`` or the
``os._exit`` of launch/pretrain.py; an uncaught exception prints its traceback and exits 1, as python does), so a
test sees what the user would. What a fork cannot show, the interpreter's start-up and the script's module-level
imports in a clean process, the tests that start real processes (launchers, multi-rank jobs) still cover.

Forking is safe here for the reasons tests/dist.py's forked ranks are: the session runs torch with one thread
(tests/conftest.py) and never initialises torch.distributed in the pytest process.
"""

from __future__ import annotations

import io
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def drop_file_permission_override() -> None:
    """Drop CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from this process (capset(2), what ``setpriv`` does before an
    exec): root then meets file modes as any user does (a mode-000 file cannot be read), and keeps everything else.
    Nothing to drop for a user without them."""
    import ctypes

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    libc = ctypes.CDLL(None, use_errno=True)
    header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3: two 32-bit words
    if libc.capget(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    dac = (1 << 1) | (1 << 2)  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
    data[0].effective &= ~dac
    data[0].permitted &= ~dac
    data[0].inheritable &= ~dac
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def _child(
    script: str, args: list[str], cwd: Path, env: dict | None, out: int, err: int, stdin: int, as_user: bool
) -> None:
    """In the fork: become ``python script args`` and never return."""
    code = 1
    try:
        if as_user:
            drop_file_permission_override()
        os.dup2(out, 1)
        os.dup2(err, 2)
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
        os.dup2(stdin, 0)
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(cwd)
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        sys.argv = [script, *args]
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001  what python prints for an uncaught exception, then exit status 1
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def run_script(
    script: str,
    *args,
    cwd: Path = ROOT,
    env: dict | None = None,
    timeout: float = 300,
    stdin: str | None = None,
    as_user: bool = False,
) -> subprocess.CompletedProcess:
    """``python script args`` (``script`` relative to ``cwd``) in a fork; what ``subprocess.run(...,
    capture_output=True, text=True)`` returns, ``stdin`` its ``input`` (none: an empty stdin). The fork is killed, and
    TimeoutExpired raised, after ``timeout``. ``as_user``: file modes bind it as they bind a user, also when the tests
    run as root (drop_file_permission_override)."""
    args = [str(a) for a in args]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, tempfile.TemporaryFile() as given:
        given.write((stdin or "").encode())
        given.seek(0)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(script, args, Path(cwd), env, out.fileno(), err.fileno(), given.fileno(), as_user)
        deadline = time.monotonic() + timeout
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise subprocess.TimeoutExpired([sys.executable, script, *args], timeout)
            time.sleep(0.02)
        code = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(
            [sys.executable, script, *args],
            code,
            out.read().decode(errors="replace"),
            err.read().decode(errors="replace"),
        )


def launch(script: str, *args: str) -> subprocess.CompletedProcess:
    """``python launch/SCRIPT args`` in a fork of the test process (tests/cli.py: the same script, argv, exit
    status and output, without ~3-10 s of interpreter start and imports per call)."""
    return run_script(f"launch/{script}", *args, timeout=600)


def one_error_line(out: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit 2 with exactly one ``error:`` line holding every needle, and no traceback."""
    lines = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert out.returncode == 2 and len(lines) == 1, out.stdout[-2000:] + out.stderr[-3000:]
    assert "Traceback" not in out.stderr + out.stdout, out.stderr[-3000:]
    assert all(n in lines[0] for n in needles), lines[0]
    return lines[0]


def without_file_permission_override() -> list[str]:
    """A command prefix under which mode 000 stops reads: nothing for a plain user; for root, setpriv dropping
    CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH (root reads any file otherwise)."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: a mode-000 file stays readable")
    caps = "-dac_override,-dac_read_search"
    return ["setpriv", "--bounding-set", caps, "--inh-caps", caps]
