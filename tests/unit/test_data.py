"""Data pipeline: corpora, split, tokenizers, samplers and their errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from moebal.config import Config, with_overrides
from moebal.data import build_data, load_corpus
from moebal.data.corpus import _load_cached, iter_documents, stdlib_root, unigram_entropy, val_share
from moebal.data.loader import DocumentSampler, PackedSampler, eval_batches
from moebal.errors import DataError


@pytest.fixture(autouse=True)
def _fresh_cache():
    _load_cached.cache_clear()
    yield
    _load_cached.cache_clear()


def _write_docs(root: Path, n: int, size: int = 200) -> list[str]:
    names = []
    for i in range(n):
        p = root / f"d{i // 10}" / f"doc{i:03d}.txt"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(f"document {i}: " + "abcdefghij"[i % 10] * size + "\n", encoding="utf-8")
        names.append(p.relative_to(root).as_posix())
    return names


# ---- corpus and split -----------------------------------------------------------------------------------


def test_stdlib_corpus_is_library_code_only():
    names = [name for name, _ in iter_documents("stdlib")]
    assert names == sorted(names) and len(names) > 100
    parts = {part for name in names for part in name.split("/")[:-1]}
    assert not parts & {"site-packages", "test", "tests", "idle_test", "__pycache__"}
    assert all(name.endswith(".py") for name in names)
    corpus = load_corpus("stdlib", val_fraction=0.05)
    assert corpus.vocab_size == 256 and corpus.train.tokens_N.dtype == np.uint8
    assert corpus.train.n_tokens > 1_000_000 and 0 < corpus.val.n_tokens < corpus.train.n_tokens
    # Python source over bytes: a few nats of unigram entropy (3.24 on CPython 3.11)
    assert 2.5 < corpus.unigram_entropy < 4.0
    assert stdlib_root().is_dir()


def test_split_is_by_path_hash_deterministic_and_independent_of_other_files(tmp_path):
    names = _write_docs(tmp_path, 60)
    a = load_corpus(str(tmp_path), val_fraction=0.3)
    _load_cached.cache_clear()
    b = load_corpus(str(tmp_path), val_fraction=0.3)
    assert np.array_equal(a.train.tokens_N, b.train.tokens_N) and np.array_equal(a.val.tokens_N, b.val.tokens_N)
    in_val = {n for n in names if val_share(n) < 0.3}
    assert 0 < len(in_val) < len(names)
    assert a.val.n_docs == len(in_val) and a.split_by == "path-hash"
    # adding files leaves every existing document on its side of the split
    (tmp_path / "zzz").mkdir()
    for i in range(5):
        (tmp_path / "zzz" / f"new{i}.txt").write_text("new text " * 20, encoding="utf-8")
    _load_cached.cache_clear()
    c = load_corpus(str(tmp_path), val_fraction=0.3)
    assert c.val.n_docs == len(in_val) + sum(val_share(f"zzz/new{i}.txt") < 0.3 for i in range(5))
    # the validation documents' bytes are exactly the hash-chosen ones, in path order
    expected = b"".join((tmp_path / n).read_bytes() for n in sorted(in_val))
    assert a.val.tokens_N.tobytes() == expected


def test_single_file_falls_back_to_holding_out_its_tail(tmp_path):
    p = tmp_path / "one.txt"
    p.write_text("x" * 900 + "y" * 100, encoding="utf-8")
    c = load_corpus(str(p), val_fraction=0.1)
    assert c.split_by == "tail"
    assert c.train.tokens_N.tobytes() == b"x" * 900 and c.val.tokens_N.tobytes() == b"y" * 100


def test_a_single_file_s_blocks_keep_their_endings_under_the_tail_split(tmp_path):
    """`units: blocks` of one file: the tail held out is the file's (its last blocks, the block the cut falls in
    split), not every block's, so the training blocks before the cut are whole."""
    blocks = [f"def f{i}():\n    return {i}\n\n".encode() for i in range(10)]  # 10 blocks of 26-27 bytes
    (tmp_path / "one.txt").write_bytes(b"".join(blocks))
    c = load_corpus(str(tmp_path / "one.txt"), val_fraction=0.2, units="blocks")
    files = load_corpus(str(tmp_path / "one.txt"), val_fraction=0.2)
    assert c.split_by == "tail" and c.val.tokens_N.tobytes() == files.val.tokens_N.tobytes()  # the file's tail
    train = [c.train.tokens_N[a:b].tobytes() for a, b in zip(c.train.offsets_M[:-1], c.train.offsets_M[1:])]
    assert train[:-1] == blocks[:len(train) - 1] and blocks[len(train) - 1].startswith(train[-1])


def test_unigram_entropy_matches_hand_computed():
    tokens = np.array([0, 0, 1, 2], dtype=np.uint8)
    expected = -(0.5 * np.log(0.5) + 2 * 0.25 * np.log(0.25))
    assert unigram_entropy(tokens, 256) == pytest.approx(expected)


def test_max_bytes_reads_a_prefix(tmp_path):
    _write_docs(tmp_path, 20)
    c = load_corpus(str(tmp_path), val_fraction=0.0, max_bytes=500)
    assert c.train.n_tokens == 500


def test_max_bytes_cut_inside_a_character_ends_the_prefix(tmp_path):
    """The 5th byte would split an "é": the prefix is "abcd" (whole characters), not "abcd" and the next
    document's first byte in the cut character's place."""
    (tmp_path / "1.txt").write_bytes(b"abcd")
    (tmp_path / "2.txt").write_text("\u00e9" * 4, encoding="utf-8")
    (tmp_path / "3.txt").write_bytes(b"xyz")
    c = load_corpus(str(tmp_path), val_fraction=0.0, max_bytes=5)
    assert bytes(c.train.tokens_N.tolist()) == b"abcd" and c.train.n_docs == 1


# ---- errors ---------------------------------------------------------------------------------------------


def test_missing_and_empty_sources_raise_data_error(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_corpus(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no text"):
        load_corpus(str(tmp_path / "empty"))
    (tmp_path / "a.csv").write_text("x,y\n", encoding="utf-8")
    with pytest.raises(DataError, match="neither a .txt nor a .jsonl"):
        load_corpus(str(tmp_path / "a.csv"))


def test_undecodable_documents_are_skipped_and_counted_in_txt_and_jsonl_alike(tmp_path, capsys):
    # one rule (docs/data.md): a .txt file or a .jsonl line that is not UTF-8 is skipped, counted and named
    _write_docs(tmp_path, 12)
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe\x00 not utf-8 \x80")
    (tmp_path / "mixed.jsonl").write_bytes(b'{"text": "fine text here"}\n{"text": "caf\xe9"}\n'
                                           b'{"text": "a lone surrogate \\udc80 escaped"}\n')
    c = load_corpus(str(tmp_path), val_fraction=0.2)
    assert c.n_skipped == 3
    assert "skipped 3 document(s) not valid UTF-8, the first bad.txt" in capsys.readouterr().err
    only_bad = tmp_path / "onlybad"
    only_bad.mkdir()
    (only_bad / "b.jsonl").write_bytes(b'{"text": "\xff\xff"}\n')
    with pytest.raises(DataError, match="holds no text .*skipped 1 document.*the first b.jsonl:1"):
        load_corpus(str(only_bad))


def test_jsonl_records_and_errors_name_the_line(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text("\n".join(json.dumps({"text": f"record {i} " * 10, "id": i}) for i in range(30)) + "\n",
                    encoding="utf-8")
    c = load_corpus(str(good), val_fraction=0.2)
    assert c.train.n_docs + c.val.n_docs == 30
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n\n{"text": broken\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"bad\.jsonl:3: not a JSON object"):
        load_corpus(str(bad))
    nokey = tmp_path / "nokey.jsonl"
    nokey.write_text('{"body": "text here"}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"nokey\.jsonl:1: no 'text' field \(found: body\).*data.text_key"):
        load_corpus(str(nokey))
    assert load_corpus(str(nokey), text_key="body", val_fraction=0.0).train.n_tokens == len("text here")
    notstr = tmp_path / "notstr.jsonl"
    notstr.write_text('{"text": 5}\n', encoding="utf-8")
    with pytest.raises(DataError, match="notstr.jsonl:1: field 'text' is int"):
        load_corpus(str(notstr))


def test_tokenizer_vocab_larger_than_model_is_a_clear_error(tmp_path):
    tok = _tiny_tokenizer(tmp_path)
    cfg = with_overrides(Config(), [f"data.source={tmp_path / 'corpus.txt'}", f"data.tokenizer={tok}",
                                    "data.seq_len=8", "model.vocab_size=3"])
    with pytest.raises(DataError, match="set model.vocab_size="):
        build_data(cfg)
    with pytest.raises(DataError, match="not a file"):
        load_corpus(str(tmp_path / "corpus.txt"), str(tmp_path / "missing.json"))


# ---- HF tokenizer.json ----------------------------------------------------------------------------------


def _tiny_tokenizer(tmp_path: Path) -> Path:
    tokenizers = pytest.importorskip("tokenizers", reason="the tokenizers package (moebal[hf]) is not installed")
    from tokenizers import models, pre_tokenizers, trainers

    text = "def add(a, b):\n    return a + b\n" * 40 + "class Point:\n    x: int\n    y: int\n" * 40
    (tmp_path / "corpus.txt").write_text(text, encoding="utf-8")
    tok = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train([str(tmp_path / "corpus.txt")], trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"],
                                                                 initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


def test_hf_tokenizer_json_tokenises_the_corpus(tmp_path):
    import tokenizers

    path = _tiny_tokenizer(tmp_path)
    reference = tokenizers.Tokenizer.from_file(str(path))
    c = load_corpus(str(tmp_path / "corpus.txt"), str(path), val_fraction=0.1)
    assert c.vocab_size == reference.get_vocab_size()
    text = (tmp_path / "corpus.txt").read_text(encoding="utf-8")
    ids = reference.encode(text, add_special_tokens=False).ids
    assert np.concatenate([c.train.tokens_N, c.val.tokens_N]).tolist() == ids  # tail split of one file
    assert c.train.n_tokens < len(text)  # merges happened: fewer tokens than bytes
    cfg = with_overrides(Config(), [f"data.source={tmp_path / 'corpus.txt'}", f"data.tokenizer={path}",
                                    "data.seq_len=16", "data.batch_size=2", f"model.vocab_size={c.vocab_size}"])
    batch = build_data(cfg).train.next_batch()
    assert batch.ids_BT.shape == (2, 16) and int(batch.ids_BT.max()) < c.vocab_size


# ---- samplers -------------------------------------------------------------------------------------------


def test_packed_batches_are_shifted_blocks_of_the_split(tmp_path):
    _write_docs(tmp_path, 40)
    c = load_corpus(str(tmp_path), val_fraction=0.1)
    s = PackedSampler(c.train, seq_len=32, batch_size=4, seed=1)
    text = c.train.tokens_N.tobytes()
    for _ in range(5):
        b = s.next_batch()
        assert b.ids_BT.shape == (4, 32) and b.n_tokens == 128
        assert torch.equal(b.ids_BT[:, 1:], b.labels_BT[:, :-1])
        for row_ids, row_labels in zip(b.ids_BT, b.labels_BT):
            block = bytes(row_ids.tolist()) + bytes([int(row_labels[-1])])
            assert block in text


def test_sampler_state_resumes_exactly_across_epochs(tmp_path):
    _write_docs(tmp_path, 10, size=40)
    c = load_corpus(str(tmp_path), val_fraction=0.0)
    for cls in (PackedSampler, DocumentSampler):
        a = cls(c.train, seq_len=16, batch_size=8, seed=3)
        ref = [a.next_batch() for _ in range(12)]  # several epochs of this small corpus
        assert a.epoch >= 2
        b = cls(c.train, seq_len=16, batch_size=8, seed=3)
        for _ in range(5):
            b.next_batch()
        state = json.loads(json.dumps(b.state_dict()))  # survives JSON (the checkpoint's state.json)
        resumed = cls(c.train, seq_len=16, batch_size=8, seed=3)
        resumed.load_state_dict(state)
        for want in ref[5:]:
            got = resumed.next_batch()
            assert torch.equal(got.ids_BT, want.ids_BT) and torch.equal(got.labels_BT, want.labels_BT)
        other = cls(c.train, seq_len=16, batch_size=8, seed=4)
        assert not torch.equal(other.next_batch().ids_BT, ref[0].ids_BT)
        with pytest.raises(DataError, match="seed"):
            other.load_state_dict(state)
        # the same samples of other tokens (a tokenizer of the same size with its ids permuted): refused
        permuted = type(c.train)(tokens_N=(255 - c.train.tokens_N).astype(c.train.tokens_N.dtype),
                                 offsets_M=c.train.offsets_M)
        with pytest.raises(DataError, match="other tokens than this run's"):
            cls(permuted, seq_len=16, batch_size=8, seed=3).load_state_dict(state)
        older = {k: v for k, v in state.items() if k != "tokens"}  # a checkpoint from before the field
        cls(c.train, seq_len=16, batch_size=8, seed=3).load_state_dict(older)


def test_document_samples_keep_natural_length_with_padding_labelled_ignore(tmp_path):
    root = tmp_path / "docs"
    root.mkdir()
    lengths = [5, 9, 30, 3, 17, 12]
    for i, n in enumerate(lengths):
        (root / f"{i}.txt").write_text(chr(ord("a") + i) * n, encoding="utf-8")
    c = load_corpus(str(root), val_fraction=0.0)
    s = DocumentSampler(c.train, seq_len=12, batch_size=3, seed=0)
    # 30 tokens cut at seq_len 12 -> pieces of 13, 13, 6 tokens (one token overlap); 17 -> 13, 5
    assert sorted(int(e - a) for a, e in s._spans) == sorted([5, 9, 13, 13, 6, 3, 13, 5, 12])
    seen = 0
    for _ in range(3):
        b = s.next_batch()
        valid = b.labels_BT != -100
        assert b.n_tokens == int(valid.sum())
        lens = valid.sum(1)
        assert b.ids_BT.shape[1] == int(lens.max()) <= 12  # padded to the batch's longest sample
        for row in range(3):
            n = int(lens[row])
            assert valid[row, :n].all() and not valid[row, n:].any()  # right padding
            assert (b.ids_BT[row, n:] == 0).all()
            assert torch.equal(b.ids_BT[row, 1:n], b.labels_BT[row, : n - 1])
            assert len(set(b.ids_BT[row, :n].tolist() + [int(b.labels_BT[row, n - 1])])) == 1  # one document
        seen += b.n_tokens
    assert seen == sum(n - 1 for n in lengths)  # one epoch: every next-token target exactly once


def test_eval_batches_are_fixed_and_spread_over_the_split(tmp_path):
    _write_docs(tmp_path, 50)
    c = load_corpus(str(tmp_path), val_fraction=0.5)
    a = eval_batches(c.val, "packed", 32, 4, 3)
    b = eval_batches(c.val, "packed", 32, 4, 3)
    assert len(a) == 3 and all(torch.equal(x.ids_BT, y.ids_BT) for x, y in zip(a, b))
    first, last = a[0].ids_BT[0], a[-1].ids_BT[-1]
    assert bytes(first.tolist()) == c.val.tokens_N[:32].tobytes()
    assert bytes(last.tolist()) in c.val.tokens_N[-3 * 32 :].tobytes()
    assert eval_batches(c.val, "documents", 32, 4, 2)[0].labels_BT.shape[0] == 4
    # whole batches only: a short last one would leave some of the ranks that split it without a row (NaN, or
    # a pipeline's refusal mid-run); a split smaller than one batch gives one batch of all of it
    n_spans = (c.val.n_tokens - 1) // 32
    assert n_spans % 3 and n_spans > 3, n_spans  # the case: a partial last batch of 3 if every span were taken
    whole = eval_batches(c.val, "packed", 32, 3, 1000)
    assert len(whole) == n_spans // 3 and {x.ids_BT.shape[0] for x in whole} == {3}
    assert [x.ids_BT.shape[0] for x in eval_batches(c.val, "packed", 32, n_spans + 5, 2)] == [n_spans]
    whole = eval_batches(c.val, "packed", 32, 4, 2)
    # a batch's parts cover every row (rows i B/n .. (i+1) B/n), evenly where n divides B
    batch = whole[0]
    assert [batch.part(i, 2).ids_BT.shape[0] for i in range(2)] == [2, 2]
    three = [batch.part(i, 3) for i in range(3)]
    assert [x.ids_BT.shape[0] for x in three] == [1, 1, 2]
    assert torch.equal(torch.cat([x.ids_BT for x in three]), batch.ids_BT)
    assert sum(x.n_tokens for x in three) == batch.n_tokens
    assert batch.part(0, 5).ids_BT.shape[0] == 0 and batch.part(0, 5).n_tokens == 0


def test_too_little_data_for_one_block_is_a_clear_error(tmp_path):
    (tmp_path / "t.txt").write_text("tiny", encoding="utf-8")
    c = load_corpus(str(tmp_path / "t.txt"), val_fraction=0.0)
    with pytest.raises(DataError, match="lower data.seq_len"):
        PackedSampler(c.train, seq_len=64, batch_size=2, seed=0)


def test_blocks_are_natural_lossless_documents(tmp_path):
    from moebal.data.corpus import split_blocks

    text = (b"import os\n\n\n# note\ndef f():\n    x = 1\n\n    return x\n\n"
            b"class A:\n    y = [\n        1,\n\n]\n\nz = 2\n")
    blocks = split_blocks(text)
    assert b"".join(blocks) == text
    assert [b.split(b"\n")[0] for b in blocks] == [b"import os", b"# note", b"class A:", b"z = 2"]
    crlf = text.replace(b"\n", b"\r\n")  # Windows line ends cut the same blocks
    assert [b.replace(b"\r\n", b"\n") for b in split_blocks(crlf)] == blocks
    assert b"".join(split_blocks(crlf)) == crlf
    (tmp_path / "a.py.txt").write_bytes(text)
    (tmp_path / "b.jsonl").write_text('{"text": "one sample\\n\\nnot split"}\n{"text": "two"}\n')
    files = load_corpus(str(tmp_path), val_fraction=0.0)
    c = load_corpus(str(tmp_path), val_fraction=0.0, units="blocks")
    assert c.train.tokens_N.tobytes() == files.train.tokens_N.tobytes()  # the same text, cut differently
    lengths = np.diff(c.train.offsets_M).tolist()
    assert lengths == [len(b) for b in blocks] + [len("one sample\n\nnot split"), 3]  # a .jsonl line stays whole
    with pytest.raises(DataError, match="data.units"):
        load_corpus(str(tmp_path), units="lines")


def test_stdlib_blocks_are_long_tailed():
    c = load_corpus("stdlib", units="blocks")
    lengths = np.diff(c.train.offsets_M)
    median, p90 = np.percentile(lengths, [50, 90])
    assert c.train.n_docs > 5000 and median < 400 and p90 > 4 * median  # many short, a long tail


def test_mixture_draws_by_weight_and_resumes(tmp_path):
    from moebal.config import from_dict
    from moebal.data import MixtureSampler, build_data

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(f'{{"text": "{"a" * (5 + i % 7)}"}}\n' for i in range(40)))
    b.write_text("".join(f'{{"text": "{"b" * (20 + i % 5)}"}}\n' for i in range(40)))
    cfg = from_dict({"data": {"mixture": {str(a): 3.0, str(b): 1.0}, "samples": "documents", "seq_len": 32,
                              "batch_size": 16, "val_fraction": 0.0}})
    data = build_data(cfg)
    assert isinstance(data.train, MixtureSampler) and data.corpus.source.startswith("mixture(")
    draws = [bytes(r[:1].tolist()) for _ in range(50) for r in data.train.next_samples()]
    share_a = draws.count(b"a") / len(draws)
    assert 0.7 < share_a < 0.8  # weight 3 : 1
    state = data.train.state_dict()
    nxt = [r.tolist() for r in data.train.next_samples()]
    again = build_data(cfg)
    again.train.load_state_dict(state)
    assert [r.tolist() for r in again.train.next_samples()] == nxt  # a resumed run reads the same samples
    other = build_data(from_dict({"data": {"mixture": {str(a): 1.0, str(b): 1.0}, "samples": "documents",
                                           "seq_len": 32, "batch_size": 16, "val_fraction": 0.0}}))
    with pytest.raises(DataError, match="data.mixture"):
        other.train.load_state_dict(state)
    batch = build_data(cfg).train.next_batch()  # padded like any document batch
    assert batch.ids_BT.shape[0] == 16 and int((batch.labels_BT != -100).sum()) == batch.n_tokens
    # sources that share a file: each splits its own documents, so the file's text could be validation in one
    # and training in the other
    for shared in ({str(tmp_path): 1.0, str(a): 1.0}, {str(a): 1.0, f"{tmp_path}/../{tmp_path.name}/a.jsonl": 1.0}):
        with pytest.raises(DataError, match="data.mixture: sources .* share files"):
            build_data(from_dict({"data": {"mixture": shared, "samples": "documents", "seq_len": 32,
                                           "batch_size": 16}}))


def test_the_byte_tokenizer_reads_an_id_no_byte_has_as_the_replacement_character():
    """A model whose vocabulary is larger than 256 can sample ids the byte tokenizer has no byte for: they read as
    U+FFFD, as invalid bytes do, not as their id modulo 256 (289 showed as "!")."""
    from moebal.data.tokenizer import ByteTokenizer

    t = ByteTokenizer()
    assert t.decode(np.array([104, 105, 289, 33])) == "hi\ufffd!"
    assert t.decode(np.frombuffer("héllo".encode(), dtype=np.uint8)) == "héllo"
    assert t.decode(np.array([0xC3, 300, 0xA9])) == "\ufffd\ufffd\ufffd"  # a split sequence is invalid on each side
    assert t.decode(np.array([], dtype=np.int64)) == ""
