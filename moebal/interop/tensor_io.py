"""Tensor sources and a streaming safetensors writer: checkpoints converted one tensor at a time.

A `TensorSource` lists tensors (name -> dtype, shape) without reading them and reads one tensor, or a range
of rows of one tensor, on request. Three sources exist: a directory of safetensors files (one file or a
sharded `model.safetensors.index.json`), a single file, and an in-memory state dict. Converters walk a
source and never hold more than one tensor of it.

Files are read with plain `readinto` at the offsets in the safetensors header, not through a memory map: a
mapped file counts every page it touched in the process's resident memory until the kernel reclaims it,
which hides what a conversion really holds. Reading into a caller's buffer (`out=`) also lets a loader
fill a slice of a stacked parameter with no intermediate copy when the dtypes agree.

`write_safetensors` writes the format (8-byte little-endian header length, JSON header, raw little-endian
bytes in header order) from a list of entries whose bytes are produced one by one, so the output of a
conversion is never assembled in memory either.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from io import BufferedReader
from pathlib import Path
from typing import BinaryIO, Protocol

import torch

from moebal.errors import CheckpointError

__all__ = [
    "DTYPES",
    "DirectorySource",
    "FileSource",
    "OutTensor",
    "ScratchReader",
    "StateDictSource",
    "TensorInfo",
    "TensorSource",
    "dtype_name",
    "read_header",
    "write_safetensors",
]

# safetensors dtype codes <-> torch dtypes (the ones checkpoints of these models use)
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_CODES = {v: k for k, v in DTYPES.items()}
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors code of a torch dtype."""
    if dtype not in _CODES:
        raise CheckpointError(f"dtype {dtype} cannot be stored in safetensors by moebal; use float32, bfloat16 "
                              f"or float16")
    return _CODES[dtype]


@dataclass(frozen=True)
class TensorInfo:
    """What a source knows about a tensor before reading it."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    where: str
    """The file (or 'memory') holding it, for error messages."""

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


class TensorSource(Protocol):
    """Named tensors, listed without reading, read one at a time."""

    def info(self) -> dict[str, TensorInfo]:
        """Every tensor's dtype, shape and location."""
        ...

    def read(self, name: str, index: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Tensor `name` (or its row `index` along the first dimension), into `out` when given (same shape;
        converted when the dtype differs)."""
        ...

    def close(self) -> None:
        ...


# ---------------------------------------------------------------------------------------------
# reading


@dataclass(frozen=True)
class _Entry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute file offset of the first byte
    end: int


def read_header(path: Path) -> tuple[dict[str, _Entry], dict[str, str]]:
    """(tensor entries with absolute offsets, metadata) of a safetensors file; CheckpointError if malformed."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{path}: {size} bytes, too short to be a safetensors file (truncated?)")
            (n,) = struct.unpack("<Q", raw)
            if n > min(size - 8, 100 << 20):
                raise CheckpointError(f"{path}: the safetensors header claims {n} bytes in a {size}-byte file "
                                      f"(truncated or not a safetensors file)")
            header = json.loads(f.read(n).decode("utf-8"))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(f"{path}: the safetensors header is not valid JSON (corrupt file?)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a JSON object (corrupt file?)")
    meta = header.pop("__metadata__", None) or {}
    base = 8 + n
    entries: dict[str, _Entry] = {}
    for name, h in header.items():
        try:
            dtype = DTYPES[h["dtype"]]
            shape = tuple(int(s) for s in h["shape"])
            b, end = (int(x) for x in h["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor '{name}' has an unsupported or malformed header entry "
                                  f"{json.dumps(h)[:120]}") from None
        numel = 1
        for s in shape:
            numel *= s
        if end - b != numel * torch.empty((), dtype=dtype).element_size() or base + end > size or b < 0:
            raise CheckpointError(f"{path}: tensor '{name}' ({h['dtype']} {list(shape)}) has byte range {b}..{end}, "
                                  f"which does not fit its shape or the file's {size} bytes (truncated?)")
        entries[name] = _Entry(dtype, shape, base + b, base + end)
    return entries, {str(k): str(v) for k, v in meta.items()}


def _readinto(f: BufferedReader, offset: int, buf: torch.Tensor, path: Path, name: str) -> None:
    view = buf.view(-1).view(torch.uint8).numpy().data  # a writable memoryview over the tensor's bytes
    f.seek(offset)
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise CheckpointError(f"{path}: tensor '{name}' ends early: the file is truncated")
        got += n


class FileSource:
    """One safetensors file (header read at construction, tensors on demand)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.entries, self.metadata = read_header(self.path)
        self._f: BufferedReader | None = None

    def info(self) -> dict[str, TensorInfo]:
        return {k: TensorInfo(e.dtype, e.shape, str(self.path)) for k, e in self.entries.items()}

    def read(self, name: str, index: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        e = self.entries[name]
        shape, begin = e.shape, e.begin
        if index is not None:
            if not e.shape or not 0 <= index < e.shape[0]:
                raise CheckpointError(f"{self.path}: tensor '{name}' {list(e.shape)} has no row {index}")
            shape = e.shape[1:]
            begin += index * (e.end - e.begin) // e.shape[0]
        if out is not None and tuple(out.shape) != shape:
            raise CheckpointError(f"{self.path}: tensor '{name}' has shape {list(shape)}, expected "
                                  f"{list(out.shape)}")
        direct = out is not None and out.dtype == e.dtype and out.is_contiguous() and out.device.type == "cpu"
        buf = out if out is not None and direct else torch.empty(shape, dtype=e.dtype)
        if self._f is None:
            self._f = open(self.path, "rb")  # noqa: SIM115 - closed by close()
        if buf.numel():
            _readinto(self._f, begin, buf, self.path, name)
        if out is not None and not direct:
            with torch.no_grad():
                out.copy_(buf)
            return out
        return buf

    def read_rows(self, name: str, first: int, out: torch.Tensor) -> torch.Tensor:
        """Rows [first, first + len(out)) of tensor `name` into `out` (one contiguous read)."""
        e = self.entries[name]
        n = out.shape[0] if out.dim() else 0
        if not e.shape or first < 0 or first + n > e.shape[0] or tuple(out.shape[1:]) != e.shape[1:]:
            raise CheckpointError(f"{self.path}: tensor '{name}' {list(e.shape)} has no rows {first}..{first + n} "
                                  f"of shape {list(out.shape[1:])}")
        row = (e.end - e.begin) // e.shape[0] if e.shape[0] else 0
        direct = out.dtype == e.dtype and out.is_contiguous() and out.device.type == "cpu"
        buf = out if direct else torch.empty(tuple(out.shape), dtype=e.dtype)
        if self._f is None:
            self._f = open(self.path, "rb")  # noqa: SIM115 - closed by close()
        if buf.numel():
            _readinto(self._f, e.begin + first * row, buf, self.path, name)
        if not direct:
            with torch.no_grad():
                out.copy_(buf)
        return out

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


class DirectorySource:
    """The weights of a HF-style directory: `model.safetensors.index.json` and its shards, or one
    `model.safetensors` (or, lacking both, every `*.safetensors` file in it)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        index = self.path / INDEX_NAME
        if index.is_file():
            files = self._from_index(index)
        elif (self.path / SINGLE_NAME).is_file():
            files = [self.path / SINGLE_NAME]
        else:
            files = sorted(self.path.glob("*.safetensors"))
        if not files:
            bins = sorted(p.name for p in self.path.glob("*.bin"))
            hint = (f" (it has {', '.join(bins[:3])}: PyTorch pickles, which moebal does not unpickle; convert them "
                    f"once with transformers' `save_pretrained(..., safe_serialization=True)`)") if bins else ""
            raise CheckpointError(f"{self.path}: no safetensors weights (neither {INDEX_NAME} nor *.safetensors)"
                                  f"{hint}")
        self.files = [FileSource(f) for f in files]
        self._where: dict[str, FileSource] = {}
        for fs in self.files:
            for name in fs.entries:
                if name in self._where:
                    raise CheckpointError(f"tensor '{name}' is stored twice: in {self._where[name].path} and "
                                          f"{fs.path}")
                self._where[name] = fs
        self._check_index(index)

    def _from_index(self, index: Path) -> list[Path]:
        try:
            self._weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(self._weight_map.values()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise CheckpointError(f"{index}: not a valid safetensors index (expected a JSON object with a "
                                  f"'weight_map' of tensor -> file)") from None
        missing = [n for n in names if not (self.path / n).is_file()]
        if missing:
            raise CheckpointError(f"{index} names shard(s) that are missing: {', '.join(missing[:3])}: "
                                  f"download them or re-save the checkpoint")
        return [self.path / n for n in names]

    def _check_index(self, index: Path) -> None:
        wm = getattr(self, "_weight_map", None)
        if wm is None:
            return
        for name, file in wm.items():
            fs = self._where.get(name)
            if fs is None or fs.path.name != file:
                raise CheckpointError(f"{index} says '{name}' is in {file}, but "
                                      f"{'no shard holds it' if fs is None else f'it is in {fs.path.name}'}")

    def info(self) -> dict[str, TensorInfo]:
        out: dict[str, TensorInfo] = {}
        for fs in self.files:
            out.update(fs.info())
        return out

    def read(self, name: str, index: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        if name not in self._where:
            raise CheckpointError(f"{self.path}: no tensor named '{name}'")
        return self._where[name].read(name, index, out)

    def close(self) -> None:
        for fs in self.files:
            fs.close()


class StateDictSource:
    """An in-memory state dict (a live model's): reads are views, so nothing is copied."""

    in_memory = True

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def info(self) -> dict[str, TensorInfo]:
        return {k: TensorInfo(t.dtype, tuple(t.shape), "memory") for k, t in self.tensors.items()}

    def read(self, name: str, index: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        t = self.tensors[name].detach()
        if index is not None:
            t = t[index]
        if out is not None:
            with torch.no_grad():
                out.copy_(t)
            return out
        return t

    def close(self) -> None:
        pass


class ScratchReader:
    """Reads of a file source into one reused buffer, grown to the largest tensor read so far: a conversion
    that consumes each tensor before asking for the next holds one buffer, instead of a fresh allocation per
    tensor that the allocator may keep after it is freed. A returned tensor is valid until the next read."""

    def __init__(self, source: TensorSource) -> None:
        self.source = source
        self.in_memory = bool(getattr(source, "in_memory", False))
        self._buf = torch.empty(0, dtype=torch.uint8)
        self._info: dict[str, TensorInfo] | None = None

    def read(self, name: str, index: int | None = None) -> torch.Tensor:
        if self.in_memory:
            return self.source.read(name, index)  # views of live tensors: nothing to allocate
        t = (self._info or self.source.info())[name]
        shape = t.shape if index is None else t.shape[1:]
        size = torch.empty((), dtype=t.dtype).element_size()
        n = size
        for d in shape:
            n *= d
        if n > self._buf.numel():
            self._buf = torch.empty(0, dtype=torch.uint8)  # free the old buffer before the larger one exists
            self._buf = torch.empty(n, dtype=torch.uint8)
        out = self._buf[:n].view(t.dtype).view(shape)
        return self.source.read(name, index, out=out)

    def prime(self) -> ScratchReader:
        """Cache the source's tensor list (reads then do not re-list it)."""
        self._info = self.source.info()
        return self


# ---------------------------------------------------------------------------------------------
# writing


@dataclass(frozen=True)
class OutTensor:
    """One tensor of an output file: its name, dtype, shape, and a function producing its values when its
    bytes are written: one tensor, or consecutive pieces along the first dimension (a stacked tensor written
    expert by expert never exists whole)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    produce: Callable[[], torch.Tensor | Iterable[torch.Tensor]]

    @property
    def nbytes(self) -> int:
        n = torch.empty((), dtype=self.dtype).element_size()
        for s in self.shape:
            n *= s
        return n


def _header(entries: Sequence[OutTensor], metadata: dict[str, str] | None) -> bytes:
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for t in entries:
        header[t.name] = {"dtype": dtype_name(t.dtype), "shape": list(t.shape),
                          "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    return raw + b" " * (-len(raw) % 8)  # the reference writer pads the header to 8 bytes with spaces


def write_safetensors(path: str | Path, entries: Sequence[OutTensor], metadata: dict[str, str] | None = None
                      ) -> int:
    """Write `entries` to `path` (via a temporary file, fsync'ed, then renamed), producing one tensor at a
    time; returns the bytes written."""
    path = Path(path)
    header = _header(entries, metadata)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    total = 8 + len(header)
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            for t in entries:
                total += _write_tensor(f, t)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return total


def _write_tensor(f: BinaryIO, t: OutTensor) -> int:
    produced = t.produce()
    pieces = [produced] if isinstance(produced, torch.Tensor) else produced
    written = 0
    for value in pieces:
        value = value.detach().to(device="cpu", dtype=t.dtype).contiguous()
        if value.numel():
            f.write(value.view(-1).view(torch.uint8).numpy().data)
        written += value.numel() * value.element_size()
        del value
    if written != t.nbytes:
        raise CheckpointError(f"tensor '{t.name}' produced {written} bytes, expected {t.nbytes} for "
                              f"{list(t.shape)} {t.dtype}")
    return written


def iter_shards(entries: Sequence[OutTensor], max_bytes: int) -> Iterator[list[OutTensor]]:
    """Consecutive groups of entries of at most `max_bytes` each (a larger tensor gets a shard of its own)."""
    shard: list[OutTensor] = []
    size = 0
    for t in entries:
        if shard and size + t.nbytes > max_bytes:
            yield shard
            shard, size = [], 0
        shard.append(t)
        size += t.nbytes
    if shard:
        yield shard
