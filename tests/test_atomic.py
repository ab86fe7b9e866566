"""visppo.atomic: a file is the old complete one or the new complete one, never half of one."""

import os

import pytest

from visppo.atomic import atomic_write, atomic_write_bytes, atomic_write_text, file_mode


def test_text_and_bytes_round_trip_into_new_folders_and_leave_no_temp_file(tmp_path):
    text, data = tmp_path / "a" / "b" / "config.yaml", tmp_path / "a" / "blob.bin"
    atomic_write_text(text, "ppo:\n  num_envs: 4\n")
    atomic_write_bytes(data, b"\x00\xffvisppo")
    assert text.read_text() == "ppo:\n  num_envs: 4\n" and data.read_bytes() == b"\x00\xffvisppo"
    assert sorted(p.name for p in (tmp_path / "a").rglob("*")) == ["b", "blob.bin", "config.yaml"]
    atomic_write_text(text, "over")
    assert text.read_text() == "over"


def test_a_failed_write_keeps_the_previous_file_and_removes_its_temp_file(tmp_path):
    path = tmp_path / "result.json"
    atomic_write_text(path, "old")

    def half(f):
        f.write("half of the new")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(path, half, binary=False)
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]


def test_new_files_get_the_mode_a_plain_open_would_give(tmp_path):
    old = os.umask(0o027)
    try:
        assert file_mode() == 0o640
        atomic_write_bytes(tmp_path / "w.bin", b"1")
        with open(tmp_path / "plain.bin", "wb") as f:
            f.write(b"1")
    finally:
        os.umask(old)
    assert (tmp_path / "w.bin").stat().st_mode & 0o777 == (tmp_path / "plain.bin").stat().st_mode & 0o777 == 0o640


def test_text_is_utf8_whatever_the_locale(tmp_path):
    """visppo reads its YAML and JSON as UTF-8: a C locale must not make a write fail, or write
    bytes the reader then calls not text."""
    import subprocess
    import sys

    path = tmp_path / "c.yaml"
    code = f"from visppo.atomic import atomic_write_text; atomic_write_text({str(path)!r}, 'name: caf\\u00e9\\n')"
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    assert path.read_bytes() == "name: café\n".encode()
