"""A strict test environment: warnings are errors (pyproject), deterministic torch, one thread
per process (the CI machine has two cores and multi-rank tests share them), hypothesis profiles."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(__file__))  # spawned ranks import the world functions from here

torch.use_deterministic_algorithms(True)
torch.set_num_threads(1)

# The default suite (what CI runs) draws the same examples every run, so a red run is reproducible
# and never a new random draw; `HYPOTHESIS_PROFILE=thorough` explores fresh examples, many more.
settings.register_profile(
    "default", deadline=None, max_examples=25, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("thorough", deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def fresh_dynamo():
    """Reset dynamo around a test: each test compiles its own closures, and dynamo's per-code
    cache would otherwise count them as recompilations of one function and hit its limit."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# The test command hands whole modules to the two workers (`--dist loadscope`: a module's
# module-scoped worlds, hosts and jobs start once, on one worker). A module handed out last runs
# alone while the other worker idles, so the longest ones (measured on the 2-core CI machine,
# about 30-120 s each) go first, in this order; the rest keep their collection order.
LONG_MODULES_FIRST = (
    "test_examples", "test_zero_multiprocess", "test_launch_hostfile", "test_jit_step", "test_benchmarks",
    "test_launch_faults", "test_jit_ladder", "test_jit_units", "test_jit", "test_autotune", "test_frozen_sharded",
    "test_checkpoint_atomic", "test_moe_sharded", "test_hf_models", "test_generate", "test_peft",
    "test_tensor_parallel", "test_mics", "test_zeropp",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_MODULES_FIRST)}

    def key(item):
        module = item.module.__name__.rpartition(".")[2] if item.module is not None else ""
        return rank.get(module, len(rank))

    items.sort(key=key)  # stable: each module's own order is kept


def pytest_terminal_summary(terminalreporter):
    """The version of every package pyproject.toml names, as this run installed it: CI installs the
    newest each range admits, so its log says what the suite passed (or failed) with."""
    from importlib.metadata import PackageNotFoundError, version

    import _readme

    found = []
    for name in sorted(_readme.dependency_ranges(build=False)):
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            pass
    terminalreporter.write_line("dependencies: " + ", ".join(found))


# Nothing a test makes may outlive it. A directory from `tempfile.mkdtemp` or a file from `mkstemp` /
# `NamedTemporaryFile(delete=False)` is the test's to remove (pytest's `tmp_path`, which pytest itself
# prunes to the last three runs, is the usual way): Python announces each one it makes (audit events
# `tempfile.mkdtemp`, `tempfile.mkstemp`), so a test that leaves one fails at its teardown naming it,
# and one made while the test modules are imported fails the first test. Module- and session-scoped
# fixtures are set up before a test's own, so what they make is not counted. Nor may a test leave a
# new entry in the checkout's root (the working directory of the suite and of the examples it runs):
# checked after each test in a run of one process, and once at the end of an xdist run, whose two
# workers share the root (a per-test check there would blame a test for what the other worker's made).
_MADE: list[str] = []
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ROOT_OWN = {".hypothesis", ".pytest_cache"}  # hypothesis' example database, pytest's cache


def _record_temp(event: str, args: tuple) -> None:
    if event in ("tempfile.mkdtemp", "tempfile.mkstemp"):
        _MADE.append(args[0])


sys.addaudithook(_record_temp)  # for the process's life: audit hooks cannot be removed


def _left(since: int) -> list[str]:
    # multiprocessing's own `pymp-*` directory is the process's, made on first use and removed at exit.
    return [p for p in _MADE[since:] if os.path.lexists(p) and not os.path.basename(p).startswith("pymp-")]


@pytest.fixture(scope="session", autouse=True)
def _nothing_made_at_import():
    left = _left(0)
    assert not left, f"made by tempfile while the test modules were imported, and never removed: {left}"


def _new_in_root(before: set[str]) -> list[str]:
    return sorted(set(os.listdir(_ROOT)) - before - _ROOT_OWN)


_XDIST_WORKER = "PYTEST_XDIST_WORKER" in os.environ
_ROOT_AT_START = pytest.StashKey[set]()


@pytest.fixture(autouse=True)
def _nothing_left_behind(_nothing_made_at_import):
    since, root = len(_MADE), set(os.listdir(_ROOT))
    yield
    left = _left(since)
    assert not left, f"this test left what it made with tempfile: {left}; use tmp_path, or remove it"
    new = [] if _XDIST_WORKER else _new_in_root(root)
    assert not new, f"this test left {new} in {_ROOT}; write under tmp_path"


def pytest_sessionstart(session):
    if not _XDIST_WORKER:
        session.config.stash[_ROOT_AT_START] = set(os.listdir(_ROOT))


def pytest_sessionfinish(session, exitstatus):
    if _XDIST_WORKER or _ROOT_AT_START not in session.config.stash:
        return
    new = _new_in_root(session.config.stash[_ROOT_AT_START])
    if new:
        session.config.pluginmanager.get_plugin("terminalreporter").write_line(
            f"\nthe suite left {new} in {_ROOT}: a test must write under tmp_path", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# DeepSpeed itself, for the tests that run it (tests/_ds_*_runner.py): once per session.
@pytest.fixture(scope="session")
def deepspeed_python() -> str:
    """An interpreter that imports DeepSpeed: FNZERO_DEEPSPEED_PYTHON, else this one."""
    exe = os.environ.get("FNZERO_DEEPSPEED_PYTHON")
    if not exe:
        if importlib.util.find_spec("deepspeed") is None:
            pytest.skip("DeepSpeed is not importable here; set FNZERO_DEEPSPEED_PYTHON to an interpreter that has it")
        exe = sys.executable
    r = subprocess.run([exe, "-c", "import deepspeed; print(deepspeed.__version__)"], capture_output=True, text=True,
                       env={**os.environ, "DS_ACCELERATOR": "cpu"}, timeout=300)
    if r.returncode != 0:
        pytest.skip(f"{exe} cannot import deepspeed: {r.stderr.strip().splitlines()[-1:]}")
    return exe
