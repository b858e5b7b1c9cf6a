"""Every adapter vd ships, and the plug-in path, pass the shipped conformance class."""

from pathlib import Path

import pytest

from vd.models import load_model
from vd.testing import ModelConformance

PLUGINS = Path(__file__).parent.parent / "plugins"  # tests/plugins


class TestTinyLlama(ModelConformance):
    @pytest.fixture(scope="class")
    @classmethod
    def model(cls):
        return load_model("tiny-llama")


class TestTinyQwen2Float32(ModelConformance):
    @pytest.fixture(scope="class")
    @classmethod
    def model(cls):
        return load_model("tiny-qwen2", dtype="float32")


class TestPluginFile(ModelConformance):
    @pytest.fixture(scope="class")
    @classmethod
    def model(cls):
        return load_model(f"{PLUGINS / 'perturb.py'}:factory")


@pytest.mark.slow
class TestSmolLM2(ModelConformance):
    @pytest.fixture(scope="class")
    @classmethod
    def model(cls, smollm2):
        return smollm2


class TestPluginWithEngineEnvironment(ModelConformance):
    """A plug-in that adds its engine's build to the golden's environment (`environment()`)."""

    @pytest.fixture(scope="class")
    @classmethod
    def model(cls):
        return load_model(f"{PLUGINS / 'misbehaving.py'}:built")
