"""Artifact directories: ``lib.so`` + ``weights.safetensors`` + ``manifest.json``, written atomically.

Reading an artifact checks that every file the manifest names exists and matches its SHA-256, that
the format is known and that the TVM version matches; errors name the file at fault.
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


def sha256_file(path: str | Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


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
        for name, digest in manifest["files"].items():
            fpath = directory / name
            if not fpath.is_file():
                raise ArtifactError(f"{fpath}: missing (listed in the manifest)")
            if sha256_file(fpath) != digest:
                raise ArtifactError(f"{fpath}: SHA-256 does not match the manifest: the artifact is corrupt or was edited")
    return manifest
