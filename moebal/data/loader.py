"""Training samples from a tokenised split: packed blocks or variable-length documents, in batches.

Shape legend: B = batch, T = sequence (seq_len in packed mode, the batch's longest sample in document mode),
S = samples in an epoch, N = tokens in the split.

Both samplers are pure functions of (split, seq_len, batch size, seed) and a position (epoch, index): the
epoch's order and packing offset come from `numpy.random.default_rng([seed, epoch])`, so the loader state is
two integers plus the seed, and a resumed run reads exactly the batches the uninterrupted run would have.
Labels are the inputs shifted by one token (`labels[t] = token[t + 1]`); padding positions carry label -100,
which the model's loss ignores.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moebal.config import Config
from moebal.data.corpus import Corpus, Split, load_corpus, merge_corpora
from moebal.data.curriculum import Curriculum
from moebal.errors import DataError

__all__ = ["Batch", "DataBundle", "DocumentSampler", "MixtureSampler", "PackedSampler", "build_data", "eval_batches",
           "ordering_sampler"]

IGNORE = -100


@dataclass(frozen=True)
class Batch:
    """Model inputs and next-token labels; `n_tokens` counts the positions that carry a label."""

    ids_BT: torch.Tensor
    labels_BT: torch.Tensor
    n_tokens: int

    def to(self, device: torch.device | str) -> Batch:
        return Batch(self.ids_BT.to(device), self.labels_BT.to(device), self.n_tokens)

    def part(self, i: int, n: int) -> Batch:
        """Rows i B/n .. (i+1) B/n (rounded down) of the batch's B rows with their own label count: a rank's share
        (`RunContext.shard`), a micro-batch (`train.grad_accum`). Training batches divide evenly (the config
        check); a validation set smaller than one batch may leave a part fewer rows, or none."""
        B = self.ids_BT.shape[0]
        lo, hi = i * B // n, (i + 1) * B // n
        labels = self.labels_BT[lo:hi]
        return Batch(self.ids_BT[lo:hi], labels, int((labels != IGNORE).sum()))


def _batch_from_rows(rows: list[np.ndarray]) -> Batch:
    """Right-pad rows of (len + 1) tokens; inputs are row[:-1], labels row[1:], padding labelled -100."""
    width = max(len(r) for r in rows) - 1
    ids_BT = np.zeros((len(rows), width), dtype=np.int64)
    labels_BT = np.full((len(rows), width), IGNORE, dtype=np.int64)
    n = 0
    for b, r in enumerate(rows):
        ids_BT[b, : len(r) - 1] = r[:-1]
        labels_BT[b, : len(r) - 1] = r[1:]
        n += len(r) - 1
    return Batch(torch.from_numpy(ids_BT), torch.from_numpy(labels_BT), n)


class _Sampler:
    """A shuffled, endless stream of samples; subclasses say what sample i of an epoch is."""

    def __init__(self, split: Split, seq_len: int, batch_size: int, seed: int) -> None:
        self.split, self.seq_len, self.batch_size, self.seed = split, seq_len, batch_size, seed
        self.epoch, self.index = 0, 0
        self._order_epoch = -1
        self._order: np.ndarray = np.zeros(0, dtype=np.int64)
        self._offset = 0
        self.curriculum: Curriculum | None = None
        """`data.order: complexity`: epochs after the first are ordered by it (moebal/data/curriculum.py), and
        packed blocks keep the first epoch's offset so a sample is the same text in every epoch."""
        self._crc: int | None = None
        self.last_ids: list[int] = []
        """Sample ids (within the epoch's sample space) of the rows of the last `next_samples()`."""
        self.curriculum_lag = 0
        """Samples before an epoch's start whose complexities its order leaves out: a reader that draws batches
        ahead of training (planned micro-batching's lookahead) orders an epoch before its last batches were
        measured, and leaves them out so that the order does not depend on when it was taken (`Curriculum`)."""
        self._lags: dict[int, int] = {}
        """The lag an epoch was ordered with, for the epoch a checkpoint restores (a resume under another lag
        orders the rest of that epoch as it began: every sample once; the new lag from the next epoch on)."""

    def _num_samples(self) -> int:
        raise NotImplementedError

    def set_curriculum_lag(self, samples: int) -> None:
        """Order each epoch without the complexities of its last `samples` samples before it (`curriculum_lag`),
        keeping enough entries per sample for that."""
        assert self.curriculum is not None, "a curriculum lag without a curriculum"
        self.curriculum_lag = samples
        self.curriculum.keep = self.curriculum_keep(samples)

    def curriculum_keep(self, lag: int) -> int:
        """Entries per sample the curriculum keeps (`Curriculum.keep`): the one an epoch's order uses, and those
        recorded after it before the order can be taken again on resume: the batch that crosses into the epoch
        (up to batch_size - 1 samples of the epoch before), the epoch's own draw, and what the lag reaches back."""
        return 2 + -(-(lag + self.batch_size - 1) // self._num_samples())

    def _sample(self, i: int, offset: int) -> np.ndarray:
        raise NotImplementedError

    def _shuffle(self, epoch: int) -> None:
        if self._order_epoch != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._offset = int(rng.integers(self.seq_len))
            self._order = rng.permutation(self._num_samples())
            if self.curriculum is not None:
                self._offset = int(np.random.default_rng([self.seed, 0]).integers(self.seq_len))
                if epoch > 0:
                    self._lags = {epoch: self._lags.get(epoch, self.curriculum_lag)}  # the current epoch's only
                    self._order = self.curriculum.order(self._order,
                                                        upto=epoch * self._num_samples() - self._lags[epoch])
            self._order_epoch = epoch

    @property
    def position(self) -> int:
        """Samples drawn so far over the run."""
        return self.epoch * self._num_samples() + self.index

    def _next(self) -> tuple[int, np.ndarray]:
        self._shuffle(self.epoch)
        i = int(self._order[self.index])
        row = self._sample(i, self._offset)
        self.index += 1
        if self.index == len(self._order):
            self.epoch, self.index = self.epoch + 1, 0
        return i, row

    def next_sample(self) -> np.ndarray:
        """The next sample's len + 1 tokens (inputs row[:-1], labels row[1:])."""
        return self._next()[1]

    def next_samples(self) -> list[np.ndarray]:
        """The next batch's samples, unpadded (each keeps its own length)."""
        drawn = [self._next() for _ in range(self.batch_size)]
        self.last_ids = [i for i, _ in drawn]
        return [row for _, row in drawn]

    def next_batch(self) -> Batch:
        return _batch_from_rows(self.next_samples())

    def state_dict(self, table: bool = True) -> dict[str, Any]:
        """The position (and the curriculum's lag and, with `table`, its table): what a resume restores."""
        state = {"kind": type(self).__name__, "epoch": self.epoch, "index": self.index, "seed": self.seed,
                 "seq_len": self.seq_len, "batch_size": self.batch_size, "samples": self._num_samples(),
                 "tokens": self._fingerprint()}
        if self.curriculum is not None:
            if table:
                state["curriculum"] = self.curriculum.state_dict()
            state["curriculum_lag"] = self._lags.get(self.epoch, self.curriculum_lag)  # the lag of this epoch
        return state

    def _fingerprint(self) -> int:
        """CRC-32 of the split's length and of up to 2**20 of its tokens, evenly spaced (computed once): another
        tokenizer (or data) with the same sample count gives other tokens, which a resume must not train on."""
        if self._crc is None:
            tokens = self.split.tokens_N
            picked = tokens[::max(1, len(tokens) >> 20)].astype(np.int64)
            self._crc = zlib.crc32(picked.tobytes(), zlib.crc32(np.int64(len(tokens)).tobytes()))
        return int(self._crc)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()
        for key in ("kind", "seed", "seq_len", "batch_size", "samples"):
            if state.get(key) != mine[key]:
                raise DataError(f"the checkpoint's data loader has {key}={state.get(key)!r} but this run has "
                                f"{mine[key]!r}: resume with the same data and config")
        if "tokens" in state and state["tokens"] != mine["tokens"]:  # (checkpoints before the field: not checked)
            raise DataError("the checkpoint's training data are other tokens than this run's (the same samples, "
                            "another data.tokenizer or data.source): resume with the data and tokenizer the run "
                            "was trained with")
        if (self.curriculum is not None) != ("curriculum" in state):
            raise DataError(f"the checkpoint's data order is {'complexity' if 'curriculum' in state else 'shuffle'} "
                            f"but this run's is {'complexity' if self.curriculum is not None else 'shuffle'}: "
                            f"resume with the run's data.order")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order_epoch = -1  # the order is recomputed for the restored epoch, with the lag it began with
        if self.curriculum is not None:
            self.curriculum.load_state_dict(state["curriculum"])
            self._lags = {self.epoch: int(state.get("curriculum_lag", 0))}


class PackedSampler(_Sampler):
    """Fixed blocks of seq_len + 1 tokens cut from the concatenated split, at a random offset per epoch (so
    block boundaries move between epochs), in a random order."""

    def __init__(self, split: Split, seq_len: int, batch_size: int, seed: int) -> None:
        super().__init__(split, seq_len, batch_size, seed)
        # Blocks that fit for every offset in [0, seq_len): offset + n * seq_len + 1 <= N.
        self._n = (split.n_tokens - seq_len) // seq_len
        if self._n < 1:
            raise DataError(f"the training split has {split.n_tokens} tokens, too few for one block of "
                            f"data.seq_len={seq_len} (+ a random offset): lower data.seq_len or add data")

    def _num_samples(self) -> int:
        return self._n

    def _sample(self, i: int, offset: int) -> np.ndarray:
        start = offset + i * self.seq_len
        return self.split.tokens_N[start : start + self.seq_len + 1]


def _document_spans(split: Split, seq_len: int) -> np.ndarray:
    """[S, 2] (start, end) of every document cut into pieces of at most seq_len + 1 tokens; consecutive
    pieces overlap by one token so every next-token target is predicted exactly once."""
    spans = []
    for a, b in zip(split.offsets_M[:-1].tolist(), split.offsets_M[1:].tolist()):
        for s in range(a, b - 1, seq_len):
            spans.append((s, min(s + seq_len + 1, b)))
    return np.asarray(spans, dtype=np.int64).reshape(-1, 2)


class DocumentSampler(_Sampler):
    """Documents at their natural length (cut at seq_len), shuffled, padded to the batch's longest."""

    def __init__(self, split: Split, seq_len: int, batch_size: int, seed: int) -> None:
        super().__init__(split, seq_len, batch_size, seed)
        self._spans = _document_spans(split, seq_len)
        if len(self._spans) == 0:
            raise DataError("the training split has no document of two or more tokens")

    def _num_samples(self) -> int:
        return len(self._spans)

    def _sample(self, i: int, offset: int) -> np.ndarray:
        s, e = self._spans[i]
        return self.split.tokens_N[s:e]


def _files(names: Any) -> list[str] | None:
    """Mixture source names as resolved paths ('stdlib' as it is); None for a state without a list."""
    if not isinstance(names, list):
        return None
    return [n if n == "stdlib" else str(Path(n).expanduser().resolve()) for n in map(str, names)]


class MixtureSampler:
    """Samples drawn from several sources with weights: for each sample of batch n, the source is drawn from
    `numpy.random.default_rng([seed, 104729, n])` (a pure function of the batch index), then that source's own
    shuffled stream gives its next sample. State: the batch count and every source's (epoch, index)."""

    def __init__(self, samplers: list[_Sampler], names: list[str], weights: list[float], batch_size: int,
                 seed: int) -> None:
        if not samplers or len(samplers) != len(weights) or min(weights) <= 0:
            raise DataError("a data mixture needs at least one source and a positive weight per source")
        self.samplers, self.names, self.batch_size, self.seed = samplers, names, batch_size, seed
        self.weights = [float(w) for w in weights]
        self._p = np.asarray(self.weights) / sum(self.weights)
        self.batches = 0

    def next_samples(self) -> list[np.ndarray]:
        rng = np.random.default_rng([self.seed, 104729, self.batches])
        picks = rng.choice(len(self.samplers), size=self.batch_size, p=self._p)
        self.batches += 1
        return [self.samplers[int(k)].next_sample() for k in picks]

    def next_batch(self) -> Batch:
        return _batch_from_rows(self.next_samples())

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "MixtureSampler", "batches": self.batches, "sources": list(self.names),
                "weights": list(self.weights), "parts": [s.state_dict() for s in self.samplers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Sources compare as the files they name (a run started with relative paths, resumed with the absolute
        ones `moebal train` now writes into config.yaml, is the same mixture)."""
        if state.get("kind") != "MixtureSampler" or _files(state.get("sources")) != _files(self.names) \
                or state.get("weights") != self.weights:
            raise DataError(f"the checkpoint's data loader ({state.get('kind')}, sources {state.get('sources')}, "
                            f"weights {state.get('weights')}) is not this run's mixture ({self.names}, "
                            f"{self.weights}): resume with the same data.mixture")
        for sampler, part in zip(self.samplers, state["parts"]):
            sampler.load_state_dict(part)
        self.batches = int(state["batches"])


def ordering_sampler(sampler: Any) -> PackedSampler | DocumentSampler | None:
    """`sampler` when it orders epochs by complexity (`data.order: complexity`), else None: where a trainer records
    each step's row complexities. A mixture of sources has no curriculum (build_data gives one to a single
    source only)."""
    if isinstance(sampler, (PackedSampler, DocumentSampler)) and sampler.curriculum is not None:
        return sampler
    return None


def eval_batches(split: Split, mode: str, seq_len: int, batch_size: int, n_batches: int) -> list[Batch]:
    """A fixed validation set: up to n_batches * batch_size samples spread evenly over the split, in whole
    batches of batch_size rows (the ranks split them as they split a training batch); a split of fewer samples
    than one batch gives one batch of all of them."""
    if split.n_tokens < 2:
        return []
    if mode == "packed":
        n = max((split.n_tokens - 1) // seq_len, 1)
        width = min(seq_len, split.n_tokens - 1)
        spans = np.array([(i * seq_len, i * seq_len + width + 1) for i in range(n)], dtype=np.int64)
    else:
        spans = _document_spans(split, seq_len)
    take = min(len(spans), n_batches * batch_size)
    take = take // batch_size * batch_size or take  # whole batches: a short last one would leave ranks rowless
    pick = np.unique(np.linspace(0, len(spans) - 1, take).round().astype(np.int64))
    rows = [split.tokens_N[s:e] for s, e in spans[pick]]
    return [_batch_from_rows(rows[i : i + batch_size]) for i in range(0, len(rows), batch_size)]


@dataclass
class DataBundle:
    """Everything the trainer takes from the data side."""

    corpus: Corpus
    """The source (a mixture: every source's documents in one corpus, for summaries and validation)."""
    train: _Sampler | MixtureSampler
    val: list[Batch]


def _refuse_overlap(sources: list[str]) -> None:
    """A mixture's sources must not share files: each source splits its own documents, so a file in two sources
    could be validation text in one and training text in the other."""
    paths = [(s, Path(s).expanduser().resolve()) for s in sources if Path(s).expanduser().exists()]
    for i, (a, pa) in enumerate(paths):
        for b, pb in paths[i + 1:]:
            if pa == pb or pa in pb.parents or pb in pa.parents:
                raise DataError(f"data.mixture: sources {a!r} and {b!r} share files ({pb if pa in pb.parents else pa}"
                                f" is in both), which could put one file's text in one source's validation split and "
                                f"the other's training split: give each file to one source")


def build_data(cfg: Config, seed: int | None = None) -> DataBundle:
    d = cfg.data
    sources = list(d.mixture) if d.mixture else [d.source]
    _refuse_overlap(sources)
    corpora = [load_corpus(src, d.tokenizer, text_key=d.text_key, val_fraction=d.val_fraction,
                           max_bytes=d.max_bytes, add_special_tokens=d.add_special_tokens,
                           units=d.units) for src in sources]
    for corpus in corpora:
        if corpus.vocab_size > cfg.model.vocab_size:
            raise DataError(f"the tokenizer has {corpus.vocab_size} tokens but model.vocab_size is "
                            f"{cfg.model.vocab_size}: set model.vocab_size={corpus.vocab_size}")
    cls = PackedSampler if d.samples == "packed" else DocumentSampler
    seed = cfg.train.seed if seed is None else seed
    train: _Sampler | MixtureSampler
    if d.mixture:
        parts: list[_Sampler] = [cls(c.train, d.seq_len, d.batch_size, seed + 7919 * k) for k, c in enumerate(corpora)]
        train = MixtureSampler(parts, sources, [d.mixture[s] for s in sources], d.batch_size, seed)
        weights = ",".join(f"{s}:{d.mixture[s]:g}" for s in sources)
        corpus = merge_corpora(corpora, f"mixture({weights})")
    else:
        corpus = corpora[0]
        train = cls(corpus.train, d.seq_len, d.batch_size, seed)
        if d.order == "complexity":
            train.curriculum = Curriculum(d.order_metric)
            train.curriculum.keep = train.curriculum_keep(0)
    val = eval_batches(corpus.val, d.samples, d.seq_len, d.batch_size, cfg.train.eval_batches)
    return DataBundle(corpus=corpus, train=train, val=val)
