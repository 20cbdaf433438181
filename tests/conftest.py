"""Session set-up shared by every test."""

import os
import subprocess
from pathlib import Path

# The suite means gloo on the CPU (the project's rule: everything runs there). On a machine with a GPU, CUDA is
# hidden from the test session and every process it starts, before torch can initialise it: otherwise the launcher
# tests' ranks would all pick cuda:0 with nccl (NCCL refuses two ranks on one GPU: "Duplicate GPU detected"), and a
# pytest process that initialised CUDA before forking would break its forked ranks. ENGINE_TEST_CUDA=1 keeps the
# GPUs visible (forked gloo ranks still run on the CPU: engine/parallel/layout/spawn.py).
if os.environ.get("ENGINE_TEST_CUDA") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
# ZeRO-Offload's DeepSpeedCPUAdam is a C++ op DeepSpeed JIT-builds on first use (455 s on 2 cores): the suite uses
# it where it is already built and otherwise DeepSpeed's documented fallback, torch AdamW stepping on the host
# (engine/parallel/dp/zero.py offload_optimizer), so a fresh CI machine never compiles inside a test.
os.environ.setdefault("ENGINE_CPU_ADAM_BUILD", "0")
# One torch thread in every process the suite starts (forked ranks, launcher runs, their children), unless a test
# sets its own: a one-process run would otherwise take both cores of a CI machine, and on a busy machine OpenMP's
# spin-waits cost it several times its work (the parity matrix's 19 one-process references: 64 and 100 s at 2
# threads, 19 s at 1, load 4-5; quiet, 16.5-16.8 s at 2 and 16.5-17.1 s at 1: the tests' models are too small to
# use a second thread). tests/parallel/layout/test_threads.py unsets it to test the engine's own choice.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# The pytest process forks gloo ranks (tests/dist.py). GNU OpenMP, which CPU torch uses for intra-op parallelism,
# is not fork-safe: once the parent has run a multi-threaded op, a child that runs one hangs. So the parent stays
# single-threaded, and each forked rank picks its own thread count.
torch.set_num_threads(1)

# Forked ranks inherit the parent's imports: pay for transformers and torch's lazy modules once, not per rank.
from tests.dist import warm_imports  # noqa: E402

warm_imports()

from tests import checkout_guard  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
_BEFORE = pytest.StashKey[dict]()
_CHANGED = pytest.StashKey[list]()
_SHALLOW = pytest.StashKey[frozenset]()
_CULPRITS = pytest.StashKey[list]()


def _guarded() -> bool:
    # ENGINE_CHECKOUT_GUARD=0 turns the check off, e.g. while a run of your own writes into runs/ during the suite.
    return os.environ.get("ENGINE_CHECKOUT_GUARD", "1") != "0"


def _skipped(config) -> tuple:
    return (Path(config.option.basetemp),) if config.option.basetemp else ()


def pytest_sessionstart(session):
    """Tests write only inside their temporary folders: remember the checkout as it was (tests/checkout_guard.py)."""
    if _guarded():
        session.config.stash[_BEFORE] = checkout_guard.snapshot(ROOT, _skipped(session.config))
        session.config.stash[_SHALLOW] = checkout_guard.shallow(ROOT, _skipped(session.config))
        session.config.stash[_CULPRITS] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After each test's teardown, the checkout's top two levels: the first test that added or removed a name there
    is named in the report (a forked rank or subprocess that outlives its test may still be blamed on a later one)."""
    yield
    stash = item.config.stash
    if _SHALLOW not in stash:
        return
    now = checkout_guard.shallow(ROOT, _skipped(item.config))
    if now != stash[_SHALLOW]:
        added, removed = sorted(now - stash[_SHALLOW]), sorted(stash[_SHALLOW] - now)
        stash[_CULPRITS].append(
            f"{item.nodeid}: " + ", ".join([f"added {n}" for n in added] + [f"removed {n}" for n in removed])
        )
        stash[_SHALLOW] = now


def pytest_sessionfinish(session, exitstatus):
    """Fail the session if any file or folder of the checkout (runs/ and other ignored paths included) was added,
    removed or rewritten by it; pytest_terminal_summary names them."""
    before = session.config.stash.get(_BEFORE, None)
    if before is None:
        return
    changed = checkout_guard.changes(before, checkout_guard.snapshot(ROOT, _skipped(session.config)))
    session.config.stash[_CHANGED] = changed
    if changed:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    changed = config.stash.get(_CHANGED, [])
    if changed:
        terminalreporter.section("tests wrote into the checkout", sep="=", red=True)
        terminalreporter.line(
            f"FAILED: the session changed {len(changed)} path(s) under {ROOT}; a test must write "
            f"only inside tmp_path (e.g. give --train.out_dir; the default is runs/tiny):"
        )
        for line in changed[:50]:
            terminalreporter.line(f"  {line}")
        if len(changed) > 50:
            terminalreporter.line(f"  ... and {len(changed) - 50} more")
        culprits = config.stash.get(_CULPRITS, [])
        if culprits:
            terminalreporter.line("seen first after these tests:")
            for line in culprits[:20]:
                terminalreporter.line(f"  {line}")


@pytest.fixture(autouse=True)
def _no_process_group_left_in_the_parent():
    """A test that initialises torch.distributed in the pytest process (instead of a forked rank) breaks every
    later test: forked ranks inherit the initialised default group and fail with 'initialize the default process
    group twice'. Fail the culprit by name instead, and clean up so the rest of the suite still runs."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail(
            "this test left a torch.distributed process group in the pytest process; run the Trainer in "
            "a forked rank (tests/dist.run_ranks)"
        )


@pytest.fixture
def tmpfs():
    """``mount(path, size=..., nr_inodes=...)``: a tmpfs at ``path`` (inside tmp_path), unmounted at teardown."""
    mounted: list[Path] = []

    def mount(path: Path, **options) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        opts = ",".join(f"{k}={v}" for k, v in options.items())
        out = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True)
        if out.returncode != 0:
            why = f"cannot mount a tmpfs (needs root or CAP_SYS_ADMIN): {out.stderr.strip()}"
            if os.environ.get("CI") == "true":
                pytest.fail(why)
            pytest.skip(why)
        mounted.append(path)
        return path

    yield mount
    for path in reversed(mounted):
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture
def live_pid():
    """A live process on this host that is neither this one nor its parent (the directory locks of
    engine/checkpoint/lock.py count both as the same job's own): a rival job's pid for lock tests."""
    proc = subprocess.Popen(["sleep", "300"])
    yield proc.pid
    proc.kill()
    proc.wait()
