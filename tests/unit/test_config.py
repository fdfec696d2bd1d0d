"""Config: loading, overrides, validation messages, and that bad input only ever raises ConfigError."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moebal import config as C
from moebal.errors import ConfigError


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "run.yaml"
    p.write_text(text)
    return p


def test_defaults_roundtrip_through_yaml(tmp_path):
    cfg = C.Config()
    p = tmp_path / "c.yaml"
    C.dump(cfg, p)
    assert C.load(p) == cfg


def test_precedence_defaults_yaml_overrides(tmp_path):
    p = _write(tmp_path, "train:\n  steps: 7\n  lr: 3e-4\nmoe:\n  top_k: 1\n")
    cfg = C.load(p, ["train.steps=9", "moe.capacity_factor=1.25"])
    assert cfg.train.steps == 9  # override beats YAML
    assert cfg.train.lr == pytest.approx(3e-4)  # PyYAML reads 3e-4 as a string; the schema makes it a float
    assert cfg.moe.top_k == 1 and cfg.moe.capacity_factor == 1.25
    assert cfg.model == C.ModelConfig()  # untouched sections keep their defaults


@pytest.mark.parametrize("text, line", [("train:\n  lr: 1e-3\n  steps: 5\n  lr: 3e-4\n", 2),
                                        ("model:\n  dim: 64\nmodel:\n  dim: 32\n", 1)])
def test_a_key_given_twice_is_refused(tmp_path, text, line):
    with pytest.raises(ConfigError, match=rf"run.yaml: not valid YAML: .*twice in one mapping \(first on line {line}"):
        C.load(_write(tmp_path, text))


def test_a_merge_key_may_still_be_overridden(tmp_path):
    p = _write(tmp_path, "base: &b {steps: 5, lr: 1e-3}\n")
    assert yaml.load(p.read_text() + "x:\n  <<: *b\n  steps: 7\n", Loader=C._UniqueKeyLoader)["x"]["steps"] == 7


def test_override_to_null_and_back():
    cfg = C.with_overrides(C.Config(), ["moe.capacity_factor=1.0", "moe.capacity_factor=null"])
    assert cfg.moe.capacity_factor is None


def test_unknown_key_names_file_key_and_closest(tmp_path):
    p = _write(tmp_path, "train:\n  lrr: 0.1\n")
    with pytest.raises(ConfigError) as e:
        C.load(p)
    msg = str(e.value)
    assert str(p) in msg and "train.lrr" in msg and "train.lr" in msg


def test_unknown_section_suggests_closest():
    with pytest.raises(ConfigError, match="did you mean 'model'"):
        C.from_dict({"modle": {}})


def test_numbers_are_yaml_1_2s_decimal_and_dates_stay_text(tmp_path):
    # YAML 1.1 (PyYAML) read a leading zero as octal: seed 010 was 8, as was 008, and batch 016 was 14
    cfg = C.with_overrides(C.Config(), ["train.seed=010", "train.steps=0100", "data.batch_size=016",
                                        "train.lr=1e-4", "name=2024-01-01", "train.keep_checkpoints=0x10"])
    assert (cfg.train.seed, cfg.train.steps, cfg.data.batch_size, cfg.train.lr) == (10, 100, 16, 1e-4)
    assert (cfg.name, cfg.train.keep_checkpoints) == ("2024-01-01", 16)
    text = "name: 2024-01-01\ntrain:\n  seed: 008\n  steps: 1_000\n  warmup_steps: +5\n  lr: .5e-3\n"
    cfg = C.load(_write(tmp_path, text))
    assert (cfg.name, cfg.train.seed, cfg.train.steps, cfg.train.warmup_steps, cfg.train.lr) == (
        "2024-01-01", 8, 1000, 5, 5e-4)
    assert C.with_overrides(C.Config(), ["scheduler.mode=no"]).scheduler.mode == "off"  # YAML 1.1's words stay


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["moe.top_k=9"], "top_k"),
        (["parallel.ep=3"], "not divisible by 'parallel.ep'"),
        (["model.n_kv_heads=3"], "n_kv_heads"),
        (["train.steps=abc"], "must be an integer"),
        (["moe.gate=softmax-topk"], "did you mean 'softmax_topk'"),
        (["model.tie_embeddings=1"], "true or false"),
        (["data.seq_len=100000"], "max_seq_len"),
        (["train.lr=-1"], "positive"),
        (["moe.adaptive_threshold=2"], "[0, 1]"),
        (["parallel.pp=99"], "a stage needs a layer"),
        (["parallel.timeout_min=0"], "'parallel.timeout_min' must be positive"),
        (["parallel.timeout_min=.inf"], "'parallel.timeout_min' must be a finite number"),
        (["parallel.nproc=0"], "'parallel.nproc' must be at least 1"),
        (["parallel.ep=0"], "'parallel.ep' must be at least 1; got 0"),  # (once a division by zero)
        (["train.keep_checkpoints=0"], "'train.keep_checkpoints' must be at least 1; got 0"),
        (["train.seed=-1"], "'train.seed' must be in 0 .. 2**32 - 1"),
        (["train.seed=4294967296"], "'train.seed' must be in 0 .. 2**32 - 1"),
        (["train.out_dir=2024"], "YAML reads it as a number: quote the value as you meant it, in a file out_dir: "
                                 "'...', on a command line train.out_dir=\"'...'\""),
        (["planner.costs=true"], "YAML reads it as true/false: quote the value as you meant it"),
        # YAML 1.1's base 60 is a string here (it was 270 minutes), and a string is no number
        (["train.time_limit_min=4:30"], "'train.time_limit_min' must be a finite number; got '4:30'"),
        (["train.steps=1e20"], "'train.steps' is 100000000000000000000, beyond any run (at most 2**62)"),
        (["train.threads=3000000000"], "'train.threads' must be from 1 to 4096"),
        (["data.source="], "'data.source' is empty: name a path"),  # an unset shell variable
        (["data.tokenizer="], "'data.tokenizer' is empty"),
        (["hf.init_from="], "'hf.init_from' is empty: name a path, or null for none"),
        (["planner.path_profile= "], "'planner.path_profile' is empty"),
        (["scheduler.mode=on"], "must be one of off, ddp, lina"),
        (["data.mixture={a.txt:1.0,stdlib:2.0}"], "write a space after the colon, e.g. {a.txt: 1.0}"),
        (["moe.jitter=1.5"], "'moe.jitter' scales the router's input by a factor in [1 - jitter, 1 + jitter]"),
        (["moe.shared_experts=1", "moe.shared_ffn_dim=-4"], "'moe.shared_ffn_dim' must be at least 1, or null"),
        (["moe.shared_experts=1", "moe.shared_ffn_dim=0"], "'moe.shared_ffn_dim' must be at least 1, or null"),
        (["model.n_layers=4", "moe.every=3", "moe.first_dense=3"], "leave none of the 4 layers MoE"),
        (["model.n_layers=4", "moe.dense_layers=[0,1,2,3]"], "keep at least one, or set moe.num_experts=0"),
        (["model.mla={kv_lora_rank: 8, q_lora_rank: 0}", "model.qk_norm=none"],
         "'model.mla.q_lora_rank' must be at least 1; got 0"),
        # planned micro-batching's cost table must hold a row of data.seq_len, and of its smallest length
        (["parallel.pp=2", "pipeline.microbatching=dynamic", "pipeline.dynamic.max_tokens=100"],
         "set pipeline.dynamic.max_tokens to at least 128"),
        (["parallel.pp=2", "pipeline.microbatching=padding", "data.seq_len=2"],
         "(null: 4 x data.seq_len = 8), which must hold one row of data.seq_len (2) and of the table's smallest "
         "length (16): set pipeline.dynamic.max_tokens to at least 16"),
    ],
)
def test_impossible_values_say_what_to_change(overrides, fragment):
    with pytest.raises(ConfigError) as e:
        C.with_overrides(C.Config(), overrides)
    assert fragment in str(e.value)


def test_unquoted_off_is_the_choice_not_a_bool(tmp_path):
    # YAML 1.1 reads off/no as false: every choice list that has "off" takes it, from an override or a file
    c = C.load(None, ["scheduler.mode=off", "planner.plan_ahead=no", "scheduler.expert_packing=off"])
    assert (c.scheduler.mode, c.planner.plan_ahead, c.scheduler.expert_packing) == ("off", "off", "off")
    p = tmp_path / "run.yaml"
    p.write_text("parallel:\n  pp: 2\npipeline:\n  rebalance: off\n")
    assert C.load(p).pipeline.rebalance == "off"
    # an unquoted on where "on" is no choice: the message says what YAML made of it (it showed True)
    with pytest.raises(ConfigError, match="got True \\(YAML's reading of an unquoted on, yes or true\\)"):
        C.load(None, ["scheduler.expert_packing=on"])


def test_scheduler_chunks_below_a_kilobyte_are_refused():
    """1e-9 MB chunks were accepted: one all-reduce per gradient element, a step 330x slower on a toy model."""
    for key in ("chunk_mb", "bucket_mb"):
        with pytest.raises(ConfigError, match=f"'scheduler.{key}' must be at least 0.001"):
            C.load(None, [f"scheduler.{key}=1e-9"])
    assert C.load(None, ["scheduler.chunk_mb=0.002"]).scheduler.chunk_mb == 0.002


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="section.key=value"):
        C.load(None, ["train.steps"])
    with pytest.raises(ConfigError, match="is a value, not a section"):
        C.load(None, ["train.steps=1", "train.steps.x=2"])


def test_missing_file_lists_presets():
    with pytest.raises(ConfigError, match="not found"):
        C.load("no-such-config")


def test_presets_load():
    for p in sorted(C.CONFIG_DIR.glob("*.yaml")):
        if "init_from:" in p.read_text(encoding="utf-8"):
            continue  # continuation presets need a checkpoint: tests/integration/test_hf_continue.py loads them
        if p.name.startswith("cluster-"):
            continue  # cluster descriptions (moebal launch) are checked in tests/unit/test_cluster.py
        C.load(p)  # every shipped preset is valid


def test_default_yaml_is_the_dump_of_the_defaults():
    p = C.CONFIG_DIR / "default.yaml"
    if not p.exists():
        pytest.skip("configs/default.yaml not written yet")
    assert C.load(p) == C.Config()


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True),
                     st.text(max_size=12))
_values = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                         st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                       max_leaves=8)
_keys = st.sampled_from(["model", "moe", "data", "train", "parallel", "name", "model.dim", "moe.top_k",
                         "train.lr", "data.seq_len", "moe.gate", "train.precision", "x", "model.x.y"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=200))
def test_arbitrary_yaml_text_only_raises_config_error(tmp_path, text):
    p = _write(tmp_path, text)
    try:
        C.load(p)
    except ConfigError as e:
        assert str(e)


@settings(max_examples=200, deadline=None)
@given(data=st.dictionaries(_keys, _values, max_size=4))
def test_arbitrary_structures_only_raise_config_error(data):
    nested: dict = {}
    for key, value in data.items():
        parts = key.split(".")
        node = nested
        for part in parts[:-1]:
            node = node.setdefault(part, {}) if isinstance(node.get(part, {}), dict) else {}
        node[parts[-1]] = value
    try:
        C.from_dict(nested)
    except ConfigError as e:
        assert str(e)


@settings(max_examples=200, deadline=None)
@given(items=st.lists(st.text(max_size=30), max_size=3), key=_keys, value=_scalars)
def test_arbitrary_overrides_only_raise_config_error(items, key, value):
    items = [*items, f"{key}={yaml.safe_dump(value).strip()}"]
    try:
        C.load(None, items)
    except ConfigError as e:
        assert str(e)


def test_parallel_defaults_nproc_per_device_and_a_30_minute_group_timeout():
    par = C.Config().parallel
    assert par.nproc is None  # resolved at launch: one rank per visible GPU, 2 on a CPU (moebal.launch.spawn)
    assert par.timeout_min == 30.0
    assert C.with_overrides(C.Config(), ["parallel.nproc=3"]).parallel.nproc == 3


def test_grad_accum_is_refused_where_it_cannot_run_with_the_fix_named():
    assert C.load(None, ["train.grad_accum=2"]).train.grad_accum == 2
    with pytest.raises(ConfigError, match="'train.grad_accum' .* must be at least 1; got 0"):
        C.load(None, ["train.grad_accum=0"])
    with pytest.raises(ConfigError, match="raise pipeline.micro_batches"):
        C.load(None, ["train.grad_accum=2", "parallel.pp=2", "parallel.nproc=2"])
    with pytest.raises(ConfigError, match=r"data.batch_size \(16\) does not split into train.grad_accum=3"):
        C.load(None, ["train.grad_accum=3"])


def test_whole_gradient_sums_are_taken_with_every_scheme():
    assert C.load(None, ["parallel.accumulate=whole", "parallel.shard=full"]).parallel.accumulate == "whole"
    pipe = ["parallel.accumulate=whole", "parallel.pp=2", "parallel.nproc=2"]
    assert C.load(None, [*pipe, "parallel.shard=full"]).parallel.accumulate == "whole"
    exit_ = [*pipe, "dynamism.scheme=early_exit"]  # tests/distributed/test_pipeline_sharded_schemes.py
    for shard in ("none", "full", "auto"):
        assert C.load(None, [*exit_, f"parallel.shard={shard}"]).parallel.accumulate == "whole"
    with pytest.raises(ConfigError, match="accumulate"):
        C.load(None, ["parallel.accumulate=later"])


def test_weights_gathered_per_step_are_refused_with_zero_bubble_stages_with_the_fix_named():
    assert C.load(None, ["parallel.reshard=step", "parallel.shard=full"]).parallel.reshard == "step"
    zb = ["parallel.reshard=step", "parallel.pp=2", "parallel.nproc=2", "pipeline.schedule=zb"]
    assert C.load(None, [*zb, "parallel.shard=optimizer"]).parallel.reshard == "step"  # FSDP2's setting only
    with pytest.raises(ConfigError, match="'parallel.reshard: step' keeps a fully sharded stage's weights gathered "
                                          "through the step, .* set parallel.reshard=micro_batch"):
        C.load(None, [*zb, "parallel.shard=full"])
    with pytest.raises(ConfigError, match="reshard"):
        C.load(None, ["parallel.reshard=never"])


def test_tied_embeddings_are_built_under_every_sharding_with_or_without_stages():
    # with stages the head's copy follows the first stage's embedding under every sharding; a scheme's one stage
    # under full gives its head a copy too, since FSDP2 shards the embedding and the head as two units
    # (moebal/pipeline/tied.py)
    assert C.load(None, ["model.tie_embeddings=true", "dynamism.scheme=early_exit"]).model.tie_embeddings
    stages = ["model.tie_embeddings=true", "parallel.pp=2", "parallel.nproc=4"]
    scheme = ["model.tie_embeddings=true", "dynamism.scheme=freezing", "parallel.nproc=2"]
    assert C.load(None, stages).parallel.shard == "auto"
    for shard in ("none", "optimizer", "full"):
        for layout in (stages, scheme, ["model.tie_embeddings=true"]):
            assert C.load(None, [*layout, f"parallel.shard={shard}"]).parallel.shard == shard
    # where the config's checks refuse every value auto may take, auto's line gives each one's reason
    import torch

    from moebal.planner.memory import choose_shard
    from moebal.train.memory import _device_memory, resolve_shard

    assert resolve_shard(C.load(None, stages), torch.device("cpu"), 4, 4)[0].parallel.shard == "none"
    lone = ["parallel.reduce_dtype=bf16", "train.precision=bf16", "dynamism.scheme=pruning", "parallel.nproc=2",
            "parallel.param_dtype=bf16", "model.tie_embeddings=true"]  # a scheme's one stage
    # bf16 weights need a sharded state: auto passes over none and takes the sharded optimizer, which fits
    assert resolve_shard(C.load(None, lone), torch.device("cpu"), 2, 2)[0].parallel.shard == "optimizer"
    with pytest.raises(ConfigError, match=r"parallel.shard auto: this config's checks refuse every value \(none: "
                                          r"'parallel.param_dtype: bf16' / 'parallel.reduce_dtype: bf16' .*\)"):
        choose_shard(C.load(None, lone), 2, _device_memory(torch.device("cpu"), 2, "measure"), "bf16",
                     shards=("none",))


def test_the_rank_split_of_accumulated_rows_names_the_multiple():
    from moebal.distributed.groups import ParallelDims
    from moebal.train.distributed import RunContext

    ctx = RunContext(ParallelDims(world_size=2, rank=0, ep=1, pp=1))
    ctx.check_batch(8, 4)
    with pytest.raises(ConfigError, match=r"2 ranks x train.grad_accum=4 micro-batches: .* a multiple of 8"):
        ctx.check_batch(12, 4)


@pytest.mark.parametrize(("override", "named"), [
    ("planner.feedback.tolerance=2", "'planner.feedback': feedback: tolerance"),
    ("pipeline.feedback.window=0", "'pipeline.feedback': feedback: tolerance"),
    ("train.beta2=1.0", "train.beta1 and train.beta2 (AdamW's betas) must be in [0, 1); got 0.9, 1.0"),
    ("moe.aux_loss_coef=-1", "moe.aux_loss_coef=-1.0: must be >= 0"),
])
def test_a_bad_value_s_error_names_its_key_or_section(override: str, named: str) -> None:
    """Two sections share the feedback settings: the error says which one; a check over several keys says which."""
    with pytest.raises(ConfigError) as e:
        C.load(None, [override])
    assert named in str(e.value)


def test_router_fp32_is_refused_with_bf16_weight_copies():
    """`moe.router_fp32` promises an fp32 router weight; `parallel.param_dtype: bf16` computes from bf16 copies of
    every dense weight, the router's included: refused with both fixes named."""
    with pytest.raises(ConfigError, match=r"router_fp32.*parallel.param_dtype=fp32.*moe.router_fp32=false"):
        C.load(None, ["moe.router_fp32=true", "parallel.param_dtype=bf16", "parallel.shard=optimizer",
                    "train.precision=bf16"])
    assert C.load(None, ["moe.router_fp32=true", "train.precision=bf16"]).moe.router_fp32



def test_a_huge_expert_count_loads_at_once_and_a_divisor_hint_stays_short():
    """The divisors in an error message are listed only when the check fails, and within a bounded search: a
    mistyped `moe.num_experts=1e30` hung the loader, which listed them on every load."""
    assert C.load(None, ["moe.num_experts=1e18"]).moe.num_experts == 10**18
    with pytest.raises(ConfigError, match=r"beyond any run \(at most 2\*\*62\)"):  # past it, refused at once
        C.load(None, ["moe.num_experts=1e30"])
    with pytest.raises(ConfigError, match=r"choose ep among 1, 2, 4, 8, 16, 32, 64$"):
        C.load(None, ["moe.num_experts=64", "parallel.ep=3"])
    with pytest.raises(ConfigError, match=r"choose ep among 1, 2, 4, 5, 8, .*, \.\.\.$"):
        C.load(None, [f"moe.num_experts={10**18}", "parallel.ep=3"])
