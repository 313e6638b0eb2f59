"""Artifact directories: ``lib.so`` + ``weights.safetensors`` + ``manifest.json``, written atomically.

Reading an artifact checks that every file the manifest names exists and matches its SHA-256, that
the format is known and that the TVM version matches; errors name the file at fault. A file found to
match is remembered by its device, inode, size and modification time (``$MOEC_CACHE_DIR``, default
``~/.cache/moec``), so an unchanged multi-GB weights file is not hashed again at every load.
Shared by the compiler (writing) and the runtime (reading): no compiler imports here.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from .errors import ArtifactError

FORMAT = "moec-artifact/1"
MANIFEST = "manifest.json"
LIBRARY = "lib.so"
WEIGHTS = "weights.safetensors"
OFFLOADED_PREFIX = "offloaded:"  # weights.safetensors keys of offloaded expert weights (kept in host memory)
PREFETCH_PREFIX = "prefetch:"  # weights.safetensors keys of calibrated prefetch predictors (``<layer>.weight`` / ``.bias``)


def sha256_file(path: str | Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _verified_cache() -> Path:
    """Where digests already checked are remembered: ``$MOEC_CACHE_DIR`` or ``~/.cache/moec``."""
    root = os.environ.get("MOEC_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moec"
    return Path(root) / "verified-files.json"


def _stat_key(path: Path) -> str:
    # the file's identity and state: device, inode, size and modification time (a hard link shares the entry)
    st = path.stat()
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"


def _load_verified() -> dict:
    try:
        doc = json.loads(_verified_cache().read_text())
        return doc if isinstance(doc, dict) else {}
    except (OSError, ValueError):
        return {}


def _remember_verified(entries: dict) -> None:
    """Record checked files; a cache that cannot be written only costs the next load its hashing."""
    path = _verified_cache()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        doc = _load_verified()
        doc.update(entries)
        if len(doc) > 4096:  # oldest first (insertion order): keep the most recent
            doc = dict(list(doc.items())[-4096:])
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, path)
    except OSError:
        pass


def file_matches(path: Path, digest: str, known: dict | None = None) -> bool:
    """Whether ``path`` has SHA-256 ``digest``. A file already found to match, and not changed since (same
    device, inode, size and modification time), is not read again: a large weights file is hashed once,
    not at every load. Pass ``known`` (``_load_verified()``) to check many files against one read of the cache."""
    known = _load_verified() if known is None else known
    key = _stat_key(path)
    if known.get(key) == digest:
        return True
    if sha256_file(path) != digest:
        return False
    if key == _stat_key(path):  # unchanged while it was read
        _remember_verified({key: digest})
    return True


@contextmanager
def atomic_directory(target: str | Path):
    """Yield a temporary directory beside ``target``; on success it replaces ``target`` in one rename.

    On any exception the temporary directory is removed and ``target`` is left as it was.
    """
    target = Path(target).absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        yield tmp
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.replace(target, old / "x")
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
        os.chmod(target, 0o755)
        for f in target.iterdir():
            os.chmod(f, 0o644 if f.is_file() else 0o755)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_manifest(directory: Path, manifest: dict) -> None:
    files = {}
    for name in sorted(os.listdir(directory)):
        if name != MANIFEST and (directory / name).is_file():
            files[name] = sha256_file(directory / name)
    _remember_verified({_stat_key(directory / name): digest for name, digest in files.items()})  # just written
    manifest = dict(manifest, format=FORMAT, files=files)
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))


def read_json_document(path: Path, fmt: str, kind: str, error: type[Exception] = ArtifactError,
                       corrupt: str = "corrupt") -> dict:
    """The JSON object in ``path`` whose ``format`` is ``fmt``; ``error`` naming the file otherwise."""
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise error(f"{path}: {corrupt} ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != fmt:
        raise error(f"{path}: unknown {kind} format {doc.get('format') if isinstance(doc, dict) else None!r}, expected {fmt}")
    return doc


def read_manifest(directory: str | Path, verify: bool = True) -> dict:
    directory = Path(directory)
    if not directory.is_dir():
        raise ArtifactError(f"{directory}: not an artifact directory (no such directory)")
    path = directory / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"{path}: missing; {directory} is not a moec artifact")
    manifest = read_json_document(path, FORMAT, "artifact", corrupt="corrupt manifest")
    for key in ("files", "target", "model", "entry_functions", "tvm_version"):
        if key not in manifest:
            raise ArtifactError(f"{path}: manifest lacks {key!r}")
    for required in (LIBRARY, WEIGHTS):
        if required not in manifest["files"]:
            raise ArtifactError(f"{path}: manifest does not list {required}")
    if verify:
        known = _load_verified()
        for name, digest in manifest["files"].items():
            fpath = directory / name
            if not fpath.is_file():
                raise ArtifactError(f"{fpath}: missing (listed in the manifest)")
            if not file_matches(fpath, digest, known):
                raise ArtifactError(f"{fpath}: SHA-256 does not match the manifest: the artifact is corrupt or was edited")
    return manifest
