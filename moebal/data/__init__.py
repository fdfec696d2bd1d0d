"""Corpora, tokenizers and training samples."""

from moebal.data.corpus import Corpus, Split, load_corpus, unigram_entropy
from moebal.data.loader import (
    Batch,
    DataBundle,
    DocumentSampler,
    MixtureSampler,
    PackedSampler,
    build_data,
    eval_batches,
    ordering_sampler,
)
from moebal.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "Batch",
    "ByteTokenizer",
    "Corpus",
    "DataBundle",
    "DocumentSampler",
    "HFTokenizer",
    "MixtureSampler",
    "PackedSampler",
    "Split",
    "Tokenizer",
    "build_data",
    "eval_batches",
    "load_corpus",
    "load_tokenizer",
    "ordering_sampler",
    "unigram_entropy",
]
