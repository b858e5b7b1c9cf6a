"""A tiny model loaded once for the workflow tests, and a perturbed build of it."""

import importlib.util
from pathlib import Path

import pytest

from vd.models import load_model

PERTURB = Path(__file__).parent.parent / "plugins" / "perturb.py"


@pytest.fixture(scope="session")
def tiny():
    return load_model("tiny-llama")


@pytest.fixture(scope="session")
def perturbed():
    """tiny-llama off by one ULP in one element at step 3 (tests/plugins/perturb.py)."""
    spec = importlib.util.spec_from_file_location("perturb_for_workflow", PERTURB)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.factory(device="cpu", dtype="bfloat16")
