"""`moebal generate`: text from a training run's checkpoint, a HF checkpoint directory and a converted one; a
scheme's run served through the scheme; bad input named in a line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from moebal.models.generate import generate
from tests.cli_util import Ran, load_script, run_cli
from tests.hf_util import tiny_mixtral, tiny_tokenizer
from tests.integration.test_paths_cli import SERVED
from tests.unit.test_train import TINY

BASE = [x for x in TINY if not x.startswith(("train.steps=", "train.eval_every=", "train.ckpt_every="))]


def moebal(*args: str) -> Ran:
    """`moebal *args` in this process (tests/cli_util.py)."""
    return run_cli(*args)


def _json(r: Ran) -> list[dict[str, Any]]:
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.strip().splitlines()]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gen") / "run"
    r = moebal("train", "--out", str(out), *BASE, "train.steps=3", "train.ckpt_every=3", "train.eval_every=3",
               "train.record_routing_every=3", "parallel.nproc=1")
    assert r.returncode == 0, r.stderr
    return out


def test_expert_parallel_generation_gives_every_policy_the_one_process_tokens(run_dir: Path) -> None:
    """`--nproc 2 --policy all`: 3 prompts decoded on 2 gloo ranks (batches of 2: the third prompt beside a dummy)
    under static expert parallelism, Lina (from the run's path profile at its default place), phase 1 and the
    oracle give the tokens of one process; the summary says so per policy. Bad combinations are named."""
    r = moebal("paths", str(run_dir), "-o", str(run_dir / "paths.npz"), "--path-len", "2")
    assert r.returncode == 0, r.stderr
    prompts = ["--prompt-ids", "100,101,32", "--prompt-ids", "105,109,112,111,114,116", "--prompt-ids", "35"]
    one = _json(moebal("generate", str(run_dir), *prompts, "--max-new-tokens", "10", "--json"))
    ep = _json(moebal("generate", str(run_dir), *prompts, "--max-new-tokens", "10", "--json", "--nproc", "2",
                      "--policy", "all", "--batch-size", "2"))
    assert [g["tokens"] for g in ep[:-1]] == [g["tokens"] for g in one] and len(one) == 3
    summary = ep[-1]["expert_parallel"]
    assert summary["nproc"] == 2 and list(summary["policies"]) == ["static", "lina", "phase1", "oracle"]
    assert all(s["tokens_equal_static"] for p, s in summary["policies"].items() if p != "static")
    assert all(s["forwards"] == 20 and s["moe_s_median"] > 0 for s in summary["policies"].values())  # 2 batches
    text = moebal("generate", str(run_dir), *prompts[:2], "--max-new-tokens", "4", "--nproc", "2", "--policy",
                  "oracle")
    assert text.returncode == 0, text.stderr
    assert [line.split()[0] for line in text.stdout.splitlines()[-2:]] == ["static", "oracle"], text.stdout
    assert "tokens equal static: True" in text.stdout
    for extra, said in ((["--nproc", "3"], "4 experts cannot be spread evenly over 3 ranks"),
                        (["--nproc", "2", "--device", "cuda"], "decodes on local gloo ranks on the CPU"),
                        (["--nproc", "2", "--policy", "lina", "--profile", str(run_dir / "none.npz")],
                         "no path profile: build one with `moebal paths"),
                        (["--nproc", "0"], "--nproc must be >= 1")):
        r = moebal("generate", str(run_dir), *prompts[:2], "--max-new-tokens", "4", *extra)
        assert r.returncode == 2 and said in r.stderr, (extra, r.stderr)


def test_a_run_s_checkpoint_generates_the_same_tokens_with_and_without_the_cache(run_dir: Path) -> None:
    """Greedy, two prompts: the KV-cached tokens equal the whole-prefix forward's, the text is the byte tokenizer's
    decoding of them; a seed repeats a sampled generation; the line output shows the prompt and the new text."""
    cached = _json(moebal("generate", str(run_dir), "--prompt", "def ", "--prompt", "import", "--max-new-tokens",
                          "12", "--json"))
    plain = _json(moebal("generate", str(run_dir), "--prompt", "def ", "--prompt", "import", "--max-new-tokens",
                         "12", "--json", "--no-cache"))
    assert [c["tokens"] for c in cached] == [p["tokens"] for p in plain]
    one = _json(moebal("generate", str(run_dir), "--prompt", "def ", "--prompt", "import", "--max-new-tokens",
                       "12", "--json", "--batch-size", "1"))
    assert [c["tokens"] for c in cached] == [o["tokens"] for o in one]  # batched (left-padded) as alone
    assert [c["cache"] for c in cached] == [True, True] and [p["cache"] for p in plain] == [False, False]
    assert cached[0]["prompt_ids"] == list(b"def ") and cached[1]["prompt_ids"] == list(b"import")
    assert all(len(c["tokens"]) == 12 and c["stop"] == "length" and c["served"] is None for c in cached)
    assert cached[0]["text"] == bytes(cached[0]["tokens"]).decode("utf-8", errors="replace")
    sample = ["generate", str(run_dir), "--prompt-ids", "100,101", "--temperature", "0.9", "--top-k", "50",
              "--top-p", "0.95", "--seed", "7", "--max-new-tokens", "10", "--json"]
    first, again = _json(moebal(*sample)), _json(moebal(*sample))
    assert first[0]["tokens"] == again[0]["tokens"] and first[0]["sampling"]["temperature"] == 0.9
    r = moebal("generate", str(run_dir), "--prompt", "def ", "--max-new-tokens", "4")
    assert r.returncode == 0 and r.stdout.startswith("'def ") and "[4 tokens, stop: length" in r.stdout, r.stdout


def test_several_samples_of_a_prompt_each_from_its_own_generator(run_dir: Path) -> None:
    """`--num-return-sequences 3`: each prompt's 3 samples in a row, the first the one sample the seed gives alone,
    the others different; the same tokens one prompt at a time and on 2 expert-parallel ranks."""
    prompts = ["--prompt-ids", "100,101", "--prompt-ids", "35,36,37"]
    sample = ["--temperature", "1.0", "--seed", "7", "--max-new-tokens", "10", "--json"]
    three = _json(moebal("generate", str(run_dir), *prompts, *sample, "--num-return-sequences", "3"))
    assert [g["sequence"] for g in three] == [0, 1, 2, 0, 1, 2]
    assert [g["prompt_ids"] for g in three] == [[100, 101]] * 3 + [[35, 36, 37]] * 3
    alone = _json(moebal("generate", str(run_dir), *prompts, *sample))
    assert [three[0]["tokens"], three[3]["tokens"]] == [g["tokens"] for g in alone]
    assert len({tuple(g["tokens"]) for g in three[:3]}) == 3 and len({tuple(g["tokens"]) for g in three[3:]}) == 3
    one_by_one = _json(moebal("generate", str(run_dir), *prompts, *sample, "--num-return-sequences", "3",
                              "--batch-size", "1"))
    assert [g["tokens"] for g in one_by_one] == [g["tokens"] for g in three]
    ep = _json(moebal("generate", str(run_dir), *prompts, *sample, "--num-return-sequences", "3", "--nproc", "2"))
    assert [g["tokens"] for g in ep[:-1]] == [g["tokens"] for g in three]
    text = moebal("generate", str(run_dir), *prompts[:2], *sample[:-1], "--num-return-sequences", "2")
    assert text.returncode == 0 and "[sample 2 of 2, 10 tokens" in text.stdout, text.stdout


def test_a_hf_checkpoint_and_its_conversion_generate_transformers_tokens(tmp_path: Path) -> None:
    """A tiny Mixtral written by transformers with its tokenizer.json: `moebal generate` on the directory and on
    its `moebal convert hf-to-moebal` copy gives transformers' greedy tokens for the encoded prompt, and stops at the
    eos_token_id of generation_config.json as transformers does (set to the third greedy token here)."""
    src = tmp_path / "src"
    ref = tiny_mixtral(src, max_position_embeddings=64)
    tiny_tokenizer(src, ["the cat sat on the mat " * 20, "a dog ran in the park " * 20])
    r = moebal("generate", str(src), "--prompt", "the cat", "--max-new-tokens", "16", "--json", "--stop-id", "-1")
    got = _json(r)[0]
    with torch.no_grad():
        ids = torch.tensor([got["prompt_ids"]])
        want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(got["prompt_ids"]):].tolist()
    assert got["prompt_ids"][0] == 0 and got["tokens"] == want  # <s> first: the tokenizer's post-processor
    assert (src / "generation_config.json").is_file()  # transformers' generate reads its eos_token_id there
    for name in ("generation_config.json", "config.json"):
        config = json.loads((src / name).read_text())
        config["eos_token_id"] = want[2]
        (src / name).write_text(json.dumps(config))
    assert moebal("convert", "hf-to-moebal", str(src), str(tmp_path / "mb")).returncode == 0
    for d in (src, tmp_path / "mb"):
        got = _json(moebal("generate", str(d), "--prompt", "the cat", "--max-new-tokens", "16", "--json"))[0]
        assert got["tokens"] == want[:want.index(want[2]) + 1] and got["stop"] == "stop_token", (d, got)
    (src / "tokenizer.json").unlink()
    r = moebal("generate", str(src), "--prompt", "the cat")
    assert r.returncode == 2 and "no tokenizer for text prompts" in r.stderr and "--prompt-ids" in r.stderr
    assert _json(moebal("generate", str(src), "--prompt-ids", "0,5,9", "--max-new-tokens", "3", "--json"))[0][
        "text"] is None


@pytest.mark.parametrize("scheme", list(SERVED))
def test_a_scheme_s_run_is_served_through_the_scheme_without_a_cache(tmp_path: Path, scheme: str) -> None:
    """Mixture-of-Depths, early exit and sparse attention change the model's outputs: `moebal generate` serves the
    run as its validation ran after the checkpoint's step and says so. Early exit decodes with the KV cache, its
    exits included, to the tokens of the whole prefix's forward per new token; the other two run that forward (on
    prefixes that end inside an attention block: 4 to 9 tokens, blocks of 8, which the sparse core once refused),
    and the KV-cached decoder refuses them instead of computing the plain model."""
    from moebal.commands.eval import load_run_model

    out = tmp_path / "run"
    r = moebal("train", "--out", str(out), *BASE, "train.steps=3", "train.ckpt_every=3", "train.eval_every=3",
               "parallel.nproc=1", f"dynamism.scheme={scheme}", *SERVED[scheme])
    assert r.returncode == 0, r.stderr
    got = _json(moebal("generate", str(out), "--prompt", "def ", "--max-new-tokens", "6", "--json"))[0]
    assert got["cache"] is (scheme == "early_exit") and len(got["tokens"]) == 6, got
    _, model, served = load_run_model(out)
    assert served is not None and got["served"] == served.line
    r = moebal("generate", str(out), "--prompt", "def ", "--max-new-tokens", "2")
    assert r.returncode == 0 and "served as the run validated after step 3" in r.stdout, r.stdout
    assert generate(model, list(b"def "), 6, cache=False).tokens == got["tokens"]
    if scheme == "early_exit":
        assert "KV-cached, exits included" in r.stdout
    else:
        with pytest.raises(ValueError, match="no KV-cached form"):
            generate(model, list(b"def "), 6)


def test_a_mixture_of_depths_run_with_predictors_generates_through_them_with_the_cache(tmp_path: Path) -> None:
    """`dynamism.mod.predictor=16`: the run trains its predictors (their accuracy in the metrics), and `moebal
    generate` routes each token by them, KV-cached, to the tokens of the whole prefix's forward under the same
    routing, and says so."""
    out = tmp_path / "run"
    r = moebal("train", "--out", str(out), *BASE, "train.steps=3", "train.ckpt_every=3", "train.eval_every=3",
               "parallel.nproc=1", "dynamism.scheme=mod", *SERVED["mod"], "dynamism.mod.predictor=16")
    assert r.returncode == 0, r.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    accuracy = [x["predictor_accuracy"] for x in records if "predictor_accuracy" in x]
    assert len(accuracy) == 3 and all(0 <= a <= 1 for x in accuracy for a in x.values()), records[-1]
    prompts = ["--prompt", "def ", "--prompt", "import os", "--max-new-tokens", "8", "--json"]
    cached, plain = _json(moebal("generate", str(out), *prompts)), _json(moebal("generate", str(out), *prompts,
                                                                                 "--no-cache"))
    assert [g["cache"] for g in cached] == [True, True] and [g["tokens"] for g in cached] == [g["tokens"] for g in
                                                                                            plain]
    assert "causal predictors" in cached[0]["served"], cached[0]
    r = moebal("generate", str(out), "--prompt", "def ", "--max-new-tokens", "2")
    assert r.returncode == 0 and "causal predictors" in r.stdout and "; KV-cached" in r.stdout, r.stdout
    # scripts/mod_predictor_check.py: validation losses under both routings, each routed layer's share of tokens
    check = load_script("mod_predictor_check")
    assert check.main([str(out), "--batches", "2", "--json", str(tmp_path / "c.json")]) == 0
    figures = json.loads((tmp_path / "c.json").read_text())
    assert figures["step"] == 3 and figures["capacity"] == 0.5 and set(figures["run_share"]) == {"1"}
    assert 0 <= figures["run_share"]["1"] <= 1 and figures["val_loss_causal"] > 0 and figures["val_loss_top_k"] > 0


@pytest.mark.parametrize("args, words", [
    (["--prompt", "x", "--temperature", "-1"], "temperature must be a finite number"),
    (["--prompt", "x", "--top-p", "1.5"], "top-p must be in (0, 1]"),
    (["--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1; got 0"),
    (["--prompt", "x", "--batch-size", "0", "--nproc", "-1"], "--batch-size and --nproc must be >= 1; got 0, -1"),
    (["--prompt", "x", "--num-return-sequences", "0"], "--num-return-sequences must be >= 1; got 0"),
    (["--prompt", "x", "--num-return-sequences", "2"], "greedy decoding (--temperature 0.0) gives one text"),
    (["--prompt", "x", "--max-new-tokens", "70"], "exceed the model's max_seq_len (64)"),
    (["--prompt-ids", "1,x"], "comma-separated integers"),
    (["--prompt-ids", "1,300"], "ids [300] are outside the vocabulary 0..255"),
    (["--prompt", "x", "--device", "cuda"], "no CUDA device"),
    (["--prompt", "x", "--tokenizer", "nope.json"], "no tokenizer for text prompts: nope.json does not exist"),
    (["--prompt", "x", "--stop-id", "9999"], "--stop-id 9999 is not a token of this model (ids 0..255; -1: no "),
])
def test_bad_input_is_named_in_a_line(run_dir: Path, args: list[str], words: str) -> None:
    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    r = moebal("generate", str(run_dir), *args)
    assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_every_prompt_is_checked_before_the_first_batch_decodes(run_dir: Path) -> None:
    """A prompt too long for the model in the second of two one-prompt batches: refused before the first
    decodes, so nothing is printed (the check once ran per batch, after the earlier batches' output)."""
    r = moebal("generate", str(run_dir), "--prompt", "def ", "--prompt", "x" * 60, "--batch-size", "1",
               "--max-new-tokens", "8", "--json")
    assert r.returncode == 2 and "exceed the model's max_seq_len (64)" in r.stderr and r.stdout == "", r


def test_a_directory_that_is_neither_a_run_nor_a_checkpoint_is_named(tmp_path: Path) -> None:
    r = moebal("generate", str(tmp_path / "nope"), "--prompt", "x")
    assert r.returncode == 2 and "not a directory" in r.stderr
    r = moebal("generate", str(tmp_path), "--prompt", "x")
    assert r.returncode == 2 and "neither a run directory" in r.stderr and "Traceback" not in r.stderr


def test_one_checkpoint_of_a_run_is_served_as_the_run_holding_only_it(tmp_path: Path) -> None:
    """`moebal generate RUN_DIR/ckpt-N` and `moebal eval RUN_DIR/ckpt-N` serve that checkpoint, not the run's newest:
    its weights are those of a copy of the run that holds only it; Lina's path profile defaults to the run's."""
    from moebal.commands.eval import load_run_model
    from moebal.train.checkpoint import find_checkpoints

    out = tmp_path / "run"
    r = moebal("train", "--out", str(out), *BASE, "train.steps=2", "train.ckpt_every=1", "train.eval_every=2",
               "train.record_routing_every=1", "parallel.nproc=1")
    assert r.returncode == 0, r.stderr
    first, second = find_checkpoints(out)
    only = tmp_path / "only-first"
    shutil.copytree(out, only, ignore=shutil.ignore_patterns(second.name))
    weights = {name: load_run_model(path)[1].state_dict() for name, path in
               (("first", first), ("only", only), ("newest", out))}
    assert all(torch.equal(v, weights["only"][k]) for k, v in weights["first"].items())
    assert not all(torch.equal(v, weights["newest"][k]) for k, v in weights["first"].items())
    assert moebal("paths", str(out)).returncode == 0  # RUN_DIR/paths.npz: the profile a checkpoint's Lina reads
    prompts = ["--prompt-ids", "100,101,32", "--prompt-ids", "35", "--max-new-tokens", "6", "--json"]
    alone = _json(moebal("generate", str(only), *prompts))
    ep = _json(moebal("generate", str(first), *prompts, "--nproc", "2", "--policy", "lina"))
    assert [g["tokens"] for g in ep[:-1]] == [g["tokens"] for g in alone]
    assert ep[-1]["expert_parallel"]["policies"]["lina"]["tokens_equal_static"]
    r = moebal("eval", str(first), "--policy", "lina", "--batches", "1", "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["run_dir"] == str(first) and summary["lina"]["equal_static"]
