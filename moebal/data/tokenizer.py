"""Tokenizers: the byte tokenizer (vocabulary 256) and an adapter over a HF `tokenizer.json`.

The `tokenizers` package is imported only when a `tokenizer.json` is named, so the byte path needs nothing
beyond numpy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np

from moebal.errors import DataError

__all__ = ["ByteTokenizer", "HFTokenizer", "Tokenizer", "load_tokenizer"]


class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    name: str
    vocab_size: int
    dtype: type[np.integer]

    def encode(self, text: bytes) -> np.ndarray:
        """Token ids of one document given as UTF-8 bytes (already checked to decode)."""
        ...

    def decode(self, ids: np.ndarray) -> str:
        """Text of a sequence of ids (for inspection and samples)."""
        ...


class ByteTokenizer:
    """One token per byte of the UTF-8 text: no vocabulary file, no unknown tokens."""

    name = "byte"
    vocab_size = 256
    dtype: type[np.integer] = np.uint8

    def encode(self, text: bytes) -> np.ndarray:
        return np.frombuffer(text, dtype=np.uint8)

    def decode(self, ids: np.ndarray) -> str:
        """UTF-8 of the bytes; an id no byte has (a model of `model.vocab_size` above 256 samples them) reads as
        U+FFFD, as invalid bytes do (the uint8 cast showed it as the byte id % 256)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        text, start = [], 0
        for i in np.flatnonzero((ids < 0) | (ids > 255)).tolist() + [ids.size]:
            text.append(ids[start:i].astype(np.uint8).tobytes().decode("utf-8", errors="replace"))
            if i < ids.size:
                text.append("\ufffd")
            start = i + 1
        return "".join(text)


class HFTokenizer:
    """A HF fast tokenizer loaded from its `tokenizer.json`; with `add_special_tokens` its post-processor adds
    the special tokens it defines (a LLaMA tokenizer's BOS) to every document."""

    def __init__(self, path: str | Path, add_special_tokens: bool = False) -> None:
        p = Path(path)
        if not p.is_file():
            raise DataError(f"data.tokenizer: '{path}' is not a file; give 'byte' or the path of a tokenizer.json")
        try:
            import tokenizers
        except ImportError:
            raise DataError("data.tokenizer names a tokenizer.json but the 'tokenizers' package is missing: "
                            "pip install tokenizers (or the moebal[hf] extra)") from None
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(p))
        except Exception as e:  # the Rust side raises plain Exceptions for malformed files
            raise DataError(f"data.tokenizer: cannot load '{p}' as a tokenizer.json ({' '.join(str(e).split())})") \
                from None
        self.name = str(p)
        self.add_special_tokens = add_special_tokens
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.dtype = np.uint16 if self.vocab_size <= 1 << 16 else np.int32

    def encode(self, text: bytes) -> np.ndarray:
        ids = self._tok.encode(text.decode("utf-8"), add_special_tokens=self.add_special_tokens).ids
        return np.asarray(ids, dtype=self.dtype)

    def encode_many(self, texts: list[bytes]) -> list[np.ndarray]:
        """Batch encoding (parallel inside `tokenizers`)."""
        out = self._tok.encode_batch([t.decode("utf-8") for t in texts], add_special_tokens=self.add_special_tokens)
        return [np.asarray(e.ids, dtype=self.dtype) for e in out]

    def decode(self, ids: np.ndarray) -> str:
        return str(self._tok.decode([int(i) for i in ids]))


def load_tokenizer(spec: str, add_special_tokens: bool = False) -> Tokenizer:
    """'byte' or the path of a HF tokenizer.json."""
    if spec == "byte":
        return ByteTokenizer()
    return HFTokenizer(spec, add_special_tokens)
