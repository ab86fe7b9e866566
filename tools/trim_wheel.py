"""Rewrite a wheel without the files under some path prefixes, its RECORD kept consistent.

``tools/gpu_session.sh prepare`` uses it to carry dm_control to the offline GPU machine: the
wheel (54 MiB) with the tracked tree passes the 64 MiB a device call carries, and most of it
(``locomotion/``'s walkers and soccer assets, ``mujoco/testing/``'s frames) is never loaded by
``dm_control.suite``.

    python tools/trim_wheel.py IN.whl OUT.whl --drop dm_control/locomotion/ --drop ...

Every entry not dropped is copied with its name, date, permissions and bytes unchanged (the
compression may pack them differently); RECORD loses the dropped files' lines and keeps every
other line byte for byte, so ``pip install --no-index --no-deps`` accepts the result. A kept
file whose sha256 disagrees with its RECORD line, a prefix that drops nothing (the wheel's
layout changed: look at the list again), one that would drop the ``.dist-info`` folder, an
input that is not a wheel, or an output folder that does not exist: one ``error:`` line on
stderr, exit 2, nothing written. The output is written to a temporary file and renamed.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import os
import sys
import tempfile
import zipfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


class TrimError(ValueError):
    """Input the trimming refuses; the message is one line."""


@dataclass
class Trimmed:
    kept: int
    """Entries in the output (RECORD included)."""
    dropped: int
    """Entries left out."""
    dropped_bytes: int
    """Uncompressed bytes left out."""


def _record_path(names: Sequence[str]) -> str:
    records = [n for n in names if n.count("/") == 1 and n.endswith(".dist-info/RECORD")]
    if len(records) != 1:
        raise TrimError(f"expected one <name>.dist-info/RECORD at the top of the wheel, found {len(records)}")
    return records[0]


def _digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def trim_wheel(src: Path, dst: Path, drop: Sequence[str]) -> Trimmed:
    """Write ``dst``: the wheel ``src`` without the entries whose name starts with one of ``drop``.

    Raises :class:`TrimError` (nothing written) for a refused input; see the module docstring.
    """
    src, dst = Path(src), Path(dst)
    if not drop:
        raise TrimError("no --drop prefix given: nothing to trim")
    if not src.is_file():
        raise TrimError(f"{src}: no such file")
    if not zipfile.is_zipfile(src):
        raise TrimError(f"{src}: not a zip file (a wheel is one)")
    if not dst.parent.is_dir():
        raise TrimError(f"{dst.parent}: the output folder does not exist")
    if dst.is_dir():
        raise TrimError(f"{dst} is a folder: give the output wheel's file name")
    if dst.exists() and dst.resolve() == src.resolve():
        raise TrimError(f"{dst}: the output would overwrite the input")
    prefixes = tuple(drop)
    with zipfile.ZipFile(src) as zin:
        infos = zin.infolist()
        names = [i.filename for i in infos]
        record = _record_path(names)
        dist_info = record.split("/", 1)[0] + "/"
        for p in prefixes:
            if not p or dist_info.startswith(p) or p.startswith(dist_info):
                raise TrimError(f"--drop {p!r} would drop the wheel's metadata ({dist_info})")
            if not any(n.startswith(p) for n in names):
                raise TrimError(f"--drop {p!r} matches nothing in {src.name}")
        gone = {i.filename for i in infos if i.filename.startswith(prefixes)}
        lines = zin.read(record).decode("utf-8").splitlines(keepends=True)
        hashes = {}
        kept_lines = []
        for line in lines:
            row = next(csv.reader([line]), [])
            if not row:
                kept_lines.append(line)
                continue
            if row[0].startswith(prefixes):
                continue
            kept_lines.append(line)
            if len(row) >= 2 and row[1]:
                hashes[row[0]] = row[1]
        fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", dir=dst.parent)
        os.close(fd)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would make the wheel private
        try:
            with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as zout:
                for info in infos:
                    if info.filename in gone:
                        continue
                    if info.filename == record:
                        zout.writestr(info, "".join(kept_lines).encode("utf-8"))
                        continue
                    data = zin.read(info)
                    want = hashes.get(info.filename)
                    if want is not None and want.startswith("sha256=") and _digest(data) != want:
                        raise TrimError(f"{info.filename}: its sha256 differs from RECORD's (a damaged wheel)")
                    zout.writestr(info, data)
            os.replace(tmp, dst)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    dropped = [i for i in infos if i.filename in gone]
    return Trimmed(kept=len(infos) - len(dropped), dropped=len(dropped),
                   dropped_bytes=sum(i.file_size for i in dropped))


class Parser(argparse.ArgumentParser):
    """argparse whose own errors are one ``error:`` line too, exit code 2."""

    def error(self, message: str) -> None:
        self.exit(2, f"error: {message} (see --help)\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = Parser(description="Rewrite a wheel without the files under some path "
                                                 "prefixes, its RECORD kept consistent.")
    parser.add_argument("src", type=Path, help="the wheel to trim")
    parser.add_argument("dst", type=Path, help="the trimmed wheel to write (its folder must exist)")
    parser.add_argument("--drop", action="append", default=[], metavar="PREFIX",
                        help="drop the entries whose path starts with PREFIX (repeat; e.g. dm_control/locomotion/)")
    ns = parser.parse_args(argv)
    try:
        res = trim_wheel(ns.src, ns.dst, ns.drop)
    except (TrimError, zipfile.BadZipFile, UnicodeDecodeError) as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except (zlib.error, EOFError) as exc:  # an entry's compressed bytes are damaged
        print(f"error: {ns.src}: a damaged wheel ({exc}): download it again", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: {exc.filename or ns.dst}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(f"{ns.dst}: {res.kept} entries kept, {res.dropped} dropped "
          f"({res.dropped_bytes / 2**20:.1f} MiB uncompressed), {ns.dst.stat().st_size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
