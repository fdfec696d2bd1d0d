"""Corpora: which documents, in which order, split how, as one token array per split.

Shape legend: N = tokens in a split, M = documents in a split (+1 for the offsets array).

The embedded default corpus is this Python's standard library (`sysconfig.get_paths()["stdlib"]`): every
`*.py` file, in sorted relative-path order, skipping `site-packages` (installed third-party code, 20x the
size of the stdlib and different on every machine), the `test`/`tests`/`idle_test` packages (50 MB of
regression tests, much of it generated data) and `__pycache__`. What is left (~730 files, ~12 MB on CPython
3.11) is ordinary library code. A document goes to validation when a hash of its relative path falls below
`data.val_fraction`, so the split does not depend on file order, the machine, or the other files present.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import os
import re
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moebal.data.tokenizer import HFTokenizer, Tokenizer, load_tokenizer
from moebal.errors import DataError

__all__ = ["Corpus", "Split", "iter_documents", "load_corpus", "merge_corpora", "split_blocks", "stdlib_root",
           "unigram_entropy", "val_share"]

SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
TEXT_SUFFIXES = (".txt", ".jsonl")


@dataclass(frozen=True)
class Split:
    """One split as a single token array; document m is tokens_N[offsets_M[m]:offsets_M[m + 1]]."""

    tokens_N: np.ndarray
    offsets_M: np.ndarray

    @property
    def n_tokens(self) -> int:
        return int(self.tokens_N.shape[0])

    @property
    def n_docs(self) -> int:
        return int(self.offsets_M.shape[0] - 1)


@dataclass(frozen=True)
class Corpus:
    """A tokenised corpus and what the run summary reports about it."""

    source: str
    tokenizer: Tokenizer
    train: Split
    val: Split
    n_skipped: int
    """Files that were not valid UTF-8 and were left out."""
    split_by: str
    """'path-hash' (documents by hash of their path) or 'tail' (the fallback for one or two documents)."""

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @functools.cached_property
    def unigram_entropy(self) -> float:
        """Nats per token of the training split's token frequencies (the loss of a context-free model)."""
        return unigram_entropy(self.train.tokens_N, self.vocab_size)


def unigram_entropy(tokens_N: np.ndarray, vocab_size: int) -> float:
    counts = np.bincount(tokens_N.astype(np.int64, copy=False), minlength=vocab_size).astype(np.float64)
    p = counts[counts > 0] / max(counts.sum(), 1.0)
    return float(-(p * np.log(p)).sum())


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def val_share(name: str) -> float:
    """A document's position in [0, 1) for the split, from a hash of its name (stable across machines)."""
    digest = hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64


# ---------------------------------------------------------------------------------------------
# documents: (name, UTF-8 bytes) in a deterministic order


def _walk(root: Path, suffixes: tuple[str, ...], skip: frozenset[str]) -> list[Path]:
    found: list[Path] = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in skip and not x.startswith("."))
        found.extend(Path(d) / f for f in sorted(files) if f.endswith(suffixes))
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _jsonl_records(path: Path, name: str, data: bytes, text_key: str) -> Iterator[tuple[str, bytes | None]]:
    for lineno, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            line_text = line.decode("utf-8")
        except UnicodeDecodeError:  # the one rule for text: an undecodable document is skipped and counted
            yield f"{name}:{lineno}", None
            continue
        try:
            record = json.loads(line_text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: not a JSON object ({e.__class__.__name__}: {e}); "
                            f"each line of a .jsonl file must be one JSON record") from None
        if not isinstance(record, dict) or text_key not in record:
            keys = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
            raise DataError(f"{path}:{lineno}: no '{text_key}' field (found: {keys}); "
                            f"set data.text_key to the field holding the text")
        text = record[text_key]
        if not isinstance(text, str):
            raise DataError(f"{path}:{lineno}: field '{text_key}' is {type(text).__name__}, not a string")
        if text:
            try:
                encoded: bytes | None = text.encode("utf-8")
            except UnicodeEncodeError:  # JSON's \ud800-style escapes can name a lone surrogate, which is no text
                encoded = None
            yield f"{name}:{lineno}", encoded


def iter_documents(source: str, text_key: str = "text") -> Iterator[tuple[str, bytes | None]]:
    """(name, bytes) per document (a .txt file, a .jsonl line); bytes is None for a document that is not valid
    UTF-8 (the caller skips and counts it)."""
    if source == "stdlib":
        root, files = stdlib_root(), _walk(stdlib_root(), (".py",), SKIP_DIRS)
    else:
        root = Path(source).expanduser()
        if not root.exists():
            raise DataError(f"data.source: '{source}' does not exist; give 'stdlib' or a .txt/.jsonl file or folder")
        if root.is_file():
            if not root.name.endswith(TEXT_SUFFIXES):
                raise DataError(f"data.source: '{source}' is neither a .txt nor a .jsonl file")
            files, root = [root], root.parent
        else:
            files = _walk(root, TEXT_SUFFIXES, frozenset({"__pycache__"}))
    for path in files:
        name = path.relative_to(root).as_posix()
        try:
            data = path.read_bytes()
        except OSError as e:
            raise DataError(f"cannot read {path}: {e.strerror or e}") from None
        if name.endswith(".jsonl"):
            yield from _jsonl_records(path, name, data, text_key)
            continue
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            yield name, None
            continue
        if data:
            yield name, data


# ---------------------------------------------------------------------------------------------
# the corpus


def load_corpus(source: str = "stdlib", tokenizer: str = "byte", *, text_key: str = "text",
                val_fraction: float = 0.05, max_bytes: int | None = None, add_special_tokens: bool = False,
                units: str = "files") -> Corpus:
    """The tokenised corpus. Cached per process: a second load of the same corpus costs nothing.

    units: 'files' (a text file is one document) or 'blocks' (each top-level block of a text file is one,
    `split_blocks`); a .jsonl line is always one document.
    """
    if units not in ("files", "blocks"):
        raise DataError(f"data.units must be 'files' or 'blocks'; got {units!r}")
    if source != "stdlib":
        source = str(Path(source).expanduser().resolve())
    if tokenizer != "byte":
        tokenizer = str(Path(tokenizer).expanduser().resolve())
    return _load_cached(source, tokenizer, text_key, val_fraction, max_bytes, add_special_tokens, units)


_BLOCK_START = re.compile(rb"\n[ \t\r]*\n(?=[^\s)\]}])")  # a blank line may end in \r (CRLF files)


def split_blocks(data: bytes) -> list[bytes]:
    """A text's top-level blocks: it is cut after every blank line that is followed by an unindented line
    (not a closing bracket): Python statements and definitions (with their leading comments), paragraphs of
    prose; CRLF line ends cut the same places as LF ones. Lossless: the blocks concatenate back to the text (each
    keeps its trailing blank lines)."""
    cuts = [m.end() for m in _BLOCK_START.finditer(data)]
    edges = [0, *cuts, len(data)]
    return [data[a:b] for a, b in zip(edges[:-1], edges[1:]) if b > a]


@functools.lru_cache(maxsize=4)
def _load_cached(source: str, tokenizer: str, text_key: str, val_fraction: float,
                 max_bytes: int | None, add_special_tokens: bool = False, units: str = "files") -> Corpus:
    tok = load_tokenizer(tokenizer, add_special_tokens)
    names, texts, bad = _read(source, text_key, max_bytes)
    skipped = len(bad)
    undecodable = f"{skipped} document(s) not valid UTF-8, the first {bad[0]}" if bad else ""
    if bad:
        print(f"moebal: skipped {undecodable} (.txt files and .jsonl lines must be UTF-8: convert them, e.g. "
              f"iconv -f latin1 -t utf-8)", file=sys.stderr)
    if not texts:
        raise DataError(f"data.source '{source}' holds no text (no non-empty .txt/.jsonl documents"
                        f"{f'; skipped {undecodable}' if bad else ''})")
    if units == "blocks":  # a file's blocks share its name: the split keeps them on one side
        pairs = [(n, b) for n, t in zip(names, texts)
                 for b in ([t] if ".jsonl:" in n else split_blocks(t))]
        names, texts = [n for n, _ in pairs], [b for _, b in pairs]
    docs = tok.encode_many(texts) if isinstance(tok, HFTokenizer) else [tok.encode(t) for t in texts]
    to_val = [val_share(n) < val_fraction for n in names]
    split_by = "path-hash"
    if val_fraction > 0 and (all(to_val) or not any(to_val)):
        # Too few documents for a hash split (one file, say): hold out the tail of every file instead
        split_by = "tail"
        train, val = (_join(part, tok) for part in _tails(names, docs, val_fraction))
    else:
        train = _join([d for d, v in zip(docs, to_val) if not v], tok)
        val = _join([d for d, v in zip(docs, to_val) if v], tok)
    if train.n_tokens < 2:
        raise DataError(f"data.source '{source}': the training split has {train.n_tokens} token(s); add text")
    return Corpus(source=source, tokenizer=tok, train=train, val=val, n_skipped=skipped, split_by=split_by)


def _tails(names: list[str], docs: list[np.ndarray], val_fraction: float) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(training, validation) documents of the tail split: the last `val_fraction` of each file's tokens (of each
    `.jsonl` line's) is held out. A file cut into blocks (`units: blocks`, consecutive documents of one name)
    keeps its blocks whole but the one the cut falls in, so the training blocks keep their endings (holding
    out the tail of every block cut every one of them)."""
    train: list[np.ndarray] = []
    val: list[np.ndarray] = []
    for _, group in itertools.groupby(zip(names, docs), key=lambda nd: nd[0]):
        parts = [d for _, d in group]
        total = sum(len(d) for d in parts)
        keep = total - int(round(total * val_fraction))
        for d in parts:
            take = min(len(d), max(keep, 0))
            if take:
                train.append(d[:take])
            if take < len(d):
                val.append(d[take:])
            keep -= len(d)
    return train, val


def _read(source: str, text_key: str, max_bytes: int | None) -> tuple[list[str], list[bytes], list[str]]:
    """The documents' names and bytes, and the names of those skipped as not UTF-8."""
    names: list[str] = []
    texts: list[bytes] = []
    skipped: list[str] = []
    total = 0
    for name, data in iter_documents(source, text_key):
        if data is None:
            skipped.append(name)
            continue
        cut = max_bytes is not None and total + len(data) > max_bytes
        if cut:
            data = data[: max_bytes - total]  # type: ignore[operator]
            data = data.decode("utf-8", errors="ignore").encode("utf-8")  # never cut inside a character
        if data:
            names.append(name)
            texts.append(data)
            total += len(data)
        if cut:  # a prefix: nothing after the cut (a later document's bytes once filled a cut character's place)
            break
    return names, texts, skipped


def merge_corpora(corpora: list[Corpus], source: str) -> Corpus:
    """One corpus holding every document of several (same tokenizer), in order: a mixture's summary view."""
    tok = corpora[0].tokenizer

    def join(splits: list[Split]) -> Split:
        docs = [sp.tokens_N[a:b] for sp in splits
                for a, b in zip(sp.offsets_M[:-1].tolist(), sp.offsets_M[1:].tolist())]
        return _join(docs, tok)

    return Corpus(source=source, tokenizer=tok, train=join([c.train for c in corpora]),
                  val=join([c.val for c in corpora]), n_skipped=sum(c.n_skipped for c in corpora),
                  split_by=",".join(sorted({c.split_by for c in corpora})))


def _join(docs: list[np.ndarray], tok: Tokenizer) -> Split:
    docs = [d for d in docs if len(d)]
    lengths = np.array([len(d) for d in docs], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.concatenate(docs).astype(tok.dtype, copy=False) if docs else np.zeros(0, dtype=tok.dtype)
    return Split(tokens_N=tokens, offsets_M=offsets)
