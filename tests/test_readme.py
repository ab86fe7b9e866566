"""The README's promises that code can check: it stays a front door (short, its two commands),
the configuration reference in docs/ is the code's, and no relative link in the docs is broken."""

import importlib.util
import re
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINES = 300


def _config_reference():
    """tools/config_reference.py as a module (tools/ is not a package; sys.path stays as it is)."""
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "tools" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_config_reference_in_docs_is_current():
    tool = _config_reference()
    path = ROOT / tool.DOC
    text = path.read_text()
    assert tool.current_block(text) is not None, f"{tool.DOC} lost its {tool.START} ... {tool.END} markers"
    assert text == tool.rewrite(text), f"{tool.DOC} is out of date with visppo/config.py: run {tool.FIX}"


def test_config_reference_check_of_a_missing_file_is_bad_input_not_out_of_date(tmp_path, capsys):
    assert _config_reference().main(["--check", str(tmp_path / "nowhere.md")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot read") and len(err.strip().splitlines()) == 1, err


def test_config_reference_rewrite_touches_only_the_block():
    tool = _config_reference()
    text = f"# title\n\nbefore\n{tool.START}\nstale\n{tool.END}\nafter\n"
    new = tool.rewrite(text, "| fresh |\n")
    assert new == f"# title\n\nbefore\n{tool.START}\n| fresh |\n{tool.END}\nafter\n"
    assert tool.rewrite(new, "| fresh |\n") == new


def test_config_reference_tool_writes_and_checks_a_file(tmp_path):
    tool = _config_reference()
    page = tmp_path / "configuration.md"
    page.write_text(f"# keys\n\n{tool.START}\nstale\n{tool.END}\n")
    assert tool.main(["--check", str(page)]) == 1
    assert tool.main(["--write", str(page)]) == 0
    assert tool.main(["--check", str(page)]) == 0
    assert tool.current_block(page.read_text()) == tool.reference()


def test_ci_runs_the_readme_test_command():
    text = README.read_text()
    command = 'pip install -e ".[test]" && pytest'
    assert command in text and command in (ROOT / ".ci" / "run").read_text()
    assert "pip install -e . && visppo train" in text


def test_readme_is_a_front_door():
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, (
        f"README.md has {lines} lines, more than {MAX_README_LINES}: move the detail to a docs/ page "
        "that answers one question, and leave a one-line link")


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped (not '-' or '_'), spaces to '-'."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading keeps its text
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def _outside_code(text: str) -> list[str]:
    """The lines of a Markdown text that are not inside fenced code blocks."""
    kept, fenced = [], False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            kept.append(line)
    return kept


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings, repeated ones numbered as GitHub does (-1, -2)."""
    found, seen = set(), {}
    for line in _outside_code(path.read_text()):
        match = re.match(r"#{1,6} (.+?)#*\s*$", line)
        if match:
            slug = github_slug(match.group(1))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(f"{slug}-{count}" if count else slug)
    return found


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def relative_links(path: Path) -> list[str]:
    """Every link target in a Markdown file that is not a URL (inline code and code blocks skipped)."""
    targets = []
    for line in _outside_code(path.read_text()):
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if not re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:, ...
                targets.append(target)
    return targets


def test_github_slug_rules():
    assert github_slug("What chose the learner's defaults (ablations)") == "what-chose-the-learners-defaults-ablations"
    assert github_slug("DMC 500k, 10 epochs") == "dmc-500k-10-epochs"
    assert github_slug("RAD with `logp_old` recomputed") == "rad-with-logp_old-recomputed"
    assert github_slug("Learning rate 1e-3 on cartpole-swingup") == "learning-rate-1e-3-on-cartpole-swingup"


def test_every_relative_link_in_the_docs_resolves():
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in relative_links(page):
            file_part, _, anchor = unquote(target).partition("#")
            dest = (page.parent / file_part).resolve() if file_part else page
            name = page.relative_to(ROOT)
            if not dest.exists():
                broken.append(f"{name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{name}: {target} (no heading with that anchor in {dest.relative_to(ROOT)})")
    assert not broken, "broken links:\n" + "\n".join(broken)
