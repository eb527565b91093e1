"""Every public name is importable and documented (STYLE: one explicit public surface)."""

import importlib
import inspect

import pytest

import fnzero

PACKAGES = ["fnzero", "fnzero.config", "fnzero.optim", "fnzero.schedules", "fnzero.checkpoint", "fnzero.testing",
            "fnzero.monitor", "fnzero.memory", "fnzero.inference", "fnzero.moe", "fnzero.autotune"]


@pytest.mark.parametrize("name", PACKAGES)
def test_every_public_name_exists_and_is_documented(name):
    mod = importlib.import_module(name)
    assert mod.__doc__ and mod.__doc__.strip(), f"{name} has no module docstring"
    assert mod.__all__, f"{name} declares no __all__"
    for public in mod.__all__:
        obj = getattr(mod, public)  # raises if missing
        if inspect.isfunction(obj) or inspect.isclass(obj):
            assert getattr(obj, "__doc__", None), f"{name}.{public} has no docstring"


def test_top_level_exposes_the_issue_names():
    for n in ["load_config", "Config", "shard", "train_step", "TrainState", "optim", "schedules", "init_distributed",
              "memory", "checkpoint", "remat", "jit"]:
        assert n in fnzero.__all__
    assert callable(fnzero.optim.from_config) and callable(fnzero.schedules.from_config)


def test_import_fnzero_alone_exposes_checkpoint():
    # The README's `fnzero.checkpoint.save` must work without anything importing fnzero.testing first.
    import subprocess
    import sys

    code = "import sys, fnzero; fnzero.checkpoint.save; fnzero.checkpoint.load; assert 'fnzero.testing' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
