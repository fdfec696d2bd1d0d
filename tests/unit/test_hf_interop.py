"""HF interop against `transformers` itself: Mixtral and Qwen2-MoE logits, round trips, sharded files, the
routing options that reproduce Mixtral, and every kind of bad checkpoint giving its own clear error."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

from moebal.errors import CheckpointError, ConfigError
from moebal.interop.hf import config_from_hf, from_hf, to_hf
from moebal.interop.hf_config import load
from moebal.interop.tensor_io import read_header
from tests.hf_util import logits, read_tensors, tiny_mixtral, tiny_qwen2_moe, tiny_tokenizer, transformers_or_skip


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    d = tmp_path_factory.mktemp("mixtral")
    return d, tiny_mixtral(d)


def test_mixtral_logits_equal_transformers(mixtral_dir):
    path, ref = mixtral_dir
    ours = from_hf(path).eval()
    cfg = ours.config
    assert (cfg.model.n_heads, cfg.model.n_kv_heads, cfg.model.rope_theta) == (4, 2, 5e5)  # GQA, rope theta
    assert not cfg.model.tie_embeddings and cfg.moe.aux_loss_coef == 0.02
    ids = torch.randint(0, 96, (3, 40), generator=torch.Generator().manual_seed(1))
    err = (logits(ours, ids) - logits(ref, ids)).abs().max().item()
    assert err < 1e-4, err


def test_mixtral_round_trip_gives_identical_tensors_and_transformers_loads_it(mixtral_dir, tmp_path):
    path, ref = mixtral_dir
    out = to_hf(from_hf(path), tmp_path / "out")
    a, b = read_tensors(path), read_tensors(out)
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    back = transformers_or_skip().MixtralForCausalLM.from_pretrained(str(out)).eval()
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(2))
    assert torch.equal(logits(back, ids), logits(ref, ids))


def test_sharded_checkpoints_both_ways(tmp_path):
    ref = tiny_mixtral(tmp_path / "src", shard="20KB", tie_word_embeddings=True)
    assert (tmp_path / "src" / "model.safetensors.index.json").is_file()
    ours = from_hf(tmp_path / "src").eval()
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(3))
    assert (logits(ours, ids) - logits(ref, ids)).abs().max().item() < 1e-4
    out = to_hf(ours, tmp_path / "out", shard_bytes=16_000, dtype=torch.bfloat16)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and all((out / s).is_file() for s in shards)
    assert all(read_header(out / s)[0] for s in shards)
    # the source's config.json is kept, with its own dtype key (transformers 5 writes `dtype`) updated
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    back = transformers_or_skip().MixtralForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    want = {k: v.to(torch.bfloat16).float() for k, v in ref.state_dict().items()}
    got = back.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("options, exact", [
    ({}, True),                                  # softmax over all experts, top-k, renormalise: Mixtral itself
    ({"gate": "topk_softmax"}, True),            # the same maths, rounded differently
    ({"capacity_factor": 0.5}, False),           # drops assignments: not Mixtral (dropless)
    ({"adaptive_threshold": 0.0}, False),        # top-1 for most tokens: not Mixtral
    ({"norm_topk": False}, False),               # unnormalised top-k weights: Qwen2-MoE's option, not Mixtral's
])
def test_which_routing_options_reproduce_mixtral(mixtral_dir, options, exact):
    path, ref = mixtral_dir
    cfg = config_from_hf(path, {"moe": options})
    ours = from_hf(path, cfg=cfg).eval()
    ids = torch.randint(0, 96, (4, 48), generator=torch.Generator().manual_seed(4))
    err = (logits(ours, ids) - logits(ref, ids)).abs().max().item()
    assert (err < 1e-4) == exact, (options, err)


def test_router_jitter_is_mapped_and_only_acts_in_training(tmp_path):
    tiny_mixtral(tmp_path, router_jitter_noise=0.1)
    model = from_hf(tmp_path)
    assert model.config.moe.jitter == 0.1
    ids = torch.randint(0, 96, (1, 8))
    model.eval()
    assert torch.equal(logits(model, ids), logits(model, ids))


def test_qwen2_moe_shared_expert_logits_equal_transformers(tmp_path):
    for norm in (False, True):
        d = tmp_path / f"norm{norm}"
        ref = tiny_qwen2_moe(d, norm_topk_prob=norm)
        ours = from_hf(d).eval()
        moe = ours.config.moe
        assert (moe.shared_gate, moe.norm_topk, moe.every, ours.config.model.attention_bias) == (True, norm, 2, True)
        assert not ours.model.layers[0].is_moe and ours.model.layers[1].is_moe
        ids = torch.randint(0, 96, (2, 33), generator=torch.Generator().manual_seed(5))
        err = (logits(ours, ids) - logits(ref, ids)).abs().max().item()
        assert err < 1e-4, (norm, err)
        out = to_hf(ours, tmp_path / f"out{norm}")
        a, b = read_tensors(d), read_tensors(out)
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_config_overlay_fills_the_shape_and_rejects_disagreement(mixtral_dir, tmp_path):
    path, _ = mixtral_dir
    cfg = load(None, [f"hf.init_from={path}", "data.seq_len=32", "moe.aux_loss_coef=0.05",
                      f"data.tokenizer={path}/tokenizer.json"])
    assert (cfg.model.dim, cfg.model.n_layers, cfg.moe.num_experts, cfg.moe.expert_ffn_dim) == (32, 2, 4, 48)
    assert cfg.moe.aux_loss_coef == 0.05  # a training default the config may override
    same = load(None, [f"hf.init_from={path}", "data.seq_len=32", "model.dim=32",
                       f"data.tokenizer={path}/tokenizer.json"])
    assert same.model.dim == 32
    with pytest.raises(ConfigError, match=r"model.dim is 64 here but 32 in the checkpoint.*remove these keys"):
        load(None, [f"hf.init_from={path}", "data.seq_len=32", "model.dim=64", f"data.tokenizer={path}/t.json"])
    # DeepSeek's group-limited routing is Mixtral's too when fixed: a YAML that sets it changed the logits unasked
    with pytest.raises(ConfigError, match=r"moe.n_group is 2 here but 1 in the checkpoint"):
        load(None, [f"hf.init_from={path}", "data.seq_len=32", "moe.n_group=2", "moe.topk_group=1",
                    f"data.tokenizer={path}/tokenizer.json"])
    biased = load(None, [f"hf.init_from={path}", "data.seq_len=32", "moe.selection_bias=true",
                         f"data.tokenizer={path}/tokenizer.json"])
    assert biased.moe.selection_bias  # an aux-loss-free continuation stays open to every family
    with pytest.raises(ConfigError, match="no config.json"):
        load(None, [f"hf.init_from={tmp_path}"])


# ---- bad input: each its own clear error, never a partial load ----------------------------------------


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite(path: Path, drop: str | None = None, add: dict[str, torch.Tensor] | None = None) -> None:
    from safetensors.torch import save_file

    tensors = read_tensors(path)
    if drop:
        del tensors[drop]
    tensors.update(add or {})
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_bad_directories(mixtral_dir, tmp_path):
    path, _ = mixtral_dir
    with pytest.raises(CheckpointError, match="has no config.json"):
        from_hf(tmp_path)
    with pytest.raises(CheckpointError, match="is not a directory"):
        from_hf(tmp_path / "nope")
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    with pytest.raises(CheckpointError, match="LlamaForCausalLM is not supported; moebal loads MixtralForCausalLM"):
        from_hf(llama)
    bins = _copy(path, tmp_path / "bins")
    (bins / "model.safetensors").rename(bins / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="PyTorch pickles, which moebal does not unpickle"):
        from_hf(bins)
    scaled = _copy(path, tmp_path / "rope")
    c = json.loads((scaled / "config.json").read_text())
    c["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
    (scaled / "config.json").write_text(json.dumps(c))
    with pytest.raises(CheckpointError, match="rotary scaling 'yarn' is not supported"):
        from_hf(scaled)


def test_missing_unexpected_and_misshapen_tensors(mixtral_dir, tmp_path):
    path, _ = mixtral_dir
    missing = _copy(path, tmp_path / "missing")
    _rewrite(missing, drop="model.layers.1.block_sparse_moe.experts.3.w2.weight")
    with pytest.raises(CheckpointError, match=r"missing 1 tensor\(s\): model.layers.1.block_sparse_moe.experts.3.w2"):
        from_hf(missing)
    extra = _copy(path, tmp_path / "extra")
    _rewrite(extra, add={"model.layers.0.block_sparse_moe.experts.4.w1.weight": torch.zeros(48, 32)})
    with pytest.raises(CheckpointError, match=r"unexpected 1 tensor\(s\): model.layers.0.*experts.4.w1.*num_local"):
        from_hf(extra)
    shape = _copy(path, tmp_path / "shape")
    c = json.loads((shape / "config.json").read_text())
    c["intermediate_size"] = 64
    (shape / "config.json").write_text(json.dumps(c))
    with pytest.raises(CheckpointError, match=r"experts.0.w1.weight' in .*model.safetensors is \[48, 32\], "
                                              r"expected \[64, 32\].*intermediate_size"):
        from_hf(shape)


def test_truncated_and_corrupt_files(mixtral_dir, tmp_path):
    path, _ = mixtral_dir
    trunc = _copy(path, tmp_path / "trunc")
    f = trunc / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor '.*' .*does not fit .*truncated"):
        from_hf(trunc)
    junk = _copy(path, tmp_path / "junk")
    (junk / "model.safetensors").write_bytes(struct.pack("<Q", 12) + b"not json!!!!")
    with pytest.raises(CheckpointError, match="header is not valid JSON"):
        from_hf(junk)
    sharded = tmp_path / "sharded"
    tiny_mixtral(sharded, shard="20KB")
    victim = sorted(sharded.glob("model-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"names shard\\(s\\) that are missing: {victim.name}"):
        from_hf(sharded)


def test_export_refuses_what_the_layout_cannot_express(mixtral_dir, tmp_path):
    path, _ = mixtral_dir
    model = from_hf(path, cfg=config_from_hf(path, {"moe": {"adaptive_threshold": 0.1}}))
    with pytest.raises(ConfigError, match="adaptive top-k gating"):
        to_hf(model, tmp_path / "a")
    with pytest.raises(ConfigError, match="the qwen3_moe layout always normalises q and k"):
        to_hf(from_hf(path), tmp_path / "b", arch="qwen3_moe", keep_origin=False)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    to_hf(from_hf(path), tmp_path / "c")
    with pytest.raises(CheckpointError, match="already exists"):
        to_hf(from_hf(path), tmp_path / "c")


def test_the_export_check_compares_the_target_the_export_writes_with_init_from(mixtral_dir, tmp_path, monkeypatch):
    """A relative hf.export_to is inside the run directory (`export_target`): it is refused only where it is
    hf.init_from's own directory, whatever the working directory."""
    from moebal.train.export import check_export

    path, _ = mixtral_dir
    monkeypatch.chdir(path.parent)
    (tmp_path / "tok").mkdir()
    tok = tiny_tokenizer(tmp_path / "tok", ["def f(x):\n    return x + 1\n"])

    def cfg(export_to):
        return load(None, [f"hf.init_from={path}", "data.seq_len=32", f"data.tokenizer={tok}",
                           f"hf.export_to={export_to}"])

    here = cfg(path.name)  # relative: RUN/<hf.init_from's folder name>
    check_export(here, tmp_path / "run")  # the export goes to tmp_path/run/<name>, not over hf.init_from
    with pytest.raises(ConfigError, match="hf.export_to is the directory of hf.init_from"):
        check_export(here, path.parent)  # a run directory beside it: the export would overwrite the original
    with pytest.raises(ConfigError, match="hf.export_to is the directory of hf.init_from"):
        check_export(cfg(path), tmp_path / "run")
    # the export replaces its directory whole: not the run's (".", it once deleted every checkpoint), not one
    # holding the run or hf.init_from, not a folder of other files; an earlier export is replaced
    run = tmp_path / "runs" / "run"
    for target, said in ((".", "is the run directory"), ("..", "contains the run directory")):
        with pytest.raises(ConfigError, match=said):
            check_export(cfg(target), run)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep me", encoding="utf-8")
    with pytest.raises(ConfigError, match="holds files that are not a HF checkpoint"):
        check_export(cfg(tmp_path / "other"), run)
    (tmp_path / "earlier").mkdir()
    (tmp_path / "earlier" / "config.json").write_text("{}", encoding="utf-8")
    check_export(cfg(tmp_path / "earlier"), run)


def test_an_export_takes_base_and_copy_from_each_from_the_origin_when_not_given(mixtral_dir, tmp_path):
    """`base` (the config.json whose keys are kept) and `copy_from` (tokenizer, generation files) default one by
    one: giving one of them keeps the origin's other (it once took the origin only when both were missing)."""
    path, _ = mixtral_dir
    model = from_hf(path)
    original = json.loads((path / "config.json").read_text())
    to_hf(model, tmp_path / "a", base={**original, "note": "mine"})
    assert (tmp_path / "a" / "generation_config.json").is_file()  # copied from the origin
    assert json.loads((tmp_path / "a" / "config.json").read_text())["note"] == "mine"
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "generation_config.json").write_text('{"max_length": 7}')
    to_hf(model, tmp_path / "b", copy_from=tmp_path / "files")
    assert json.loads((tmp_path / "b" / "generation_config.json").read_text()) == {"max_length": 7}
    assert json.loads((tmp_path / "b" / "config.json").read_text()) == original  # the origin's config.json


def test_export_refuses_mixture_of_depths_and_keeps_the_schemes_that_only_skip_work():
    from moebal.config import Config, with_overrides
    from moebal.interop.hf import check_exportable

    def cfg(scheme: str) -> Config:
        return with_overrides(Config(), ["parallel.pp=2", f"dynamism.scheme={scheme}"])

    with pytest.raises(ConfigError, match="Mixture-of-Depths .* no HF layout has"):
        check_exportable(cfg("mod"), "mixtral")
    for scheme in ("early_exit", "sparse_attention", "pruning", "freezing", "moe"):
        check_exportable(cfg(scheme), "mixtral")  # the HF model runs every token through every layer


def test_convert_cli_both_ways_and_moebal_dir_as_init(mixtral_dir, tmp_path, capsys):
    from moebal.cli import main

    path, ref = mixtral_dir
    assert main(["convert", "hf-to-moebal", str(path), str(tmp_path / "mb"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["files"] >= 5
    mb = tmp_path / "mb"
    assert {"config.yaml", "model.safetensors", "hf_config.json", "manifest.json"} <= {p.name for p in mb.iterdir()}
    stacked = read_header(mb / "model.safetensors")[0]["model.layers.0.block_sparse_moe.experts.w1"]
    assert stacked.shape == (4, 48, 32)
    ours = from_hf(mb).eval()
    ids = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(6))
    assert (logits(ours, ids) - logits(ref, ids)).abs().max().item() < 1e-4
    cfg = load(None, [f"hf.init_from={mb}", "data.seq_len=32", f"data.tokenizer={mb}/tokenizer.json"])
    assert (cfg.model.dim, cfg.moe.num_experts, cfg.moe.aux_loss_coef) == (32, 4, 0.02)
    assert main(["convert", "moebal-to-hf", str(mb), str(tmp_path / "hf")]) == 0
    a, b = read_tensors(path), read_tensors(tmp_path / "hf")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == \
        {**json.loads((path / "config.json").read_text())}
    capsys.readouterr()
    assert main(["convert", "moebal-to-hf", str(mb), str(tmp_path / "hf")]) == 2
    assert "already exists: choose a new directory or pass --overwrite" in capsys.readouterr().err
    for dst in (mb, tmp_path):  # over its own SRC, or a folder holding it: refused even with --overwrite
        assert main(["convert", "moebal-to-hf", str(mb), str(dst), "--overwrite"]) == 2
        assert "which would delete SRC" in capsys.readouterr().err
    assert (mb / "model.safetensors").is_file()
    assert main(["convert", "hf-to-moebal", str(tmp_path / "nope"), str(tmp_path / "new" / "er" / "x")]) == 2
    err = capsys.readouterr().err
    assert "is not a directory" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "new").exists()  # the folders made for DST are taken away again
    # a DST whose folder cannot be made, and a shard size that is no size, are named before anything is read
    (tmp_path / "a-file").write_text("")
    for args, said in (([str(tmp_path / "a-file" / "hf")], "cannot make its folder"),
                       ([str(tmp_path / "hf2"), "--shard-gb", "0"], "--shard-gb must be a positive number of GB")):
        assert main(["convert", "moebal-to-hf", str(mb), *args]) == 2
        err = capsys.readouterr().err
        assert said in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "hf2").exists()
    (mb / "model.safetensors").write_bytes((mb / "model.safetensors").read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(CheckpointError, match="sha256 does not match"):
        from_hf(mb)


def test_an_expert_parallel_rank_reads_only_its_experts(mixtral_dir):
    path, _ = mixtral_dir
    full, part = from_hf(path), from_hf(path, experts=[2, 3])
    for a, b in zip(full.moe_layers(), part.moe_layers()):
        for n in ("w1", "w3", "w2"):
            assert getattr(b.experts, n).shape[0] == 2
            assert torch.equal(getattr(b.experts, n), getattr(a.experts, n)[2:4])
        assert torch.equal(a.gate.weight, b.gate.weight)
    assert torch.equal(part.lm_head.weight, full.lm_head.weight)


@pytest.mark.parametrize("arch, model_type, hf_class", [
    ("MixtralForCausalLM", "mixtral", "MixtralConfig"), ("Qwen2MoeForCausalLM", "qwen2_moe", "Qwen2MoeConfig"),
    ("Qwen3MoeForCausalLM", "qwen3_moe", "Qwen3MoeConfig"), ("OlmoeForCausalLM", "olmoe", "OlmoeConfig"),
    ("DeepseekV2ForCausalLM", "deepseek_v2", "DeepseekV2Config"),
    ("DeepseekV3ForCausalLM", "deepseek_v3", "DeepseekV3Config")])
def test_keys_a_config_leaves_out_mean_what_they_mean_to_transformers(tmp_path, arch, model_type, hf_class):
    transformers = transformers_or_skip()
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [arch], "model_type": model_type}))
    ours, theirs = config_from_hf(tmp_path), getattr(transformers, hf_class)()
    experts = getattr(theirs, "num_local_experts", None) or getattr(theirs, "num_experts", None) or \
        theirs.n_routed_experts
    assert (ours.model.dim, ours.model.n_layers, ours.model.n_heads, ours.model.n_kv_heads, ours.moe.num_experts) \
        == (theirs.hidden_size, theirs.num_hidden_layers, theirs.num_attention_heads, theirs.num_key_value_heads,
            experts)
    if theirs.num_experts_per_tok is not None:  # DeepseekV2Config leaves it None: moebal reads 6, V2's release
        assert ours.moe.top_k == theirs.num_experts_per_tok


def test_a_failed_export_is_raised_on_every_rank_not_waited_on(monkeypatch):
    """`ExportHook.on_end`: rank 0's export error is agreed over the ranks, so rank 0 raises it and the others
    raise that it failed, where they once waited in a barrier for rank 0 (a fake trainer stands in for each)."""
    import types

    from moebal.errors import TrainingError
    from moebal.train import export as export_mod

    def boom(cfg, run_dir):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export_mod, "export_final", boom)
    hook = export_mod.ExportHook.__new__(export_mod.ExportHook)
    hook.target, hook.written = Path("/nowhere/hf"), None
    agreed: list[bool] = []

    def trainer(main: bool, others_failed: bool):
        def agree_any(flag: bool) -> bool:
            agreed.append(flag)
            return flag or others_failed
        return types.SimpleNamespace(barrier=lambda: None, ctx=types.SimpleNamespace(is_main=main), cfg=None,
                                     run_dir=None, strategy=types.SimpleNamespace(agree_any=agree_any))

    with pytest.raises(OSError, match="No space left"):
        hook.on_end(trainer(main=True, others_failed=False))
    with pytest.raises(TrainingError, match="rank 0 could not export"):
        hook.on_end(trainer(main=False, others_failed=True))
    hook.on_end(trainer(main=False, others_failed=False))  # nobody failed: no error
    assert agreed == [True, False, False]


def test_convert_to_an_unwritable_destination_is_one_line(mixtral_dir, tmp_path, capsys):
    """A DST that cannot be written (under /proc: its temporary sibling cannot be made) is one line naming DST, not
    a traceback; a SRC that is no checkpoint still says so."""
    from moebal.cli import main

    src, _ = mixtral_dir
    assert main(["convert", "hf-to-moebal", str(src), "/proc/moebal-convert-test"]) == 2
    err = capsys.readouterr().err
    assert "DST /proc/moebal-convert-test: cannot write there" in err and "Traceback" not in err, err
    assert main(["convert", "hf-to-moebal", str(tmp_path), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path} has no config.json" in err and "DST" not in err, err
