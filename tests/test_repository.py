"""The README's commands and CI agree, so a green CI means the README works; the tests
share their helpers through one module."""

import ast
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


def _imported_modules(tree: ast.Module) -> list[str]:
    """Every module an import names, ``from tests import support`` as ``tests.support``."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            if node.module == "tests":
                names += [f"tests.{alias.name}" for alias in node.names]
    return names


def test_test_modules_share_helpers_through_tests_support_only():
    """No test module imports another (pytest imports each once, as the module it runs; an
    import from another makes a second copy, and couples the two): what tests share lives
    in tests/support.py, imported as ``tests.support``."""
    tests = ROOT / "tests"
    local = {path.stem for path in tests.glob("*.py")}
    wrong = []
    for path in sorted(tests.glob("*.py")):
        for name in _imported_modules(ast.parse(path.read_text(), str(path))):
            parts = name.split(".")
            in_tests = parts[0] == "tests" and len(parts) > 1
            sibling = parts[0] in local and len(parts) == 1  # imported bare, from tests/
            if (in_tests and name != "tests.support") or sibling:
                wrong.append(f"{path.name} imports {name}")
    assert not wrong, "\n".join(wrong)
