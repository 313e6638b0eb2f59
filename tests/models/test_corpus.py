"""The offline corpus: split by file (hash of path), deterministic builds, tokenizers, unigram baseline."""

import json

import numpy as np
import pytest

from moec.compiler.errors import MoecError
from moec.models.corpus import build_corpus, load_corpus, split_of, stdlib_files, unigram_perplexity


def _fake_stdlib(root, n=40):
    for i in range(n):
        sub = root / ("pkg" if i % 3 else "") / f"mod_{i}.py"
        sub.parent.mkdir(parents=True, exist_ok=True)
        sub.write_text(f'"""Module {i}: does thing number {i}."""\n\ndef f_{i}(x):\n    return x * {i} + len("{"ab" * i}")\n')
    (root / "site-packages").mkdir()
    (root / "site-packages" / "third_party.py").write_text("print('not stdlib')\n")
    (root / "latin1.py").write_bytes(b"# \xe9\xe8 not utf-8\nx = 1\n")
    return root


def test_stdlib_files_exclude_site_packages(tmp_path):
    files = [rel for rel, _ in stdlib_files(_fake_stdlib(tmp_path))]
    assert files == sorted(files) and "site-packages/third_party.py" not in files
    assert "latin1.py" in files
    assert len(stdlib_files()) > 500  # the running interpreter's own standard library


def test_split_is_by_file_and_stable(tmp_path):
    root = _fake_stdlib(tmp_path / "lib")
    corpus = build_corpus(tmp_path / "c", "bytes", heldout_percent=30, stdlib_root=root)
    held = corpus.meta["heldout_files"]
    assert held and all(split_of(rel, 30) == "heldout" for rel in held)
    assert corpus.meta["source"]["files_skipped_not_utf8"] == 1
    # the held-out stream is exactly the held-out files' bytes, each followed by the separator
    expect = b"".join((root / rel).read_bytes() + b"\x00" for rel in held)
    assert corpus.tokens("heldout").astype(np.uint8).tobytes() == expect
    again = build_corpus(tmp_path / "c2", "bytes", heldout_percent=30, stdlib_root=root)
    assert again.meta["splits"] == corpus.meta["splits"]


def test_bpe_tokenizer_round_trip_and_train_only(tmp_path):
    root = _fake_stdlib(tmp_path / "lib")
    corpus = build_corpus(tmp_path / "c", "bpe", vocab_size=300, heldout_percent=30, stdlib_root=root)
    assert corpus.vocab_size <= 300 and (tmp_path / "c" / "tokenizer.json").is_file()
    text = 'def f_7(x):\n    return "é"\n'
    assert corpus.tokenizer.decode(corpus.tokenizer.encode(text)) == text
    assert corpus.tokenizer.eot_id == 0
    assert load_corpus(tmp_path / "c").meta == corpus.meta


def test_unigram_baseline():
    train = np.array([0, 0, 0, 1])
    held = np.array([0, 1])
    # add-one: p(0) = 4/6, p(1) = 2/6
    expect = np.exp(-(np.log(4 / 6) + np.log(2 / 6)) / 2)
    assert unigram_perplexity(train, held, 2) == pytest.approx(expect)


def test_corrupt_corpus_is_refused(tmp_path):
    root = _fake_stdlib(tmp_path / "lib")
    build_corpus(tmp_path / "c", "bytes", heldout_percent=30, stdlib_root=root)
    with open(tmp_path / "c" / "heldout.bin", "ab") as f:
        f.write(b"\x01\x00")
    with pytest.raises(MoecError, match="heldout.bin"):
        load_corpus(tmp_path / "c")
    with pytest.raises(MoecError, match="not a moec corpus"):
        load_corpus(tmp_path)
    meta = json.loads((tmp_path / "c" / "corpus.json").read_text())
    assert meta["format"] == "moec-corpus/1"
