"""The README's promises that code can check: its config reference and its two commands."""

import re
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_config_reference_in_readme_is_current():
    reference = runpy.run_path(str(ROOT / "tools" / "config_reference.py"))["reference"]()
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- config-reference:start -->\n(.*)<!-- config-reference:end -->", text, re.S)
    assert block and block.group(1) == reference, "run tools/config_reference.py and paste its output"


def test_ci_runs_the_readme_test_command():
    text = (ROOT / "README.md").read_text()
    command = 'pip install -e ".[test]" && pytest'
    assert command in text and command in (ROOT / ".ci" / "run").read_text()
    assert "pip install -e . && visppo train" in text
