"""Atomic file and directory writes (a crash leaves the old state or the new one, never half) and
manifests that let a reader tell a damaged cache file from a good one."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file in the same folder and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


@contextlib.contextmanager
def atomic_directory(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a scratch folder that becomes ``final`` only if the block finishes.

    If another process created ``final`` meanwhile, its copy wins and ours is dropped, so
    concurrent first uses of a cache never see a half-written folder.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.{uuid.uuid4().hex}.tmp")
    tmp.mkdir()
    try:
        yield tmp
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------- manifests
# A manifest records each file's size and sha256 when it is written, so a truncated or damaged
# cache file is caught before a loader deep inside a library fails on it. ``mtime_ns`` is the
# time the hash was last confirmed: while a file keeps its size and that time, the hash is not
# recomputed, so a verified load costs a few ``stat`` calls.

MANIFEST_FORMAT = "kvquant-manifest/1"


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(manifest: str | os.PathLike, files: Iterable[str | os.PathLike]) -> Path:
    """Record size, mtime and sha256 of ``files`` (paths under ``manifest``'s folder) in ``manifest``, atomically."""
    manifest = Path(manifest)
    records = {}
    for file in map(Path, files):
        st = file.stat()
        name = file.relative_to(manifest.parent).as_posix()
        records[name] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256_file(file)}
    text = json.dumps({"format": MANIFEST_FORMAT, "files": records}, indent=1, sort_keys=True) + "\n"
    return atomic_write_text(manifest, text)


def check_manifest(manifest: str | os.PathLike, full: bool = False) -> str | None:
    """None if every file ``manifest`` lists matches it, else the first mismatch in a few words.

    Sizes are always compared; a hash is computed when ``full`` or when a file's mtime is not the
    one recorded (then, if it matches, the new mtime is recorded so the next check is fast again).
    """
    manifest = Path(manifest)
    try:
        data = json.loads(manifest.read_text(encoding="utf-8"))
        files = data["files"]
        records = [
            (str(name), int(rec["size"]), int(rec["mtime_ns"]), str(rec["sha256"])) for name, rec in files.items()
        ]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"{manifest.name}: unreadable"
    confirmed = False
    for name, size, mtime_ns, digest in records:
        path = manifest.parent / name
        try:
            st = path.stat()
        except FileNotFoundError:
            return f"{name}: missing"
        if st.st_size != size:
            return f"{name}: size {st.st_size} != {size} when written"
        if full or st.st_mtime_ns != mtime_ns:
            if sha256_file(path) != digest:
                return f"{name}: sha256 differs from when written"
            if st.st_mtime_ns != mtime_ns:
                files[name]["mtime_ns"] = st.st_mtime_ns
                confirmed = True
    if confirmed:
        with contextlib.suppress(OSError):  # a read-only cache stays valid, only slower to check
            atomic_write_text(manifest, json.dumps(data, indent=1, sort_keys=True) + "\n")
    return None


def discard_directory(path: str | os.PathLike) -> None:
    """Remove a folder by first renaming it aside, so no process ever opens it half-deleted."""
    path = Path(path)
    aside = path.with_name(f".{path.name}.{uuid.uuid4().hex}.discard")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return  # another process got there first
    shutil.rmtree(aside, ignore_errors=True)
