"""visppo.errors: one home for the errors, the config's names a re-export for users' code only."""

import ast
from pathlib import Path

import pytest

import visppo.config
from visppo.errors import ConfigError, RunError, Stopped, UserError

ROOT = Path(__file__).resolve().parents[1]
ERRORS = {"UserError", "ConfigError", "RunError", "Stopped"}
NOT_YET: set[str] = set()
"""Files that still import the errors from visppo.config (none now): switch each to visppo.errors."""


def test_the_config_re_exports_the_same_classes():
    assert (visppo.config.UserError, visppo.config.ConfigError, visppo.config.RunError,
            visppo.config.Stopped) == (UserError, ConfigError, RunError, Stopped)


def test_what_each_error_is():
    assert issubclass(ConfigError, UserError) and issubclass(UserError, ValueError)
    assert issubclass(RunError, RuntimeError) and not issubclass(RunError, UserError)
    stopped = Stopped("stopped by SIGTERM", 15)
    assert stopped.signum == 15 and str(stopped) == "stopped by SIGTERM"
    assert not issubclass(Stopped, Exception), "an env's or import's `except Exception` would report the signal"


def _uses_of_the_re_export(path: Path) -> list[str]:
    uses = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "visppo.config":
            uses += [a.name for a in node.names if a.name in ERRORS]
        elif isinstance(node, ast.Attribute) and node.attr in ERRORS and isinstance(node.value, ast.Name) \
                and node.value.id in ("config", "visppo_config"):
            uses.append(node.attr)
    return uses


@pytest.mark.parametrize("folder", ["visppo", "tools", "tests"])
def test_visppo_tools_and_tests_import_the_errors_from_visppo_errors(folder):
    found = {}
    for path in sorted((ROOT / folder).glob("*.py")):
        rel = str(path.relative_to(ROOT))
        if rel not in NOT_YET and path.name not in ("config.py", "test_errors.py"):
            uses = _uses_of_the_re_export(path)
            if uses:
                found[rel] = uses
    assert not found, f"import these from visppo.errors, not visppo.config: {found}"
