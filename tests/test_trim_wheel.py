"""tools/trim_wheel.py: on a small synthetic wheel, the dropped prefixes leave the zip and RECORD,
every other entry and RECORD line stays byte for byte, and pip installs the result; bad input is
one ``error:`` line, exit 2, nothing written."""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import one_error_line

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "trim_wheel.py"


def tool():
    if str(TOOL.parent) not in sys.path:
        sys.path.insert(0, str(TOOL.parent))
    import trim_wheel

    return trim_wheel


def _hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


FILES = {
    "pkg/__init__.py": b"VALUE = 1\n",
    "pkg/keep.txt": b"kept\n",
    "pkg/bigger.txt": b"shares the prefix pkg/big without its slash\n",
    "pkg/a,b.txt": b"a name RECORD must quote\n",
    "pkg/big/__init__.py": b"",
    "pkg/big/blob.bin": bytes(range(256)) * 64,
    "pkg/big/deep/x.py": b"X = 2\n",
    "pkg/tests/test_pkg.py": b"def test(): pass\n",
}
DIST = "pkg-1.0.dist-info"
META = {f"{DIST}/METADATA": b"Metadata-Version: 2.1\nName: pkg\nVersion: 1.0\n",
        f"{DIST}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}


def make_wheel(path: Path, files: dict[str, bytes] = FILES, corrupt: str | None = None) -> Path:
    """A pure wheel of ``files``; ``corrupt``: a file whose RECORD hash is wrong."""
    entries = {**files, **META}
    lines = []
    for name, data in entries.items():
        quoted = f'"{name}"' if "," in name else name
        digest = _hash(b"not the bytes" if name == corrupt else data)
        lines.append(f"{quoted},{digest},{len(data)}\r\n")  # CRLF: kept lines must stay as they were
    lines.append(f"{DIST}/RECORD,,\r\n")
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for name, data in entries.items():
            info = zipfile.ZipInfo(name, date_time=(2020, 1, 2, 3, 4, 6))
            info.external_attr = (0o755 if name.endswith(".py") else 0o644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)
        z.writestr(f"{DIST}/RECORD", "".join(lines))
    return path


def record_lines(path: Path) -> list[str]:
    with zipfile.ZipFile(path) as z:
        return z.read(f"{DIST}/RECORD").decode().splitlines(keepends=True)


def test_dropped_prefixes_leave_the_zip_and_record_and_the_rest_is_unchanged(tmp_path):
    src = make_wheel(tmp_path / "pkg-1.0-py3-none-any.whl")
    dst = tmp_path / "out" / "pkg-1.0-0trimmed-py3-none-any.whl"
    dst.parent.mkdir()
    res = tool().trim_wheel(src, dst, ["pkg/big/", "pkg/tests/"])
    gone = {"pkg/big/__init__.py", "pkg/big/blob.bin", "pkg/big/deep/x.py", "pkg/tests/test_pkg.py"}
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst) as zout:
        assert zout.testzip() is None
        assert zout.namelist() == [n for n in zin.namelist() if n not in gone]  # order kept
        for info in zout.infolist():
            if info.filename == f"{DIST}/RECORD":
                continue
            before = zin.getinfo(info.filename)
            assert zout.read(info) == zin.read(before), info.filename
            assert (info.date_time, info.external_attr) == (before.date_time, before.external_attr)
    kept = [line for line in record_lines(src) if not line.lstrip('"').startswith(("pkg/big/", "pkg/tests/"))]
    assert record_lines(dst) == kept  # byte for byte, CRLF and quoting included
    assert len(kept) == len(record_lines(src)) - len(gone)
    assert any(line.startswith('"pkg/a,b.txt"') for line in kept) and any("pkg/bigger.txt" in x for x in kept)
    assert (res.dropped, res.kept) == (len(gone), len(FILES) + len(META) + 1 - len(gone))
    assert res.dropped_bytes == sum(len(FILES[n]) for n in gone)


def test_the_trimmed_wheel_installs_with_pip_offline(tmp_path):
    src = make_wheel(tmp_path / "pkg-1.0-py3-none-any.whl")
    dst = tmp_path / "pkg-1.0-0trimmed-py3-none-any.whl"  # a build tag marks it: pip takes it
    tool().trim_wheel(src, dst, ["pkg/big/"])
    site = tmp_path / "site"
    res = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                          "--disable-pip-version-check", "--target", str(site), str(dst)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert (site / "pkg" / "keep.txt").read_bytes() == FILES["pkg/keep.txt"]
    assert (site / "pkg" / "a,b.txt").is_file() and not (site / "pkg" / "big").exists()
    installed = (site / DIST / "RECORD").read_text()
    assert "pkg/keep.txt" in installed and "pkg/big/" not in installed
    out = subprocess.run([sys.executable, "-c", "import pkg; print(pkg.VALUE)"], env={**os.environ, "PYTHONPATH": str(site)},
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "1", out.stderr


@pytest.mark.parametrize("drop, needle", [
    (["pkg/nothing/"], "matches nothing"),
    (["pkg-1.0.dist-info/"], "metadata"),
    (["pkg-"], "metadata"),
    ([], "no --drop"),
])
def test_a_drop_list_that_drops_nothing_or_the_metadata_is_refused(tmp_path, drop, needle):
    src = make_wheel(tmp_path / "pkg-1.0-py3-none-any.whl")
    with pytest.raises(tool().TrimError, match=needle):
        tool().trim_wheel(src, tmp_path / "out.whl", drop)
    assert sorted(p.name for p in tmp_path.iterdir()) == [src.name]


def test_a_kept_file_whose_hash_disagrees_with_record_is_refused_and_nothing_is_written(tmp_path):
    src = make_wheel(tmp_path / "pkg-1.0-py3-none-any.whl", corrupt="pkg/keep.txt")
    with pytest.raises(tool().TrimError, match="pkg/keep.txt"):
        tool().trim_wheel(src, tmp_path / "out.whl", ["pkg/big/"])
    assert sorted(p.name for p in tmp_path.iterdir()) == [src.name]  # no temporary file left either
    tool().trim_wheel(src, tmp_path / "out.whl", ["pkg/big/", "pkg/keep.txt"])  # dropped: not checked


def run_tool(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True, timeout=60)


def test_as_a_script_it_prints_one_line_and_bad_input_is_one_error_line_exit_2(tmp_path):
    src = make_wheel(tmp_path / "pkg-1.0-py3-none-any.whl")
    ok = run_tool(src, tmp_path / "t.whl", "--drop", "pkg/big/")
    assert ok.returncode == 0 and ok.stderr == "" and len(ok.stdout.strip().splitlines()) == 1, ok
    assert "3 dropped" in ok.stdout, ok.stdout

    notzip = tmp_path / "notzip.whl"
    notzip.write_text("not a zip")
    damaged = tmp_path / "damaged.whl"
    damaged.write_bytes(src.read_bytes())
    with zipfile.ZipFile(damaged) as z:
        info = z.getinfo("pkg/keep.txt")
    with damaged.open("r+b") as f:  # the entry's deflate stream starts with an invalid block type
        f.seek(info.header_offset + 26)
        name_len, extra_len = (int.from_bytes(f.read(2), "little") for _ in range(2))
        f.seek(info.header_offset + 30 + name_len + extra_len)
        f.write(b"\xff")
    cases = [
        ((damaged, tmp_path / "a.whl", "--drop", "pkg/big/"), "damaged wheel"),
        ((src, tmp_path, "--drop", "pkg/big/"), "is a folder"),
        ((src,), "the following arguments are required"),
        ((notzip, tmp_path / "a.whl", "--drop", "pkg/big/"), "not a zip"),
        ((src, tmp_path / "missing" / "a.whl", "--drop", "pkg/big/"), "does not exist"),
        ((tmp_path / "absent.whl", tmp_path / "a.whl", "--drop", "pkg/big/"), "no such file"),
        ((src, src, "--drop", "pkg/big/"), "overwrite the input"),
        ((src, tmp_path / "a.whl", "--drop", "pkg/nothing/"), "matches nothing"),
    ]
    for args, needle in cases:
        res = run_tool(*args)
        assert res.returncode == 2, (args, res)
        one_error_line(res.stderr, needle)
        assert res.stdout == ""
    assert not (tmp_path / "a.whl").exists() and not (tmp_path / "missing").exists()


# --------------------------------------------------------------------------- tools/gpu_session.sh
