"""An offline text corpus: the running interpreter's standard-library sources, split by file.

Every machine with Python has it, so training and evaluation need no download. Files are the
``*.py`` sources under ``sysconfig``'s stdlib directory (site-packages excluded), in sorted order
of their relative paths. A file is held out when the first 8 hex digits of the SHA-256 of its
relative path, taken modulo 100, fall below ``heldout_percent``: the split is by file, never by
line, and does not move when other files come or go.

Two tokenizers:
  * ``bytes``: the UTF-8 bytes themselves (vocabulary 256); byte 0 separates documents (NUL is
    removed from the text first).
  * ``bpe``: a byte-level BPE (the ``tokenizers`` library) trained on the train split only, with
    ``<|endoftext|>`` (id 0) separating documents.

A corpus directory holds ``train.bin`` and ``heldout.bin`` (little-endian uint16 token ids, the
documents of the split concatenated, each followed by the separator), ``tokenizer.json`` for
``bpe``, and ``corpus.json`` (format, source, tokenizer, file and token counts, SHA-256 of each
``.bin`` and the unigram baseline's held-out perplexity).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..compiler.artifact import atomic_directory, sha256_file
from ..compiler.errors import MoecError

FORMAT = "moec-corpus/1"
SPLITS = ("train", "heldout")
EOT = "<|endoftext|>"


def cache_root() -> Path:
    """Where built corpora and trained models are cached (``$MOEC_CACHE`` or ``~/.cache/moec``)."""
    return Path(os.environ.get("MOEC_CACHE", Path.home() / ".cache" / "moec"))


def stdlib_files(root: str | Path | None = None) -> list[tuple[str, Path]]:
    """``(relative path, path)`` of every stdlib ``*.py`` file, sorted by relative path."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if rel.split("/")[0] in ("site-packages", "dist-packages") or "__pycache__" in rel:
            continue
        out.append((rel, path))
    return sorted(out)


def split_of(relpath: str, heldout_percent: int) -> str:
    """The split a file belongs to, from a hash of its relative path."""
    bucket = int(hashlib.sha256(relpath.encode()).hexdigest()[:8], 16) % 100
    return "heldout" if bucket < heldout_percent else "train"


def read_documents(files: list[tuple[str, Path]]) -> list[tuple[str, str]]:
    """``(relpath, text)`` of the files that decode as UTF-8 (others are skipped), NUL removed."""
    docs = []
    for rel, path in files:
        try:
            text = path.read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        text = text.replace("\x00", "")
        if text.strip():
            docs.append((rel, text))
    return docs


class ByteTokenizer:
    """UTF-8 bytes as tokens; id 0 (NUL) separates documents."""

    kind = "bytes"
    vocab_size = 256
    eot_id = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class BPETokenizer:
    """A byte-level BPE from the ``tokenizers`` library; ``<|endoftext|>`` (id 0) separates documents."""

    kind = "bpe"

    def __init__(self, tok) -> None:
        self.tok = tok
        self.vocab_size = tok.get_vocab_size()
        self.eot_id = tok.token_to_id(EOT)

    @classmethod
    def train(cls, texts: list[str], vocab_size: int) -> "BPETokenizer":
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, min_frequency=2, special_tokens=[EOT], show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    @classmethod
    def load(cls, path: str | Path) -> "BPETokenizer":
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(path)))

    def save(self, path: str | Path) -> None:
        self.tok.save(str(path))

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts)]

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids])


def _encode_all(tokenizer, texts: list[str]) -> list[list[int]]:
    if hasattr(tokenizer, "encode_batch"):
        return tokenizer.encode_batch(texts)
    return [tokenizer.encode(t) for t in texts]


def unigram_perplexity(train: np.ndarray, heldout: np.ndarray, vocab_size: int) -> float:
    """Held-out perplexity of an add-one-smoothed unigram model fitted on ``train``."""
    counts = np.bincount(train, minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(math.exp(-logp[heldout].mean()))


@dataclass
class Corpus:
    """A built corpus directory: token streams per split and the tokenizer."""

    root: Path
    meta: dict
    tokenizer: object

    @property
    def vocab_size(self) -> int:
        return int(self.meta["tokenizer"]["vocab_size"])

    def tokens(self, split: str) -> np.ndarray:
        if split not in SPLITS:
            raise MoecError(f"unknown corpus split {split!r}: expected one of {', '.join(SPLITS)}")
        return np.fromfile(self.root / f"{split}.bin", dtype="<u2").astype(np.int64)

    @property
    def id(self) -> str:
        return self.meta["id"]


def corpus_id(tokenizer: str, vocab_size: int, heldout_percent: int) -> str:
    py = ".".join(platform.python_version_tuple()[:2])
    voc = "" if tokenizer == "bytes" else str(vocab_size)
    return f"stdlib-py{py}-{tokenizer}{voc}-h{heldout_percent}"


def build_corpus(out_dir: str | Path, tokenizer: str = "bytes", vocab_size: int = 4096, heldout_percent: int = 5,
                 stdlib_root: str | Path | None = None, max_files: int | None = None) -> Corpus:
    """Build a corpus directory from the stdlib sources (atomically).

    Parameters
    ----------
    tokenizer : {"bytes", "bpe"}
    vocab_size : int
        BPE vocabulary size (ignored for ``bytes``).
    heldout_percent : int
        Share of files (by hash of their path) in the held-out split.
    max_files : int, optional
        Use only the first files (sorted by path); for quick tests.
    """
    if tokenizer not in ("bytes", "bpe"):
        raise MoecError(f"unknown tokenizer {tokenizer!r}: expected 'bytes' or 'bpe'")
    if not 0 < heldout_percent < 100:
        raise MoecError("heldout_percent must be in (0, 100)")
    files = stdlib_files(stdlib_root)[:max_files]
    docs = read_documents(files)
    by_split = {s: [(rel, text) for rel, text in docs if split_of(rel, heldout_percent) == s] for s in SPLITS}
    if not by_split["train"] or not by_split["heldout"]:
        raise MoecError(f"corpus needs files in both splits; found {len(by_split['train'])} train, {len(by_split['heldout'])} held-out")
    if tokenizer == "bytes":
        tok = ByteTokenizer()
    else:
        if not 256 < vocab_size <= 65535:
            raise MoecError("BPE vocab_size must be in (256, 65535]")
        tok = BPETokenizer.train([t for _, t in by_split["train"]], vocab_size)
    streams = {}
    for split, items in by_split.items():
        ids = []
        for seq in _encode_all(tok, [t for _, t in items]):
            ids.extend(seq)
            ids.append(tok.eot_id)
        streams[split] = np.asarray(ids, dtype="<u2")
    out_dir = Path(out_dir)
    with atomic_directory(out_dir) as tmp:
        for split, arr in streams.items():
            arr.tofile(tmp / f"{split}.bin")
        if tokenizer == "bpe":
            tok.save(tmp / "tokenizer.json")
        meta = {
            "format": FORMAT,
            "id": corpus_id(tokenizer, vocab_size, heldout_percent),
            "source": {
                "kind": "python-stdlib",
                "root": str(stdlib_root or sysconfig.get_paths()["stdlib"]),
                "python": platform.python_version(),
                "split_rule": f"sha256(relative path)[:8] % 100 < {heldout_percent} -> heldout",
                "files_skipped_not_utf8": len(files) - len(docs),
            },
            "tokenizer": {"kind": tokenizer, "vocab_size": tok.vocab_size, "eot_id": tok.eot_id},
            "splits": {
                s: {"files": len(by_split[s]), "bytes": sum(len(t.encode()) for _, t in by_split[s]), "tokens": int(streams[s].size),
                    "sha256": sha256_file(tmp / f"{s}.bin")}
                for s in SPLITS
            },
            "heldout_files": [rel for rel, _ in by_split["heldout"]],
            "unigram_heldout_perplexity": unigram_perplexity(streams["train"].astype(np.int64), streams["heldout"].astype(np.int64), tok.vocab_size),
        }
        (tmp / "corpus.json").write_text(json.dumps(meta, indent=2))
    return load_corpus(out_dir)


def load_corpus(path: str | Path) -> Corpus:
    """Open a corpus directory, checking its format and the hashes of its token files."""
    root = Path(path)
    meta_path = root / "corpus.json"
    if not meta_path.is_file():
        raise MoecError(f"{meta_path}: missing; {root} is not a moec corpus (build one with `moec corpus`)")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as exc:
        raise MoecError(f"{meta_path}: corrupt ({exc})") from None
    if meta.get("format") != FORMAT:
        raise MoecError(f"{meta_path}: unknown corpus format {meta.get('format')!r}, expected {FORMAT}")
    for split in SPLITS:
        f = root / f"{split}.bin"
        if not f.is_file() or sha256_file(f) != meta["splits"][split]["sha256"]:
            raise MoecError(f"{f}: missing or does not match corpus.json: rebuild the corpus")
    kind = meta["tokenizer"]["kind"]
    tok = ByteTokenizer() if kind == "bytes" else BPETokenizer.load(root / "tokenizer.json")
    return Corpus(root, meta, tok)


def get_corpus(tokenizer: str = "bytes", vocab_size: int = 4096, heldout_percent: int = 5, root: str | Path | None = None) -> Corpus:
    """The cached corpus for these settings, built on first use."""
    path = Path(root) if root else cache_root() / "corpus" / corpus_id(tokenizer, vocab_size, heldout_percent)
    if (path / "corpus.json").is_file():
        corpus = load_corpus(path)
        tk = corpus.meta["tokenizer"]
        if tk["kind"] != tokenizer or (tokenizer == "bpe" and tk["vocab_size"] != vocab_size):
            raise MoecError(f"{path}: corpus has tokenizer {tk['kind']}/{tk['vocab_size']}, wanted {tokenizer}/{vocab_size}")
        return corpus
    return build_corpus(path, tokenizer, vocab_size, heldout_percent)
