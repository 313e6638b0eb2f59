"""Shared fixtures: exported test models and compiled artifacts, built once per session."""

from __future__ import annotations

import os
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np  # noqa: F401 - imported before tvm on purpose, with torch
import pytest
import torch  # noqa: F401 - torch loads before tvm in every test process

warnings.filterwarnings("ignore")
# pytest-xdist: each worker takes its share of the cores for torch's, OpenMP's and TVM's thread pools (set before any
# pool starts). Every worker starting a pool of one thread per core oversubscribes the machine, and the pools' spinning
# barriers then wait on descheduled threads: on 2 cores two workers training with 2 threads each took 2.8 times the
# time of 1 thread each. A run in one process keeps the libraries' defaults.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    _threads = str(max(1, len(os.sched_getaffinity(0)) // _workers))
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TVM_NUM_THREADS"):
        os.environ.setdefault(_var, _threads)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
# the verified-digest cache of artifact files goes to a directory of this run, not the user's ~/.cache
os.environ.setdefault("MOEC_CACHE_DIR", tempfile.mkdtemp(prefix="moec-test-cache-"))

sys.path.insert(0, str(Path(__file__).parent))
from moec_testing import ModelZoo  # noqa: E402

TRAINED_TINY_STEPS = 350  # the trained_tiny fixture's schedule (the product default is 700)


@pytest.fixture(scope="session")
def zoo(tmp_path_factory):
    """Test models, their exports and default llvm artifacts. Under pytest-xdist the exports and artifacts are made
    once for the run in its shared temporary root (ModelZoo's ``shared``), not once per worker."""
    shared = None
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = tmp_path_factory.getbasetemp().parent / "zoo-shared"
        shared.mkdir(parents=True, exist_ok=True)
    return ModelZoo(tmp_path_factory.mktemp("zoo"), shared)


@pytest.fixture(scope="session")
def trained_tiny(tmp_path_factory):
    """`moec train-reference --size tiny --steps 350` once per run, on the running interpreter's stdlib corpus:
    half the default schedule (the CI's time), enough for the held-out bound of test_train (0.30 of the
    unigram perplexity here, against 0.5 asserted).

    ``MOEC_TEST_TRAINED_TINY=DIR`` reuses a model trained that way (local runs; CI trains its own).
    """
    import os

    from moec.models.corpus import build_corpus
    from moec.models.train import train_reference

    if os.environ.get("MOEC_TEST_TRAINED_TINY"):
        return Path(os.environ["MOEC_TEST_TRAINED_TINY"])

    def train(root: Path) -> Path:
        build_corpus(root / "corpus", "bytes")
        return train_reference("tiny", root / "model", corpus_dir=root / "corpus", steps=TRAINED_TINY_STEPS, progress=False)

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return train(tmp_path_factory.mktemp("trained"))
    # under pytest-xdist: the first worker to ask trains it into the run's shared temporary root, the others wait
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp().parent / "trained-tiny-shared"
    with FileLock(str(root) + ".lock"):
        if not (root / "done").exists():
            root.mkdir(parents=True, exist_ok=True)
            train(root)
            (root / "done").write_text("")
    return root / "model"
