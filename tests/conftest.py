"""Shared fixtures: tiny HF model folders built once per session."""
import pytest

from tiny_models import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random-weight Llama saved as an HF folder with tokenizer and chat template."""
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama"))


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """Build (and cache per session) a tiny model of a given family."""
    built = {}

    def build(family: str = "llama", **overrides):
        key = (family, tuple(sorted(overrides.items())))
        if key not in built:
            built[key] = str(make_tiny_model(tmp_path_factory.mktemp(f"tiny-{family}"), family, **overrides))
        return built[key]

    return build
