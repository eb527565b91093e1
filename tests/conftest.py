"""A strict test environment: warnings are errors (pyproject), deterministic torch, one thread
per process (the CI machine has two cores and multi-rank tests share them), hypothesis profiles."""

import os
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
