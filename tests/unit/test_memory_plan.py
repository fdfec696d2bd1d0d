"""The memory plan (moebal/planner/memory.py): term arithmetic by hand, refusals, --fit, the bench's JSON."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from pathlib import Path

import pytest

from moebal.cli import main
from moebal.config import load
from moebal.errors import ConfigError
from moebal.planner.hardware import load_profile
from moebal.planner.memory import (
    DeviceMemory,
    MemoryLayout,
    choose_shard,
    fit_layout,
    layout_from_config,
    overhead,
    plan_memory,
    refusal_line,
)
from tests.cli_util import load_script

TINY = ["model.vocab_size=256", "model.dim=8", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=2",
        "model.ffn_dim=16", "moe.num_experts=2", "moe.top_k=1", "moe.expert_ffn_dim=4", "data.batch_size=2",
        "data.seq_len=4", "model.max_seq_len=8", "train.precision=fp32"]
BARE = DeviceMemory(name="bare", capacity_bytes=1e12, runtime_bytes=0.0, slack=0.0)


def test_terms_by_hand_one_rank():
    cfg = load(None, TINY)
    plan = plan_memory(cfg, MemoryLayout(ranks=1), BARE)
    # parameters: attention 8*(8+16) + 8*8 + 2*8 = 272, router 16, experts 2*3*8*4 = 192, embed + head 2*2048, norm 8
    held = 272 + 16 + 192 + 2 * 2048 + 8
    t = plan.terms
    assert t["parameters"] == 4 * held and t["gradients"] == 4 * held and t["optimizer state"] == 8 * held
    assert t["persistent gradient buffers"] == 0 and t["gradient all-reduce copy"] == 0  # one rank: no sync
    # per token: an fp32 norm keeps 4*(3*8 + 1) = 100 (input, output, normalised copy, root); attention 100 +
    # 4*(8 + 16 + 2*8) (q, k+v, o twice) + 4*2 (lse) = 268; MoE 100 + 4*3*2 (router) + 1 routed row *
    # (4*(2*8 + 4*4) + 24) = 276; kept = 544 + 8 (ids) + 100 (final norm)
    tokens = 2 * 4
    assert t["activations"] == tokens * ((544 + 8 + 100) + 544)  # in flight + one layer's backward working set
    assert t["logits/loss"] == tokens * 256 * 16
    assert t["start-up (whole model built)"] == 4 * held
    state = 12 * held
    assert plan.phases["forward/backward"] == state + t["activations"] + t["logits/loss"]
    assert plan.phases["gradient sync"] == state + 4 * held
    assert plan.peak_bytes == max(plan.phases.values())


def test_a_tied_pipeline_s_last_stage_holds_the_head_copy_without_its_optimizer_state():
    # moebal/pipeline/tied.py: the last stage's head is a copy of the first stage's embedding (weights and
    # gradients), which only the first stage's AdamW steps
    from moebal.planner.memory import _layers, _stage_terms

    two = [*TINY, "model.n_layers=2", "parallel.pp=2", "parallel.nproc=2", "parallel.shard=none"]
    untied, tied = load(None, two), load(None, [*two, "model.tie_embeddings=true"])
    lay = MemoryLayout(ranks=2, pp=2)
    first, last = ([_stage_terms(c, _layers(c), lay, s, range(s, s + 1), False)[0] for c in (untied, tied)]
                   for s in (0, 1))
    keys = ("parameters", "gradients", "optimizer state")
    assert all(first[0][k] == first[1][k] for k in keys)
    head = 256 * 8  # V x D
    assert last[0]["parameters"] == last[1]["parameters"] and last[0]["gradients"] == last[1]["gradients"]
    assert last[0]["optimizer state"] - last[1]["optimizer state"] == 8 * head
    # the sharded optimizer with bf16 compute copies: the copy is no flat's (fp32 weights, a whole fp32 gradient,
    # no master, no moments), and autocast casts it for the head
    zero = [*two, "parallel.nproc=4", "parallel.shard=optimizer", "parallel.param_dtype=bf16", "train.precision=bf16"]
    untied, tied = load(None, zero), load(None, [*zero, "model.tie_embeddings=true"])
    lay = layout_from_config(tied, 4)
    assert lay.bf16_copies and lay.stage_ranks == 2
    u, t = (_stage_terms(c, _layers(c), lay, 1, range(1, 2), False)[0] for c in (untied, tied))
    # the head: untied, a bf16 copy (2 bytes) with a sharded fp32 master (4 / 2); tied, 4 bytes whole
    assert t["parameters"] - u["parameters"] == 4 * head - (2 * head + 4 * head / 2)
    assert u["optimizer state"] - t["optimizer state"] == 8 * head / 2
    assert t["compute-dtype weight copies"] - u["compute-dtype weight copies"] == 2 * head
    # full sharding: the copy is no FSDP2 unit (whole fp32 weight and gradient, no moments, none gathered; autocast
    # casts it), where the untied head is an fp32 shard (4 / 2) gathered in bf16 for its forward (2)
    full = [*two, "parallel.nproc=4", "parallel.shard=full", "parallel.param_dtype=bf16", "train.precision=bf16",
            "parallel.reshard=step"]
    untied, tied = load(None, full), load(None, [*full, "model.tie_embeddings=true"])
    lay = layout_from_config(tied, 4)
    assert lay.shard == "full" and lay.stage_ranks == 2
    u, t = (_stage_terms(c, _layers(c), lay, 1, range(1, 2), False)[0] for c in (untied, tied))
    assert t["parameters"] - u["parameters"] == 4 * head - (4 * head / 2 + 2 * head)
    assert u["optimizer state"] - t["optimizer state"] == 8 * head / 2
    assert t["compute-dtype weight copies"] - u["compute-dtype weight copies"] == 2 * head
    # the first stage sums the head's gradient into its shards after the backward pass: the whole fp32 gradient,
    # its padded copy and the send buffer (reduce_dtype, fp32 by default), in the gradient sync phase
    u0, t0 = (_stage_terms(c, _layers(c), lay, 0, range(0, 1), False) for c in (untied, tied))
    assert u0[0]["tied head gradient (full)"] == 0 and t["tied head gradient (full)"] == 0
    assert t0[0]["tied head gradient (full)"] == (4 + 2 * 4) * head
    assert t0[1]["gradient sync"] - u0[1]["gradient sync"] >= (4 + 2 * 4) * head
    # a scheme's one fully sharded stage gives its head a copy of its own: the untied head's sizes, but the head
    # whole (fp32, no moments) instead of an FSDP2 unit's shard, and the gradient sum's transients
    one = [*TINY, "model.n_layers=2", "dynamism.scheme=freezing", "parallel.nproc=2", "parallel.shard=full"]
    untied, tied = load(None, one), load(None, [*one, "model.tie_embeddings=true"])
    lay = layout_from_config(tied, 2)
    assert lay.pipelined and lay.pp == 1 and lay.stage_ranks == 2
    u, t = (_stage_terms(c, _layers(c), lay, 0, range(0, 2), False)[0] for c in (untied, tied))
    # (the largest unit gathered is the embedding either way)
    assert t["parameters"] - u["parameters"] == 4 * head - 4 * head / 2
    assert u["optimizer state"] - t["optimizer state"] == 8 * head / 2
    assert t["tied head gradient (full)"] == (4 + 2 * 4) * head and u["tied head gradient (full)"] == 0
    # unsharded, the one stage holds one tensor: the untied head's parameters less the head
    none = [*one[:-1], "parallel.shard=none"]
    u, t = (plan_memory(load(None, [*none, *x]), layout_from_config(load(None, [*none, *x]), 2), BARE).terms
            for x in ([], ["model.tie_embeddings=true"]))
    assert u["parameters"] - t["parameters"] == 4 * head and t["tied head gradient (full)"] == 0
    # one stage under bf16 autocast: the head's cast of the tied weight counts as the untied head's does
    one = [*TINY, "train.precision=bf16"]
    lay = MemoryLayout(ranks=1, precision="bf16")
    u, t = (plan_memory(load(None, c), lay, BARE).terms for c in (one, [*one, "model.tie_embeddings=true"]))
    assert t["compute-dtype weight copies"] == u["compute-dtype weight copies"] > 2 * head


def test_terms_by_hand_sharded_and_expert_parallel():
    cfg = load(None, TINY)
    held = 272 + 16 + 192 + 2 * 2048 + 8
    dense, experts = held - 192, 192
    opt = plan_memory(cfg, MemoryLayout(ranks=2, shard="optimizer"), BARE).terms
    assert opt["optimizer state"] == 8 * held / 2
    # the shard + one layer's gradients waiting for their buckets + the previous layer's send buffers in flight
    assert opt["gradients"] == 4 * held / 2 + 2 * 4 * (272 + 16 + 192)
    # ep 2: this rank's experts' gradients whole (their buckets go out after Agg), two dense layers in flight
    opt_ep = plan_memory(cfg, MemoryLayout(ranks=2, ep=2, shard="optimizer"), BARE).terms
    assert opt_ep["gradients"] == 4 * (dense / 2 + experts / 2) + 2 * 4 * (272 + 16)
    assert opt["parameters"] == 4 * held  # ZeRO-2: weights replicated
    # bf16 weights (parallel.param_dtype): bf16 copies replicated, fp32 masters sharded; with ep 2 the experts
    # stay fp32 and whole (autocast still casts them per forward)
    lo = plan_memory(cfg, MemoryLayout(ranks=2, shard="optimizer", precision="bf16", param_dtype="bf16"), BARE).terms
    assert lo["parameters"] == 2 * held + 4 * held / 2 and lo["compute-dtype weight copies"] == 0
    lo_ep = plan_memory(cfg, MemoryLayout(ranks=2, ep=2, shard="optimizer", precision="bf16", param_dtype="bf16"),
                        BARE).terms
    assert lo_ep["parameters"] == 2 * dense + 4 * experts / 2 + 4 * dense / 2
    assert lo_ep["compute-dtype weight copies"] == 2 * experts / 2
    # ep 2 x dp 2: the experts' masters split over their 2 expert-data-parallel ranks, so they get bf16 copies too
    # and autocast casts nothing; under full their gathered layer is bf16 (one MoE layer: the rank's 1 of 2 experts)
    bf16 = {"precision": "bf16", "param_dtype": "bf16"}
    cfg4 = load(None, [*TINY, "data.batch_size=4"])
    lo_dp = plan_memory(cfg4, MemoryLayout(ranks=4, ep=2, shard="optimizer", **bf16), BARE).terms
    assert lo_dp["parameters"] == 2 * (dense + experts / 2) + 4 * dense / 4 + 4 * experts / 2 / 2
    assert lo_dp["compute-dtype weight copies"] == 0
    full_dp = {k: plan_memory(cfg4, MemoryLayout(ranks=4, ep=2, shard="full", **kw), BARE).terms["parameters"]
               for k, kw in (("fp32", {"precision": "bf16"}), ("bf16", bf16))}
    # FSDP2 gathers in param_dtype, not the autocast's: the root and two layers' dense weights at 4 bytes against 2
    assert full_dp["fp32"] - full_dp["bf16"] == (4 - 2) * experts / 2 + (4 - 2) * ((dense - 288) + 2 * 288)
    ep = plan_memory(cfg, MemoryLayout(ranks=2, ep=2), BARE).terms
    assert ep["parameters"] == 4 * (dense + experts / 2)
    assert ep["persistent gradient buffers"] == 4 * (dense + experts / 2)  # GradSync's flat buffer
    assert ep["all-to-all buffers"] == 2 * 4 * 1 * 8 * 4  # rows of one layer sent + received, fp32
    full = plan_memory(cfg, MemoryLayout(ranks=2, ep=2, shard="full"), BARE).terms
    # full (moebal/distributed/fsdp.py): dense shards, this rank's experts whole (replicated over the
    # expert-data-parallel ranks), FSDP2's gathered root unit (embedding, head, norm) and two layers' dense weights
    layer = 272 + 16
    assert full["parameters"] == 4 * (dense / 2 + experts / 2) + 4 * ((dense - layer) + 2 * layer)
    assert full["gradients"] == 4 * (dense / 2 + experts / 2) + 4 * (layer + experts / 2)
    # with ep 1 FSDP2 shards the experts with the rest (no expert parallelism to leave them to)
    dp = plan_memory(cfg, MemoryLayout(ranks=2, ep=1, shard="full"), BARE).terms
    assert dp["parameters"] == 4 * held / 2 + 4 * ((dense - layer) + 2 * (layer + experts))
    assert dp["optimizer state"] == 8 * held / 2
    # the backward pass: one unit's unsharded gradients (compute dtype) and its reduce-scatter input (fp32) beside
    # the activations; a layer with its experts is the largest unit here, the dense layer with ep 2
    assert dp["FSDP2 reduce-scatter buffers"] == (4 + 4) * (layer + experts)
    assert full["FSDP2 reduce-scatter buffers"] == (4 + 4) * layer
    assert opt["FSDP2 reduce-scatter buffers"] == 0 and ep["FSDP2 reduce-scatter buffers"] == 0
    # the unsharded gradients are in FSDP2's param_dtype: fp32 by default whatever the autocast, bf16 with it
    bf16 = plan_memory(cfg, MemoryLayout(ranks=2, ep=1, shard="full", precision="bf16"), BARE).terms
    assert bf16["FSDP2 reduce-scatter buffers"] == (4 + 4) * (layer + experts)
    bf16 = plan_memory(cfg, MemoryLayout(ranks=2, ep=1, shard="full", precision="bf16", param_dtype="bf16"),
                       BARE).terms
    assert bf16["FSDP2 reduce-scatter buffers"] == (2 + 4) * (layer + experts)
    fwd = plan_memory(cfg, MemoryLayout(ranks=2, ep=1, shard="full"), BARE).phases["forward/backward"]
    assert fwd == dp["parameters"] + dp["optimizer state"] + dp["activations"] + dp["logits/loss"] + (
        dp["FSDP2 reduce-scatter buffers"])


def test_full_sharding_slack_is_the_cpu_hosts_own_and_only_there():
    """A CPU host's malloc keeps more freed heap under FSDP2 (CPU_FULL_SHARD_SLACK): it prices `shard: full` on
    DeviceMemory.cpu only; other shard settings and a GPU's profile keep their own slack."""
    from moebal.planner.memory import CPU_ALLOCATOR_SLACK, CPU_FULL_SHARD_SLACK

    cfg = load(None, TINY)
    cpu = DeviceMemory.cpu(64e9, 4)
    gpu = DeviceMemory.from_profile(load_profile("h100"))
    assert gpu.full_shard_slack is None and gpu.slack_for("full") == gpu.slack
    assert cpu.slack_for("full") == CPU_FULL_SHARD_SLACK and cpu.slack_for("optimizer") == CPU_ALLOCATOR_SLACK
    for dev in (cpu, gpu):
        for shard in ("none", "full"):
            plan = plan_memory(cfg, MemoryLayout(ranks=2, shard=shard), dev)
            body = max(plan.phases["start-up"], max(v for k, v in plan.phases.items() if k != "start-up")
                       + plan.terms["start-up leftovers"])
            assert plan.peak_bytes == pytest.approx(dev.runtime_bytes + (1 + dev.slack_for(shard)) * body)
            assert plan.terms["allocator slack"] == pytest.approx(dev.slack_for(shard) * body)


def test_cuda_fp32_grouped_query_attention_saves_keys_and_values_at_every_query_head():
    """On CUDA in fp32 the model expands K/V to the H query heads before SDPA (models.transformer.expand_kv_heads):
    the plan saves 2 (H - G) head_dim more fp32 values per token and layer there, and nothing more elsewhere."""
    gqa = load(None, [*TINY, "model.n_heads=4", "model.n_kv_heads=2"])  # head_dim 2
    cuda = dataclasses.replace(BARE, cuda=True)
    per_token_layer = 4 * 2 * (4 - 2) * 2
    tokens = 2 * 4
    host, gpu = (plan_memory(gqa, MemoryLayout(ranks=1), d).terms["activations"] for d in (BARE, cuda))
    assert gpu - host == tokens * 2 * per_token_layer  # kept in flight + the one layer's backward working set
    bf16 = [plan_memory(gqa, MemoryLayout(ranks=1, precision="bf16"), d).terms["activations"] for d in (BARE, cuda)]
    assert bf16[0] == bf16[1]  # bf16 runs flash attention with enable_gqa: nothing expanded
    mha = load(None, TINY)  # G == H: nothing to expand
    assert (plan_memory(mha, MemoryLayout(ranks=1), BARE).terms["activations"]
            == plan_memory(mha, MemoryLayout(ranks=1), cuda).terms["activations"])
    assert DeviceMemory.from_profile(load_profile("h100")).cuda
    # a calibrated CPU profile's device is a process sharing the host's RAM with the node's other ranks, at the
    # fitted CPU constants, not a CUDA device (keys and values at G heads)
    calibrated = dataclasses.replace(load_profile("h100"), device="cpu", memory_bytes=64e9, gpus_per_node=64)
    four = DeviceMemory.from_profile(calibrated, 4)
    host = DeviceMemory.cpu(64e9, 4)
    assert not four.cuda and dataclasses.replace(four, name=host.name) == host
    assert DeviceMemory.from_profile(calibrated, 128).capacity_bytes == 1e9  # 64 ranks a node share it


def _saved_bytes_per_token(cfg, density: float) -> float:
    """Bytes the attention of a fresh layer keeps for its backward (distinct storages, saved-tensor hooks), one row,
    through the sparse-attention scheme's forward at `density` (1: the dense core)."""
    import torch

    from moebal.dynamism.sparse_attention import sparse_attention_forward
    from moebal.models import build_model

    torch.manual_seed(0)
    m = build_model(cfg)
    T = cfg.data.seq_len
    x = torch.randn(1, T, cfg.model.dim, requires_grad=True)
    cos, sin = m.model.rotary(T, torch.float32)
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        sparse_attention_forward(m.model.layers[0].self_attn, x, cos, sin, density, cfg.dynamism.sparse_attention.block)
    return sum(seen.values()) / T


@pytest.mark.parametrize("block,max_density,seq", [(16, 1.0, 512), (16, 0.5, 512), (6, 1.0, 192), (128, 1.0, 512),
                                                   (128, 0.6, 512)],
                         ids=["masked", "masked-0.5", "masked-mask-per-run", "split", "split-0.6"])
def test_sparse_attention_core_extra_is_what_the_kernel_keeps(block, max_density, seq):
    """`sparse_core_extra` (the plan's term for dynamic sparse attention) against the kernel's saved tensors at the
    plan's worst density (max_density, or just below 1), on both CPU paths, with the masked path's shared mask and
    (blocks of 6: unaligned views) a mask per run: within 2 % of the measured extra over the dense core; and the
    plan's activations grow by it per layer."""
    from moebal.kernels.sparse_attention import default_path
    from moebal.planner.memory import sparse_core_extra

    over = [*TINY, "model.dim=64", "model.n_heads=4", "model.n_kv_heads=2", "moe.num_experts=0",
            f"model.max_seq_len={seq}", f"data.seq_len={seq}", "data.batch_size=1", "dynamism.scheme=sparse_attention",
            f"dynamism.sparse_attention.block={block}", f"dynamism.sparse_attention.max_density={max_density}"]
    cfg = load(None, over)
    import torch

    assert default_path(torch.device("cpu"), block, 2) == ("masked" if block < 128 else "split")
    worst = max_density if max_density < 1 else 1.0 - 1e-9
    measured = _saved_bytes_per_token(cfg, worst) - _saved_bytes_per_token(cfg, 1.0)
    predicted = sparse_core_extra(cfg, 4, cuda=False)
    assert measured > 0 and abs(predicted - measured) <= 0.02 * measured, (predicted, measured)
    dense = load(None, [*over[:-3], "dynamism.scheme=none"])
    grow = (plan_memory(cfg, MemoryLayout(ranks=1), BARE).terms["activations"]
            - plan_memory(dense, MemoryLayout(ranks=1), BARE).terms["activations"])
    assert grow == pytest.approx(seq * 2 * predicted)  # kept in flight + the one layer's backward working set
    # recomputing the attention keeps its input only: the term stays in the rebuilt layer's working set alone
    rc = dataclasses.replace(MemoryLayout(ranks=1), recompute="attention")
    grow_rc = (plan_memory(cfg, rc, BARE).terms["activations"] - plan_memory(dense, rc, BARE).terms["activations"])
    assert grow_rc == pytest.approx(seq * predicted)


def test_sparse_attention_core_extra_on_cuda_is_the_flex_block_mask():
    """On CUDA the flex path keeps a fused core's tensors and the block mask: the plan's term is exactly the block
    mask's tables per token, as many bytes as `flex_block_mask` builds for one row (measured on a CPU tensor)."""
    import torch

    from moebal.kernels.sparse_attention import flex_block_mask, select_blocks
    from moebal.planner.memory import sparse_core_extra

    T, b, H, G = 512, 64, 4, 2
    cfg = load(None, [*TINY, "model.dim=64", "model.n_heads=4", "model.n_kv_heads=2", "moe.num_experts=0",
                      f"model.max_seq_len={T}", f"data.seq_len={T}", "dynamism.scheme=sparse_attention",
                      f"dynamism.sparse_attention.block={b}"])
    q, k = torch.randn(1, H, T, 16), torch.randn(1, G, T, 16)
    mask = flex_block_mask(select_blocks(q, k, b, 0.5), H, T)
    tables = {t.data_ptr(): t for t in (mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks,
                                        mask.full_kv_indices, mask.q_num_blocks, mask.q_indices,
                                        mask.full_q_num_blocks, mask.full_q_indices)}  # shared ones once
    N = T // b
    want = sum(t.numel() * t.element_size() for t in tables.values()) + G * N * N  # and the bool grid
    assert sparse_core_extra(cfg, 2, cuda=True) * T == want
    assert sparse_core_extra(cfg, 2, cuda=True) < 0.05 * sparse_core_extra(cfg, 2, cuda=False)


def test_sparse_attention_block_longer_than_half_the_row_plans_no_core_and_the_scheme_refuses_it():
    # the plan runs before the scheme is built (`moebal train` picks parallel.shard from it): a block that does not
    # cut the row into 2 blocks once crashed it (`max()` of no blocks); it plans nothing and the scheme names a fit
    from moebal.dynamism.sparse_attention import DynamicSparseAttention
    from moebal.planner.memory import sparse_core_extra

    cfg = load(None, [*TINY, "model.max_seq_len=32", "data.seq_len=32", "dynamism.scheme=sparse_attention"])
    assert cfg.dynamism.sparse_attention.block == 64 and sparse_core_extra(cfg, 4, cuda=False) == 0.0
    with pytest.raises(ConfigError, match="set dynamism.sparse_attention.block=16"):
        DynamicSparseAttention(cfg, block=64)


def test_recompute_keeps_layer_inputs():
    cfg = load(None, TINY)
    none = plan_memory(cfg, MemoryLayout(ranks=1), BARE).terms["activations"]
    full = plan_memory(cfg, MemoryLayout(ranks=1, recompute="full"), BARE).terms["activations"]
    assert full == 8 * ((4 * 8 + 8 + 100) + 544)  # the layer input only, plus one rebuilt layer
    assert full < none
    moe = plan_memory(cfg, MemoryLayout(ranks=1, recompute="moe"), BARE).terms["activations"]
    assert moe == 8 * ((268 + 32 + 8 + 100) + 544)
    # expert parallel: the MoE block is never replayed whole, so recompute moe keeps all but the expert GEMMs'
    # intermediates (norm 100, router 24, the routed row's input and output on both sides 4*4*8, indices 24)
    ep_moe = plan_memory(cfg, MemoryLayout(ranks=2, ep=2, recompute="moe"), BARE).terms["activations"]
    assert ep_moe == 4 * ((268 + 100 + 24 + 4 * 4 * 8 + 24 + 8 + 100) + 544)


def test_pipeline_stages_and_in_flight_micro_batches():
    cfg = load(None, [*TINY, "model.n_layers=2", "data.batch_size=8"])
    plan = plan_memory(cfg, MemoryLayout(ranks=2, pp=2, micro_batches=4), BARE)
    assert len(plan.stage_peaks) == 2
    tokens = 8 // 4 * 4  # a micro-batch: 8 rows / 4 micro-batches, of 4 tokens
    assert plan.terms["pipeline p2p buffers"] == 2 * 2 * tokens * 8 * 4  # fwd + bwd, sent + received, D 8, fp32
    gpipe = plan_memory(cfg, MemoryLayout(ranks=2, pp=2, micro_batches=4, schedule="gpipe"), BARE)
    assert gpipe.stage_peaks[0] > plan.stage_peaks[0]  # GPipe keeps all 4 micro-batches, 1F1B 2 on stage 0


def test_layout_errors_name_the_fix():
    cfg = load(None, TINY)
    with pytest.raises(Exception, match="ep=3 must divide"):
        plan_memory(cfg, MemoryLayout(ranks=3, ep=3), BARE)
    with pytest.raises(Exception, match="not divisible by the 4 ranks"):
        plan_memory(cfg, MemoryLayout(ranks=4), BARE)


@pytest.mark.parametrize("skew", ["0.5", "-1", "nan"])
def test_a_routing_skew_below_one_is_refused(capsys, skew):
    """`--skew` is the busiest rank's routed rows over the mean, so >= 1 (-1 once gave negative activations and a
    "fits")."""
    assert main(["plan", "memory", "mixtral-8x7b", "--cluster", "h100", "--skew", skew]) == 2
    assert "--skew is the busiest rank's routed rows / the mean, so at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("argv, key", [(["--pp", "2", "parallel.pp=1"], "parallel.pp"),
                                       (["--shard", "none", "parallel.shard=full"], "parallel.shard"),
                                       (["--ranks", "16", "parallel.nproc=8"], "parallel.nproc")])
def test_a_flag_and_an_override_of_its_key_are_refused(capsys, argv, key):
    # the flag silently won (`moebal train` refused the same conflict)
    assert main(["plan", "memory", "mixtral-8x7b", "--cluster", "h100", *argv]) == 2
    err = capsys.readouterr().err
    assert f"both set {key}: give one of them" in err and len(err.strip().splitlines()) == 1, err


def test_impossible_job_is_refused_in_one_line(capsys):
    assert main(["plan", "memory", "mixtral-8x7b", "--cluster", "a100", "--ranks", "1", "--pp", "1", "--ep", "1"]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    line = out[-1]
    assert line.startswith("will not fit:") and "largest term:" in line and "GB per rank" in line
    assert "peak per rank" in out[-2] and "does NOT fit" in out[-2]


def test_without_ranks_the_plan_holds_the_configs_stages_and_expert_parallel_group(capsys):
    # the preset is pp 2 x ep 8 with one process: its own layout needs 16 ranks, not one
    assert main(["plan", "memory", "mixtral-8x7b", "--cluster", "h100", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layout"]["ranks"] == 16
    assert main(["plan", "memory", "mixtral-8x7b", "--cluster", "h100", "--pp", "1", "--ep", "4", "--json"]) in (0, 1)
    assert json.loads(capsys.readouterr().out)["layout"]["ranks"] == 4


def test_refusal_names_a_setting_that_fits():
    cfg = load("llama-moe-3.5b", ["parallel.pp=1", "parallel.ep=8", "parallel.shard=none"])
    dev = DeviceMemory.from_profile(load_profile("h100"))
    plan = plan_memory(cfg, layout_from_config(cfg, 8, init="local"), dev)
    assert not plan.fits
    line = refusal_line(cfg, plan)
    assert "fits with" in line
    fix = line.split("fits with ")[1].split(" (")[0]
    changes = dict(kv.split("=") for kv in fix.split())
    keys = {"parallel.shard": "shard", "train.recompute": "recompute", "parallel.pp": "pp", "parallel.ep": "ep",
            "pipeline.micro_batches": "micro_batches", "train.grad_accum": "micro_batches", "planner.policy": "policy",
            "planner.max_replicas": "max_replicas"}
    fixed = dataclasses.replace(plan.layout, **{keys[k]: (int(v) if v.isdigit() else v) for k, v in changes.items()})
    assert plan_memory(cfg, fixed, dev).fits


def test_fit_returns_a_layout_the_plan_accepts(capsys):
    assert main(["plan", "memory", "mixtral-8x7b", "--cluster", "h100", "--ranks", "64", "--init", "local",
                 "--fit", "--json", "data.batch_size=64"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"]
    cfg = load("mixtral-8x7b", ["data.batch_size=64"])
    lay = MemoryLayout(**out["layout"])
    plan = plan_memory(cfg, lay, DeviceMemory.from_profile(load_profile("h100")))
    assert plan.fits and plan.peak_bytes == pytest.approx(out["peak_bytes"], abs=1)
    # nothing on fewer ranks fits: the fit is the smallest
    smaller = fit_layout(cfg, plan.device, dataclasses.replace(lay, pp=1, ep=1), max_ranks=lay.ranks // 2)
    assert smaller is None


def test_presets_fit_on_their_clusters():
    dev = DeviceMemory.from_profile(load_profile("h100-ndr400"))
    # parallel.shard auto, as the presets leave it: settled as `moebal train` settles it on these GPUs (to none)
    llama, line = choose_shard(load("llama-moe-3.5b"), 8, dev, "bf16")  # one 8-GPU node
    assert llama.parallel.shard == "none", line
    assert plan_memory(llama, layout_from_config(llama, 8), dev).fits
    # 16 GPUs with the settings its YAML names (pp 2 x ep 8, recompute full): the first micro-batch's fp32
    # gradients beside the second's activations leave no room unsharded (88.5 GB) or with ZeRO-2 (82.2 GB)
    mixtral, line = choose_shard(load("mixtral-8x7b"), 16, dev, "bf16")
    assert mixtral.parallel.shard == "full" and "none 88.5 GB, optimizer 82.2 GB would not" in line, line
    assert plan_memory(mixtral, layout_from_config(mixtral, 16), dev).fits
    # without the recompute no sharding fits: auto takes the closest (full), which the start-up check refuses
    closest, line = choose_shard(mixtral, 16, dev, "bf16", recompute="none")
    assert closest.parallel.shard == "full" and "nothing fits" in line
    assert not plan_memory(closest, layout_from_config(closest, 16, recompute="none"), dev).fits
    # without the pipeline full sharding fits 16 GPUs with expert weights sharded at rest over dp 2 when FSDP2
    # gathers bf16 (75.1 GB): half of each rank's experts plus one MoE layer's gathered; the activations (an
    # expert-parallel MoE block is never replayed whole) and then the expert gradients, whole until Agg, are the
    # largest terms. Gathering fp32 (the default) it does not (92.3 GB: autocast's bf16 casts of every layer's
    # weights kept to the backward pass), and the refusal names the fix
    bf16_weights = dataclasses.replace(mixtral, parallel=dataclasses.replace(mixtral.parallel, param_dtype="bf16"))
    planned = layout_from_config(mixtral, 16, pp=1, shard="full", recompute="moe")
    fp32_gathers = plan_memory(mixtral, planned, dev)
    assert not fp32_gathers.fits and "fits with parallel.param_dtype=bf16" in refusal_line(mixtral, fp32_gathers)
    # ... only where the config takes a bf16 param_dtype: not beside moe.router_fp32 (it once proposed it there)
    fp32_router = dataclasses.replace(mixtral, moe=dataclasses.replace(mixtral.moe, router_fp32=True))
    assert "param_dtype" not in refusal_line(fp32_router, plan_memory(fp32_router, planned, dev))
    plan = plan_memory(bf16_weights, layout_from_config(bf16_weights, 16, pp=1, shard="full", recompute="moe"), dev)
    assert plan.fits and plan.largest_term[0] == "activations"
    others = ("activations", "allocator slack", "start-up (whole model built)")
    assert plan.terms["gradients"] == max(v for k, v in plan.terms.items() if k not in others)
    assert 12e9 < plan.terms["parameters"] < 14e9


@pytest.mark.parametrize("preset, ranks", [("llama-moe-3.5b", 8), ("mixtral-8x7b", 16), ("olmoe-1b-7b", 8),
                                           ("deepseek-v2-lite", 8), ("qwen3-30b-a3b", 16)])
def test_real_shape_presets_fit_their_own_layout_at_the_figure_their_comments_give(preset, ranks):
    # `moebal train PRESET` on its GPUs must not be refused by its own start-up check (three presets once were:
    # Pro-Prophet's replicas at their bound); deepseek-v3 says in its comment that it does not fit 64 GPUs
    dev = DeviceMemory.from_profile(load_profile("h100-ndr400"))
    cfg = load(preset)
    assert cfg.parallel.pp * (cfg.parallel.ep or 1) == ranks  # the ranks `moebal plan memory PRESET` plans
    settled, line = choose_shard(cfg, ranks, dev, "bf16")
    plan = plan_memory(settled, layout_from_config(settled, ranks), dev)
    assert plan.fits, line
    text = (Path(__file__).resolve().parents[2] / "configs" / f"{preset}.yaml").read_text(encoding="utf-8")
    said = re.search(r"(\d+\.\d) GB per rank(?! at)", text)
    assert said and float(said.group(1)) == round(plan.peak_bytes / 1e9, 1), (preset, plan.peak_bytes)


def _ram() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_train_refuses_at_start_up_and_can_be_overridden(tmp_path, capsys):
    # logits of 65,536 vocabulary entries per token, fp32, four copies: 1 MB per token; more tokens per rank than
    # this machine's RAM shared by 2 ranks holds
    rows = 2 * (int(_ram() / 2 / (65536 * 16) / 512) + 2)
    argv = ["train", f"data.batch_size={rows}", "data.seq_len=512", "model.vocab_size=65536", "--nproc", "2",
            "--out", str(tmp_path / "run")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    refusal = [ln for ln in err if "will not fit" in ln]
    assert len(refusal) == 1 and "largest term: logits/loss" in refusal[0] and "--no-memory-check" in refusal[0]
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    assert main([*argv, "--no-memory-check"]) == 2  # the check is skipped: the next check speaks
    err2 = capsys.readouterr().err
    assert "will not fit" not in err2 and "already holds a run" in err2


def _bench():
    return load_script("bench_memory")


def test_bench_memory_json(tmp_path, monkeypatch):
    bench = _bench()

    def measure(case, steps, workdir):  # the processes are the slow part: a stand-in with known peaks
        # one step, 4 MoE layers whose tokens all go to experts 0 and 1: ep rank 0's
        return {"status": "ok", "rss_bytes": [1.0e9, 1.1e9, 1.0e9, 1.0e9], "tokens_per_s": 100.0, "wall_s": 0.0,
                "expert_counts": [[[4, 4, 0, 0, 0, 0, 0, 0]] * 4]}

    monkeypatch.setattr(bench, "measure", measure)
    out = tmp_path / "m.json"
    assert bench.main(["--only", "ep4,ep4_shard_optimizer", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = {r["name"]: r for r in data["rows"]}
    ep4 = rows["ep4"]
    assert ep4["status"] == "ok" and ep4["error"] == pytest.approx((max(ep4["predicted_rank_bytes"]) - 1.1e9) / 1.1e9)
    assert ep4["rank_skew"] == [4.0, 1.0, 1.0, 1.0]  # rank 0 computes every routed row of the group
    assert ep4["predicted_rank_bytes"][0] > ep4["predicted_rank_bytes"][1] == ep4["predicted_rank_bytes_skew1"][1]
    shard = rows["ep4_shard_optimizer"]
    assert shard["predicted"]["peak_bytes"] < ep4["predicted"]["peak_bytes"]  # planned even where refused
    assert shard["status"] in ("ok", "skipped")
    if shard["status"] == "skipped":
        assert "refused by the config" in shard["reason"] and "parallel.shard" in shard["reason"]
    saved = [s for s in data["savings"] if s["setting"] == "parallel.shard=optimizer"][0]
    assert saved["predicted_model_state_ratio"] < 1.0
    assert data["meta"]["ranks"] == 4


def test_bench_memory_rounds_rotate_the_layouts_and_pair_their_throughputs(tmp_path, monkeypatch):
    bench = _bench()
    order: list[str] = []
    speed = {"dp4_shard_full_accum4": [100.0, 90.0, 80.0], "dp4_shard_full_accum4_whole": [125.0, 100.0, 120.0]}

    def measure(case, steps, workdir):
        order.append(case.name)
        tps = speed[case.name][sum(n == case.name for n in order) - 1]
        return {"status": "ok", "rss_bytes": [1.0e9] * 4, "tokens_per_s": tps, "wall_s": 0.0, "expert_counts": []}

    monkeypatch.setattr(bench, "measure", measure)
    out = tmp_path / "m.json"
    assert bench.main(["--only", "dp4_shard_full_accum4,dp4_shard_full_accum4_whole", "--rounds", "3", "--json",
                       str(out)]) == 0
    a, w = "dp4_shard_full_accum4", "dp4_shard_full_accum4_whole"
    assert order == [a, w, w, a, a, w]  # round k starts at layout k
    data = json.loads(out.read_text())
    rows = {r["name"]: r for r in data["rows"]}
    assert [r["tokens_per_s"] for r in rows[w]["rounds"]] == [125.0, 100.0, 120.0]
    saved = [s for s in data["savings"] if s["layout"] == w][0]
    assert saved["throughput_cost_rounds"] == pytest.approx([0.8, 0.9, 80 / 120])
    assert saved["throughput_cost"] == pytest.approx(0.8)  # the median of the paired ratios


def test_bench_memory_rescores_earlier_runs_with_the_plan_as_it_is(tmp_path):
    """`--rescore`: nothing runs; an earlier run's measured peaks (and routing skews) are scored by today's plan."""
    bench = _bench()
    old = {"rows": [{"name": "dp4_shard_full", "status": "ok", "rss_bytes": [1.4e9, 1.5e9, 1.4e9, 1.4e9],
                     "tokens_per_s": 10.0, "error": -0.9, "predicted_rank_bytes": [1.0] * 4},
                    {"name": "ep4", "status": "ok", "rss_bytes": [1.0e9] * 4, "tokens_per_s": 10.0,
                     "rank_skew": [2.0, 1.0, 1.0, 1.0]},
                    {"name": "dp4", "status": "failed"}]}
    src, out = tmp_path / "old.json", tmp_path / "new.json"
    src.write_text(json.dumps(old))
    assert bench.main(["--rescore", str(src), "--json", str(out)]) == 0
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"dp4_shard_full", "ep4"}  # a failed row has nothing to score
    full = rows["dp4_shard_full"]
    pred = bench.predict(bench.CASES[[c.name for c in bench.CASES].index("dp4_shard_full")], 3)["peak_bytes"]
    assert full["predicted_rank_bytes"] == [pred] * 4 and full["error"] == pytest.approx((pred - 1.5e9) / 1.5e9)
    assert full["before_error"] == -0.9 and full["source"] == str(src)
    ep4 = rows["ep4"]
    assert ep4["predicted_rank_bytes"][0] > ep4["predicted_rank_bytes"][1]  # rank 0's observed skew of 2


def test_pipeline_with_sharded_optimizer_state(capsys):
    """pp 2 x dp 2, shard optimizer: moments over the stage's 2 ranks, gradients whole (micro-batches accumulate
    them) plus one bucket, and a migration phase (the stage's moments whole, the new flats' copy of its weights)
    when layers can move."""
    cfg = load(None, [*TINY, "model.n_layers=2", "data.batch_size=8"])
    lay = MemoryLayout(ranks=4, pp=2, micro_batches=2, shard="optimizer")
    plan = plan_memory(cfg, lay, BARE)
    none = plan_memory(cfg, dataclasses.replace(lay, shard="none"), BARE)
    held = none.terms["optimizer state"] / 8  # the worst stage's parameters (the same stage in both)
    t = plan.terms
    assert plan.stage == none.stage
    assert t["optimizer state"] == 8 * held / 2 and t["parameters"] == 4 * held
    assert t["gradients"] == 4 * held + 4 * held  # whole, plus the bucket in flight (the stage is below 4M)
    assert t["migration: whole moments + new flats"] == 0  # pipeline.rebalance off, no re-pack: nothing moves
    moving = load(None, [*TINY, "model.n_layers=2", "data.batch_size=8", "parallel.pp=2",
                         "pipeline.rebalance=partition"])
    mig = plan_memory(moving, lay, BARE)
    assert mig.terms["migration: whole moments + new flats"] == 8 * held + 4 * held
    assert mig.phases["migration"] == 4 * held + 8 * held / 2 + 12 * held
    assert main(["plan", "memory", "mixtral-8x7b", "--cluster", "h100", "--ranks", "16", "--pp", "2",
                 "--shard", "optimizer", "--json"]) in (0, 1)
    out = json.loads(capsys.readouterr().out)
    assert out["layout"]["pp"] == 2 and out["layout"]["shard"] == "optimizer" and "migration" in out["phases"]


def test_full_sharding_in_a_pipeline_prices_shards_one_gathered_root_and_the_moved_layers():
    """`shard: full` with pp 2 x dp 2 (moebal/distributed/fsdp.py fully_shard_stage): each stage's parameters
    sharded over its 2 ranks (experts too: ep 1), plus the largest FSDP2 root of the stage gathered (the
    embedding or the head, here); a migration holds the moved layers whole (weights and moments)."""
    args = [*TINY, "model.n_layers=2", "data.batch_size=4", "parallel.pp=2", "pipeline.rebalance=partition"]
    lay = MemoryLayout(ranks=4, pp=2, shard="full", micro_batches=2)
    plan = plan_memory(load(None, args), lay, BARE)
    layer = 272 + 16 + 192
    stage = [layer + 2048, layer + 8 + 2048][plan.stage]
    t = plan.terms
    assert t["parameters"] == 4 * stage / 2 + 4 * 2048
    assert t["optimizer state"] == 8 * stage / 2
    assert t["gradients"] == 4 * stage / 2 + 4 * layer  # the shards + one layer's full gradients in flight
    assert t["migration: moved layers whole"] == 12 * layer and t["migration: whole moments + new flats"] == 0
    assert plan.phases["migration"] == t["parameters"] + t["optimizer state"] + 12 * layer
    off = plan_memory(load(None, args[:-1]), lay, BARE).terms  # pipeline.rebalance off (the default)
    assert off["migration: moved layers whole"] == 0
    # against the unsharded pipeline: the state halves, the gathered root is the price
    plain = plan_memory(load(None, args), dataclasses.replace(lay, shard="none"), BARE).terms
    assert plain["parameters"] == 4 * stage and plain["optimizer state"] == 8 * stage


def test_full_sharding_in_an_expert_parallel_pipeline_keeps_the_expert_shards_whole():
    """`shard: full` with pp 2 x ep 2 (StageShardedAdamW): dense parameters sharded over the stage's 2 ranks,
    each rank's expert shard (half the experts) whole beside them, its moments over "dp" (1 rank); the largest
    gathered unit is a root; a migration holds the moved dense layer and the stage's expert state whole."""
    args = [*TINY, "model.n_layers=2", "data.batch_size=4", "parallel.pp=2", "parallel.ep=2",
            "pipeline.rebalance=partition"]
    lay = MemoryLayout(ranks=4, pp=2, ep=2, shard="full", micro_batches=2)
    plan = plan_memory(load(None, args), lay, BARE)
    dense_layer, experts = 272 + 16, 192 // 2  # the router is dense; the rank's 1 of 2 experts
    dense = [dense_layer + 2048, dense_layer + 8 + 2048][plan.stage]
    t = plan.terms
    assert t["parameters"] == 4 * (dense / 2 + experts) + 4 * 2048
    assert t["optimizer state"] == 8 * (dense / 2 + experts)
    assert t["migration: moved layers whole"] == 12 * (dense_layer + experts)


def test_full_sharding_in_an_expert_parallel_pipeline_keeps_expert_weights_at_rest_with_two_ranks_per_shard():
    """pp 2 x ep 2 x dp 2 (8 ranks): dense parameters over the stage's 4 ranks, the expert weights at rest over
    "dp" (moebal/distributed/fsdp.py `ExpertsAtRest` in a stage): half of the rank's expert shard kept, plus one
    MoE layer's gathered; with a block-overlapped replicating Trans two layers gathered; pruning keeps them whole."""
    args = [*TINY, "model.n_layers=2", "data.batch_size=8", "parallel.pp=2", "parallel.ep=2"]
    lay = MemoryLayout(ranks=8, pp=2, ep=2, shard="full", micro_batches=2)
    cfg = load(None, args)
    plan = plan_memory(cfg, lay, BARE)
    dense_layer, experts = 272 + 16, 192 // 2  # one MoE layer per stage; the rank's 1 of 2 experts
    dense = [dense_layer + 2048, dense_layer + 8 + 2048][plan.stage]
    assert plan.terms["parameters"] == 4 * (dense / 4 + experts / 2 + experts) + 4 * 2048
    assert plan.terms["optimizer state"] == 8 * (dense / 4 + experts / 2)
    overlap = load(None, [*args, "scheduler.block_overlap=true"])
    two = plan_memory(overlap, dataclasses.replace(lay, policy="prophet"), BARE).terms["parameters"]
    assert two == 4 * (dense / 4 + experts / 2 + 2 * experts) + 4 * 2048
    pruning = load(None, [*args, "dynamism.scheme=pruning"])
    assert plan_memory(pruning, lay, BARE).terms["parameters"] == 4 * (dense / 4 + experts) + 4 * 2048


def test_the_replica_term_follows_the_policy_bound_and_planner_max_replicas():
    # 8 experts on ep 4: a rank owns 2 and may receive the other 6 under prophet; max_replicas caps it
    args = [*TINY, "moe.num_experts=8", "data.batch_size=4", "parallel.ep=4"]
    lay = MemoryLayout(ranks=4, ep=4, policy="prophet")

    def term(*extra: str) -> float:
        return plan_memory(load(None, [*args, *extra]), lay, BARE).terms["replicas (Pro-Prophet)"]

    per = term() / (3 * 6 + 2)  # per layer: each replica, its gradient and its stacked row, plus the owned rows
    assert per > 0
    assert term("planner.max_replicas=1") == per * (3 * 1 + 2)
    # Agg's receive buffers on the owner: each of the 3 other ranks may hold a replica of both its experts (6), or
    # of one of them under a cap of 1 (3)
    recv = plan_memory(load(None, args), lay, BARE).terms["Agg receive buffers (Pro-Prophet)"]
    assert recv == per * 6
    assert plan_memory(load(None, [*args, "planner.max_replicas=1"]), lay, BARE).terms[
        "Agg receive buffers (Pro-Prophet)"] == per * 3
    assert term("planner.max_replicas=99") == term()
    assert term("planner.max_replicas=0") == 0.0


def test_fit_caps_the_replicas_before_it_gives_up_the_placement_policy():
    # 16 experts on ep 8, one layer (no pipeline to spread them): under prophet a rank may receive the 14 experts it
    # does not own per MoE layer; on a device between the plans of 2 and 4 replicas the fix is a cap of 2, on the
    # same layout and policy (not static placement, not recomputation)
    cfg = load(None, [*TINY, "moe.num_experts=16", "moe.expert_ffn_dim=4096", "model.dim=64", "data.batch_size=8",
                      "parallel.ep=8", "planner.policy=prophet"])
    lay = layout_from_config(cfg, 8, shard="none", init="local")

    def peak(cap: int | None) -> float:
        return plan_memory(cfg, dataclasses.replace(lay, max_replicas=cap), BARE).peak_bytes

    assert peak(None) > peak(4) > peak(2) > peak(1)
    dev = dataclasses.replace(BARE, capacity_bytes=(peak(2) + peak(4)) / 2)
    plan = plan_memory(cfg, lay, dev)
    assert not plan.fits and plan.largest_term[0] == "replicas (Pro-Prophet)"
    line = refusal_line(cfg, plan)
    assert line.split("fits with ")[1].split(" (")[0] == "planner.max_replicas=2", line
    # the config's planner.max_replicas and the layout's cap are one bound: the smaller holds
    capped = load(None, [*TINY, "moe.num_experts=16", "moe.expert_ffn_dim=4096", "model.dim=64",
                         "data.batch_size=8", "parallel.ep=8", "planner.policy=prophet", "planner.max_replicas=2"])
    assert plan_memory(capped, lay, dev).terms == plan_memory(cfg, dataclasses.replace(lay, max_replicas=2), dev).terms
    assert plan_memory(capped, dataclasses.replace(lay, max_replicas=4), dev).fits
    assert "max_replicas=2" in dataclasses.replace(lay, max_replicas=2).describe()
    # the order: a larger cap costs less than a smaller one, and any cap less than static placement
    static = dataclasses.replace(lay, policy="static")
    assert (overhead(dataclasses.replace(lay, max_replicas=4), "prophet")
            < overhead(dataclasses.replace(lay, max_replicas=1), "prophet") < overhead(static, "prophet"))
    assert "max_replicas" not in static.describe()


def test_fit_gives_up_fsdp2_holds_before_it_recomputes_or_adds_a_pipeline():
    """A dense model fully sharded on 8 ranks with both FSDP2 holds (whole gradient sums over 4 micro-batches,
    weights gathered through the step): on a device that fits the layout without whole sums the fix is
    `parallel.accumulate=sharded` alone (priced 0.05: before, a pipeline or `moe` recomputation); on one that
    needs both gone, both; a hold the configuration does not ask for is never proposed."""
    from moebal.planner.memory import _changes, _holds, fix_for

    cfg = load(None, [*TINY, "data.batch_size=32", "train.grad_accum=4", "parallel.shard=full", "model.n_layers=3",
                      "parallel.accumulate=whole", "parallel.reshard=step", "model.dim=64", "model.ffn_dim=1024",
                      "moe.num_experts=0", "data.seq_len=64", "model.max_seq_len=64"])
    lay = layout_from_config(cfg, 8, shard="full", init="local")
    assert (lay.accumulate, lay.reshard) == ("whole", "step")
    peak = {(a, r): plan_memory(cfg, dataclasses.replace(lay, accumulate=a, reshard=r), BARE).peak_bytes
            for a in ("whole", "sharded") for r in ("step", "micro_batch")}
    order = [("whole", "step"), ("whole", "micro_batch"), ("sharded", "step"), ("sharded", "micro_batch")]
    assert [peak[k] for k in order] == sorted(peak.values(), reverse=True)

    def fix(low: tuple[str, str], high: tuple[str, str]) -> str:
        dev = dataclasses.replace(BARE, capacity_bytes=(peak[low] + peak[high]) / 2)
        plan = plan_memory(cfg, lay, dev)
        assert not plan.fits
        found = fix_for(cfg, plan, shards=("full",))
        assert found is not None
        return _changes(lay, found.layout)

    assert fix(("sharded", "step"), ("whole", "micro_batch")) == "parallel.accumulate=sharded"
    assert fix(("sharded", "micro_batch"), ("sharded", "step")) == (
        "parallel.accumulate=sharded parallel.reshard=micro_batch")
    # the price: a replica cap < one hold < recomputation; a hold the base does not hold costs nothing
    held = ("whole", "step", "fp32")
    dropped = dataclasses.replace(lay, accumulate="sharded")
    assert overhead(lay, "static", held)[0] + 0.05 == pytest.approx(overhead(dropped, "static", held)[0])
    assert overhead(dropped, "static", held) < overhead(dataclasses.replace(lay, recompute="attention"), "static", held)
    assert overhead(dropped, "static") == overhead(lay, "static")
    plain = dataclasses.replace(lay, accumulate="sharded", reshard="micro_batch")
    assert {(x.accumulate, x.reshard) for x in _holds(cfg, plain)} == {("sharded", "micro_batch")}
    assert len(list(_holds(cfg, lay))) == 4 and len(list(_holds(cfg, dataclasses.replace(lay, shard="optimizer")))) == 1


def test_trace_rank_memory_names_phases_and_their_peaks():
    """scripts/trace_rank_memory.py: the innermost known function on the stack names the phase; per phase the
    resident peak and malloc's figures at that sample."""
    trace = load_script("trace_rank_memory")

    def backward():
        return trace._phase(sys._getframe())

    def forward_backward():
        return trace._phase(sys._getframe()), backward()

    assert forward_backward() == ("forward", "backward")  # innermost wins
    assert trace._phase(None) == "other"
    mb = 1_000_000
    rows = [[0.0, 100 * mb, 10 * mb, 0, 1 * mb, 11 * mb, "forward"],
            [0.1, 300 * mb, 50 * mb, 80 * mb, 5 * mb, 60 * mb, "backward"],
            [0.2, 200 * mb, 40 * mb, 0, 9 * mb, 60 * mb, "backward"],
            [0.3, 150 * mb, 20 * mb, 0, 2 * mb, 60 * mb, "forward"]]
    phases = trace.by_phase({"rows": rows})
    assert phases["backward"]["peak"] == 300 and phases["backward"]["live"] == 130
    assert phases["forward"]["peak"] == 150 and phases["forward"]["heap_free"] == 2
    segs = trace.summarise({"rows": rows})
    assert [s["phase"] for s in segs] == ["forward", "backward", "forward"] and segs[1]["rss1"] == 200


def test_shard_auto_takes_the_least_sharding_that_fits():
    """`parallel.shard: auto` (`choose_shard`): none while it fits, then optimizer, then full; a value the config's
    checks refuse is skipped; where nothing fits, full (the plan check then refuses it with its line). It is the
    default; `moebal train` settles it before any rank builds a model, and a library caller's entry point
    (`settle_shard`) alike; on one rank there is nothing to shard."""
    from moebal.config import from_dict
    from moebal.errors import ConfigError
    from moebal.planner.memory import DeviceMemory, choose_shard, layout_from_config, plan_memory
    from moebal.train.memory import settle_shard

    def dev(capacity: float) -> DeviceMemory:
        return DeviceMemory(name="d", capacity_bytes=capacity, runtime_bytes=0.0, slack=0.0)

    base = {"model": {"dim": 512, "n_layers": 8, "n_heads": 4, "n_kv_heads": 4, "vocab_size": 8192},
            "moe": {"num_experts": 4}, "data": {"batch_size": 4}, "parallel": {"shard": "auto", "ep": 1}}
    cfg = from_dict(base)
    unlimited = dev(1e15)
    peak = {s: plan_memory(dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, shard=s)),
                           layout_from_config(cfg, 4, shard=s, precision="fp32"), unlimited).peak_bytes
            for s in ("none", "optimizer", "full")}
    assert peak["none"] > peak["optimizer"] > peak["full"]
    for capacity, want in ((peak["none"] * 1.01, "none"), ((peak["none"] + peak["optimizer"]) / 2, "optimizer"),
                           ((peak["optimizer"] + peak["full"]) / 2, "full"), (peak["full"] * 0.9, "full")):
        chosen, line = choose_shard(cfg, 4, dev(capacity), "fp32")
        assert chosen.parallel.shard == want, (capacity, line)
        assert line.startswith(f"parallel.shard auto: {want}")
    assert "nothing fits" in line
    # bf16 weights need a sharded state: auto never takes `none` for them (a pipeline with pruning included)
    pipe = from_dict({**base, "parallel": {"shard": "auto", "pp": 2, "param_dtype": "bf16"},
                      "train": {"precision": "bf16"}, "dynamism": {"scheme": "pruning"}})
    chosen, line = choose_shard(pipe, 4, unlimited, "bf16")
    assert chosen.parallel.shard in ("optimizer", "full") and "none" not in line
    assert from_dict({}).parallel.shard == "auto"
    named = from_dict({**base, "parallel": {"shard": "optimizer"}})
    assert settle_shard(named) is named
    assert settle_shard(cfg).parallel.shard == "none"  # one process: nothing to shard
    assert layout_from_config(cfg, 1).shard == "none"
    with pytest.raises(ConfigError, match="settle it with choose_shard"):
        layout_from_config(cfg, 4)


def test_gradient_accumulation_holds_one_micro_batch_and_is_the_fix_for_activations():
    cfg = load(None, [*TINY, "data.batch_size=8", "data.seq_len=64", "model.max_seq_len=64"])
    one = plan_memory(cfg, MemoryLayout(ranks=1), BARE)
    two = plan_memory(cfg, MemoryLayout(ranks=1, micro_batches=2), BARE)
    for term in ("activations", "logits/loss"):
        assert two.terms[term] == one.terms[term] / 2
    assert two.terms["gradients"] == one.terms["gradients"]
    assert "accum=2" in two.layout.describe()
    assert layout_from_config(load(None, [*TINY, "data.batch_size=8", "train.grad_accum=4"]), 1).micro_batches == 4
    small = DeviceMemory(name="small", capacity_bytes=(one.peak_bytes + two.peak_bytes) / 2, runtime_bytes=0.0,
                         slack=0.0)
    line = refusal_line(cfg, plan_memory(cfg, MemoryLayout(ranks=1), small))
    assert "fits with train.grad_accum=2 " in line, line
    with pytest.raises(Exception, match="3 micro-batches of 8 rows per rank: use at most 8, a divisor of it"):
        plan_memory(cfg, MemoryLayout(ranks=1, micro_batches=3), BARE)


def test_whole_gradient_sums_hold_every_fsdp2_gradient_beside_the_activations():
    """`parallel.accumulate: whole` under `shard: full` with micro-batches: FSDP2's gradients whole, in
    reduce_dtype, in the forward/backward phase (a pipeline stage: its own); nothing without micro-batches or
    without `full`."""
    cfg = load(None, [*TINY, "data.batch_size=8"])
    whole = MemoryLayout(ranks=2, ep=1, shard="full", micro_batches=4, accumulate="whole")
    sharded = dataclasses.replace(whole, accumulate="sharded")
    held = 272 + 16 + 192 + 2 * 2048 + 8  # test_terms_by_hand_one_rank's
    dense, experts = held - 192, 192
    a, b = plan_memory(cfg, whole, BARE), plan_memory(cfg, sharded, BARE)
    term = "whole gradient sums (FSDP2)"
    assert a.terms[term] == 4 * (dense + experts) and b.terms[term] == 0  # ep 1: FSDP2 holds the experts too
    assert a.phases["forward/backward"] - b.phases["forward/backward"] == a.terms[term]
    assert a.phases["gradient sync"] == b.phases["gradient sync"]
    assert "whole-sums" in whole.describe() and "whole-sums" not in sharded.describe()
    ep = plan_memory(cfg, dataclasses.replace(whole, ep=2), BARE).terms[term]
    assert ep == 4 * dense  # the expert-parallel experts are not FSDP2's
    low = plan_memory(load(None, [*TINY, "data.batch_size=8", "parallel.reduce_dtype=bf16"]), whole, BARE)
    assert low.terms[term] == 2 * (dense + experts)
    for other in (dataclasses.replace(whole, micro_batches=1), dataclasses.replace(whole, shard="optimizer")):
        assert plan_memory(cfg, other, BARE).terms[term] == 0
    two = load(None, [*TINY, "data.batch_size=8", "model.n_layers=2"])  # a pipeline: each stage's own units
    staged = plan_memory(two, MemoryLayout(ranks=4, pp=2, shard="full", micro_batches=4, accumulate="whole"), BARE)
    one_stage = plan_memory(two, MemoryLayout(ranks=2, shard="full", micro_batches=4, accumulate="whole"), BARE)
    assert 0 < staged.terms[term] < one_stage.terms[term]
    assert layout_from_config(load(None, [*TINY, "data.batch_size=8", "train.grad_accum=4",
                                          "parallel.accumulate=whole", "parallel.shard=full"]), 2).accumulate == "whole"


def test_weights_gathered_per_step_hold_every_fsdp2_unit_whole():
    """`parallel.reshard: step` under `shard: full`: every unit's weights gathered at once (compute dtype) where the
    default holds the root and two layers (a pipeline stage: one unit); nothing changes elsewhere."""
    cfg = load(None, [*TINY, "data.batch_size=8", "model.n_layers=3"])
    layer = 272 + 16 + 192  # ep 1: FSDP2 holds a layer's experts too
    each = plan_memory(cfg, MemoryLayout(ranks=2, shard="full"), BARE).terms
    step = plan_memory(cfg, MemoryLayout(ranks=2, shard="full", reshard="step"), BARE).terms
    assert step["parameters"] - each["parameters"] == 4 * (3 * layer - 2 * layer)
    assert {k: v for k, v in step.items() if k != "parameters"} == {k: v for k, v in each.items() if k != "parameters"}
    assert "gathered-per-step" in MemoryLayout(ranks=2, shard="full", reshard="step").describe()
    staged = {r: plan_memory(cfg, MemoryLayout(ranks=4, pp=2, shard="full", micro_batches=2, reshard=r), BARE)
              for r in ("micro_batch", "step")}
    assert staged["step"].terms["parameters"] > staged["micro_batch"].terms["parameters"]
    opt = {r: plan_memory(cfg, MemoryLayout(ranks=2, shard="optimizer", reshard=r), BARE).terms for r in
           ("micro_batch", "step")}
    assert opt["step"] == opt["micro_batch"]


def test_a_proposed_change_between_accumulation_and_a_pipeline_names_both_settings():
    from moebal.planner.memory import _changes

    accum, pipe = MemoryLayout(ranks=4, micro_batches=2), MemoryLayout(ranks=4, pp=2, micro_batches=4)
    assert _changes(accum, pipe) == "parallel.pp=2 pipeline.micro_batches=4 train.grad_accum=1"
    assert _changes(pipe, accum) == "parallel.pp=1 train.grad_accum=2"
    assert _changes(MemoryLayout(ranks=4), accum) == "train.grad_accum=2"
    assert _changes(pipe, dataclasses.replace(pipe, micro_batches=8)) == "pipeline.micro_batches=8"


def test_the_fit_search_proposes_what_the_config_takes():
    """`built` layouts are those moebal/config.py accepts: a pipeline's sharded optimizer is taken with every
    scheme (pruning with bf16 weights included), full sharding with any scheme, one stage without layer
    rebalancing."""
    from moebal.planner.memory import MemoryLayout, _refused

    dense = ["moe.num_experts=0", "data.batch_size=8"]
    for scheme, shard, refused in (("early_exit", "optimizer", False), ("freezing", "optimizer", False),
                                   ("pruning", "full", False), ("sparse_attention", "full", False)):
        cfg = load(overrides=[*dense, f"dynamism.scheme={scheme}"])
        for pp in (1, 2):  # a scheme at pp 1 is a one-stage pipeline, refused alike
            lay = MemoryLayout(ranks=4, pp=pp, shard=shard, micro_batches=2)
            assert _refused(cfg, lay) is refused, (scheme, shard, pp)
    pruned = load(overrides=[*dense, "dynamism.scheme=pruning", "train.precision=bf16", "parallel.param_dtype=bf16"])
    assert not _refused(pruned, MemoryLayout(ranks=4, pp=2, shard="optimizer", micro_batches=2))
    assert not _refused(pruned, MemoryLayout(ranks=4, pp=2, shard="full", micro_batches=2))
    rebalanced = load(overrides=[*dense, "parallel.pp=2", "pipeline.rebalance=partition"])
    assert _refused(rebalanced, MemoryLayout(ranks=4, pp=1)) and not _refused(rebalanced, MemoryLayout(ranks=4, pp=2))
    accum = load(overrides=[*dense, "train.grad_accum=2"])  # a pipeline proposed for it sets grad_accum back to 1
    assert not _refused(accum, MemoryLayout(ranks=4, pp=2, micro_batches=4))


def test_a_one_stage_pipeline_describes_its_micro_batches_as_a_pipeline_s():
    """A dynamism scheme at parallel.pp 1 trains on the pipeline engine: its layout says M= and the schedule, not
    accum=, whoever built the layout (the plan takes the scheme from the config)."""
    cfg = load(None, ["dynamism.scheme=freezing", "pipeline.micro_batches=2", "data.batch_size=4"])
    lay = layout_from_config(cfg, 1)
    assert lay.pipelined and "M=2 1f1b" in lay.describe() and "accum" not in lay.describe()
    by_hand = plan_memory(cfg, MemoryLayout(ranks=1, micro_batches=2), DeviceMemory.cpu(24e9, 1))
    assert by_hand.layout.pipelined and "M=2" in by_hand.layout.describe()
    plain = load(None, ["train.grad_accum=2", "data.batch_size=4"])
    assert "accum=2" in layout_from_config(plain, 1).describe()


def test_a_one_stage_pipeline_is_planned_as_the_pipeline_engine_runs_it():
    """A scheme's one stage trains on the pipeline engine: a layer's gradient bucket at a time instead of the
    expert-parallel trainer's persistent flat buffer (measured: docs/memory.md, `ep4_one_stage_moe`), and under
    GPipe every micro-batch's activations in flight."""
    over = ["moe.num_experts=4", "data.batch_size=8", "pipeline.micro_batches=4", "train.precision=fp32"]
    staged = load(None, [*over, "dynamism.scheme=moe"])
    accum = load(None, [*over, "train.grad_accum=4"])
    dev = DeviceMemory.cpu(24e9, 2)
    one = plan_memory(staged, layout_from_config(staged, 2, shard="none", ep=2), dev)
    acc = plan_memory(accum, layout_from_config(accum, 2, shard="none", ep=2), dev)
    assert acc.terms["persistent gradient buffers"] > 0 and one.terms["persistent gradient buffers"] == 0
    assert 0 < one.terms["gradient all-reduce copy"] < acc.terms["persistent gradient buffers"]
    assert one.terms["activations"] == acc.terms["activations"]  # 1F1B at one stage: one micro-batch in flight
    gpipe = dataclasses.replace(staged, pipeline=dataclasses.replace(staged.pipeline, schedule="gpipe"))
    g = plan_memory(gpipe, layout_from_config(gpipe, 2, shard="none", ep=2), dev)
    assert g.terms["activations"] > 3 * one.terms["activations"]


def test_later_micro_batches_add_the_first_backward_s_gradients_to_the_activations_in_flight():
    """With micro-batches the first backward pass's gradients stay beside the next micro-batches' activations
    (measured under shard full with 2 accumulated micro-batches: 13.24 MB against 11.64 planned without it):
    accumulation one micro-batch's; 1F1B the steady state's in flight when micro-batches outnumber them, else one
    fewer; GPipe one fewer. fp32 and whole under none, a rank's shards under full."""
    cfg = load(None, [*TINY, "model.n_layers=4", "data.batch_size=8"])

    def plan(**kw):
        return plan_memory(cfg, MemoryLayout(**kw), BARE)

    one = plan(ranks=1)
    assert one.terms["accumulated gradients"] == 0 and one.phases["later micro-batches"] < one.phases[
        "forward/backward"]
    acc = plan(ranks=1, micro_batches=2)
    held = one.terms["parameters"] / 4
    assert acc.terms["accumulated gradients"] == 4 * held
    assert acc.terms["activations beside gradients"] == acc.terms["activations"]  # one micro-batch at a time
    assert acc.phases["later micro-batches"] == acc.phases["forward/backward"] + 4 * held

    # (micro-batches, schedule, stage): whether the steady state keeps them all in flight beside the gradients
    for M, schedule, s, same in ((4, "1f1b", 0, True), (2, "1f1b", 0, False), (2, "1f1b", 1, True),
                                 (4, "zb", 0, True), (4, "gpipe", 0, False)):
        st = _stage_terms_of(cfg, MemoryLayout(ranks=2, pp=2, micro_batches=M, schedule=schedule), s)
        assert (st["activations beside gradients"] == st["activations"]) is same, (M, schedule, s)
        assert st["activations beside gradients"] <= st["activations"] and st["accumulated gradients"] > 0
    full = plan(ranks=2, shard="full", micro_batches=2)
    assert full.terms["accumulated gradients"] == 4 * held / 2  # the rank's reduce-scattered shards
    # expert parallelism's persistent GradSync buffers take the last pass's sums only: the earlier passes' .grad
    # are beside them (measured on 2 ranks: 19.5 % over a plan without them)
    ep = plan(ranks=2, ep=2, micro_batches=2)
    assert ep.terms["persistent gradient buffers"] > 0
    assert ep.terms["accumulated gradients"] == ep.terms["persistent gradient buffers"]


def _stage_terms_of(cfg, lay, s):
    from moebal.planner.memory import _layers, _stage_layers, _stage_terms

    specs = _layers(cfg)
    layers = _stage_layers(cfg.model.n_layers, lay.pp)[s]
    return _stage_terms(cfg, specs, lay, s, layers, False)[0]


def test_full_sharding_in_fp32_gathers_under_bf16_autocast_keeps_its_weight_casts():
    """`shard: full` with bf16 autocast and the default fp32 `param_dtype`: FSDP2 gathers fp32 weights and autocast
    keeps a bf16 cast of each matmul weight to the backward pass, as without sharding; with bf16 gathers, none."""
    cfg = load(None, [*TINY, "model.n_layers=2"])
    none = plan_memory(cfg, MemoryLayout(ranks=2, precision="bf16"), BARE).terms
    fp32 = plan_memory(cfg, MemoryLayout(ranks=2, shard="full", precision="bf16"), BARE).terms
    bf16 = plan_memory(cfg, MemoryLayout(ranks=2, shard="full", precision="bf16", param_dtype="bf16"), BARE).terms
    assert fp32["compute-dtype weight copies"] == none["compute-dtype weight copies"] > 0
    assert bf16["compute-dtype weight copies"] == 0
    assert fp32["parameters"] > bf16["parameters"]  # its gathered units at 4 bytes
