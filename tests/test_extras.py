"""visppo.extras: an optional extra is found missing before anything is imported, in one line."""

import sys

import pytest

from visppo import extras
from visppo.errors import ConfigError


def test_a_module_that_cannot_be_imported_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "colorsys", None)  # installed (stdlib), but as if it were not
    assert extras.missing(("colorsys", "os", "no_such_module_here")) == ["colorsys", "no_such_module_here"]


def test_require_names_the_extra_and_its_install_command(monkeypatch):
    extras.require("deploy", ("os",), "anything")  # present: nothing happens
    with pytest.raises(ConfigError) as info:
        extras.require("deploy", ("no_such_module_here", "os"), "visppo export --format onnx")
    message = str(info.value)
    assert "\n" not in message and message.startswith("visppo export --format onnx needs the deploy extra")
    assert "(no_such_module_here not installed)" in message and 'pip install -e ".[deploy]"' in message


def test_every_extra_is_in_pyproject():
    from pathlib import Path

    import tomllib

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    declared = project["optional-dependencies"]
    for extra, modules in extras.EXTRAS.items():
        packages = " ".join(declared[extra])
        assert all(m in packages for m in modules), extra
        assert all(m in " ".join(declared["test"]) for m in modules), f"the test extra lacks {extra}'s modules"
