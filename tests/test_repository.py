"""The README's commands and CI agree, so a green CI means the README works."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(.+?)\n```", readme)


def test_readme_has_the_two_commands():
    demo, tests = _readme_commands()[:2]
    assert "torchrun --nproc-per-node 8" in demo
    assert "pytest" in tests
    for command in (demo, tests):
        assert command.startswith("pip install -r requirements.txt")
        assert "--no-build-isolation" in command


def test_ci_runs_the_readme_test_command_verbatim():
    tests = _readme_commands()[1]
    ci = (ROOT / ".ci" / "run").read_text()
    assert f"TEST_COMMAND='{tests}'" in ci
    assert 'bash -c "$TEST_COMMAND"' in ci


def test_torch_is_pinned_and_never_a_build_requirement():
    assert "torch==2.13.0" in (ROOT / "requirements.txt").read_text().splitlines()
    build = (ROOT / "pyproject.toml").read_text().split("[build-system]")[1].split("\n[")[0]
    assert "torch" not in build
