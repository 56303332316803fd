"""README.md is a newcomer's entry point that keeps its sections and links; docs/configuration.md documents
every environment variable the code reads and every engine argument."""

import re
from pathlib import Path

import pytest

from inference.config import EngineArgs

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
CONFIGURATION = (REPO / "docs" / "configuration.md").read_text()
# env.get("X"), os.environ["X"], os.getenv("X"), and the ("ENGINE_X", cast) pairs of the engine command.
ENV_READ = re.compile(
    r"""(?:environ|env)(?:\.get\(|\[)\s*["']([A-Z][A-Z0-9_]+)["']|getenv\(\s*["']([A-Z][A-Z0-9_]+)["']"""
    r"""|\(\s*["'](ENGINE_[A-Z0-9_]+)["']\s*,"""
)
NOT_CONFIGURATION = {"PYTHONPATH", "PATH", "HOME", "HOSTNAME"}


def env_vars_read_by_the_code() -> set[str]:
    found = set()
    for root in ("platform", "inference", "kernels/tessera_kernels"):
        for path in (REPO / root).rglob("*.py"):
            for match in ENV_READ.finditer(path.read_text()):
                found.add(next(g for g in match.groups() if g))
    return found - NOT_CONFIGURATION


def test_every_environment_variable_is_in_the_configuration_tables():
    found = env_vars_read_by_the_code()
    assert {"PORT", "MODEL", "REDIS_URL", "SECRET_KEY"} <= found  # the scan itself works
    missing = sorted(v for v in found if f"`{v}`" not in CONFIGURATION)
    assert not missing, f"docs/configuration.md's tables lack {missing}"


def test_every_engine_argument_is_documented():
    missing = sorted(n for n in EngineArgs.names() - {"model"} if f"| `{n}` |" not in CONFIGURATION)
    assert not missing, f"docs/configuration.md's engine argument table lacks {missing}"


def test_the_readme_points_to_the_whole_configuration():
    assert "](docs/configuration.md)" in README


def test_the_readme_keeps_its_sections_and_the_two_commands():
    for heading in (
        "## Two commands",
        "## Using it with the `openai` client",
        "## Running a batch",
        "## Configuration",
        "## Scaling out",
        "## Benchmarks",
        "## Tests",
    ):
        assert heading in README
    assert "make run" in README and "make test" in README


@pytest.mark.parametrize("name", ["README.md", "docs/configuration.md"])
def test_local_links_and_images_exist(name):
    page = REPO / name
    for target in re.findall(r"\]\(((?!https?://)[^)#]+)\)", page.read_text()):
        if not target.startswith("docs/screenshots/"):  # screenshots are written by the browser tests
            assert (page.parent / target).exists(), f"{name} links to missing {target}"
