"""Target construction from the CLI's ``--target {llvm,cuda} --arch sm_XX``."""

from __future__ import annotations

import re

import tvm

from .errors import MoecError

_CUDA_DEFAULTS = {
    "max_shared_memory_per_block": 49152,
    "max_threads_per_block": 1024,
    "max_num_threads": 1024,
    "thread_warp_size": 32,
}


def make_target(kind: str, arch: str | None = None) -> tvm.target.Target:
    """``llvm`` (this CPU) or ``cuda`` for an ``sm_XX`` architecture, with an llvm host."""
    if kind == "llvm":
        if arch:
            raise MoecError("--arch applies to --target cuda only")
        return tvm.target.Target({"kind": "llvm"})
    if kind == "cuda":
        arch = arch or "sm_90"
        if not re.fullmatch(r"sm_\d{2,3}a?", arch):
            raise MoecError(f"bad --arch {arch!r}: expected sm_XX, e.g. sm_90")
        return tvm.target.Target(dict(_CUDA_DEFAULTS, kind="cuda", arch=arch), host={"kind": "llvm"})
    raise MoecError(f"bad --target {kind!r}: expected 'llvm' or 'cuda'")
