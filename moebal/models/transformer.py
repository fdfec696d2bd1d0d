"""The Mixtral-family decoder, single-device code.

Shape legend: B = batch, T = sequence, D = model dim, H = query heads, G = key/value heads,
K = head dim, V = vocabulary, F = MLP hidden width.

Parameter names and maths follow HF Mixtral (`model.embed_tokens`, `model.layers.N.self_attn.q_proj`,
`input_layernorm`, `post_attention_layernorm`, `block_sparse_moe`, `model.norm`, `lm_head`) so that HF
checkpoints map onto it one to one; dense layers use the LLaMA/Qwen-MoE names (`mlp.gate_proj/up_proj/
down_proj`). The one deliberate difference: experts are stored stacked per layer (`experts.w1` [E, F, D])
instead of one module per expert, because the grouped expert GEMM needs them contiguous; the HF adapter
splits and stacks them by logical expert id. Parallelism is never decided in here: expert- and
pipeline-parallel code wraps or slices these modules from outside.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from moebal.config import Config
from moebal.models import padding
from moebal.models.mlp import MLP
from moebal.models.recompute import recompute_call
from moebal.routing import pooled_balancing_loss

if TYPE_CHECKING:
    from moebal.models.moe import MoELayer

__all__ = ["CausalLMOutput", "DecoderLayer", "MoebalForCausalLM", "RMSNorm", "build_model", "rotary_for"]


class RMSNorm(nn.Module):
    """HF LLaMA convention: normalise in fp32, cast back to the input dtype, then scale."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        nn.init.ones_(self.weight)  # through torch.nn.init: a rank-local build replays it (models/local_init.py)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Rotary(nn.Module):
    """Rotary tables in HF's rotate-half layout, angles computed in fp32."""

    cos_TK: torch.Tensor  # buffers (registered in __init__)
    sin_TK: torch.Tensor

    def __init__(self, head_dim: int, max_seq_len: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        t = torch.arange(max_seq_len, dtype=torch.float32)
        freqs_TK = torch.cat([torch.outer(t, inv_freq)] * 2, dim=-1)
        self.register_buffer("cos_TK", freqs_TK.cos(), persistent=False)
        self.register_buffer("sin_TK", freqs_TK.sin(), persistent=False)

    def forward(self, seq_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if seq_len > self.cos_TK.shape[0]:
            raise ValueError(f"sequence of {seq_len} tokens is longer than model.max_seq_len "
                             f"({self.cos_TK.shape[0]}): raise model.max_seq_len or shorten data.seq_len")
        return self.cos_TK[:seq_len].to(dtype), self.sin_TK[:seq_len].to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x_BHTK: torch.Tensor, cos_TK: torch.Tensor, sin_TK: torch.Tensor) -> torch.Tensor:
    return x_BHTK * cos_TK + _rotate_half(x_BHTK) * sin_TK


@functools.lru_cache(maxsize=8)
def window_mask(seq_len: int, window: int, device: torch.device) -> torch.Tensor:
    """[T, T] boolean mask, True where query t may attend key s: s <= t and t - s < window (HF's sliding
    window: a token sees itself and the window - 1 tokens before it). Cached: every layer of every step asks
    for the same few masks."""
    t_T = torch.arange(seq_len, device=device)
    diff_TT = t_T[:, None] - t_T[None, :]
    return (diff_TT >= 0) & (diff_TT < window)


@functools.lru_cache(maxsize=8)
def window_bias(seq_len: int, window: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """`window_mask` as SDPA's additive form in the queries' dtype (0 where a query may attend, -inf elsewhere),
    which SDPA turns a boolean mask into on every call. Given this one cached tensor, every layer's backward saves
    the same [T, T] tensor instead of its own conversion (at 16,384 tokens 1 GiB per layer in fp32). The same
    attention, bit for bit."""
    bias_TT = torch.full((seq_len, seq_len), float("-inf"), dtype=dtype, device=device)
    return bias_TT.masked_fill_(window_mask(seq_len, window, device), 0.0)


def expand_kv_heads(q_BHTK: torch.Tensor) -> bool:
    """Whether grouped-query attention expands keys and values to every query head before SDPA instead of passing
    `enable_gqa`. On CUDA in fp32 only: flash attention needs fp16/bf16, and the memory-efficient kernel takes no
    `enable_gqa`, so SDPA falls back to its math path, which saves the [B, H, T, T] probabilities for the backward
    pass (measured on an H200, docs/gpu.md: 2.2x the planned peak at 2,048 tokens); expanded, the memory-efficient
    kernel runs in memory linear in T for the price of H/G-times larger K/V. bf16/fp16 (flash) and the CPU
    (its flash kernel takes fp32 and groups) keep `enable_gqa`."""
    return q_BHTK.is_cuda and q_BHTK.dtype == torch.float32


def grouped_sdpa(q_BHTK: torch.Tensor, k_BGTK: torch.Tensor, v_BGTK: torch.Tensor, *, is_causal: bool = False,
                 attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """`scaled_dot_product_attention` of H query heads over G key/value heads (G divides H), keys and values
    expanded first where `expand_kv_heads` says so."""
    H, G = q_BHTK.shape[1], k_BGTK.shape[1]
    gqa = G != H
    if gqa and expand_kv_heads(q_BHTK):
        k_BGTK, v_BGTK = (t.repeat_interleave(H // G, dim=1) for t in (k_BGTK, v_BGTK))
        gqa = False
    o_BHTK: torch.Tensor = F.scaled_dot_product_attention(q_BHTK, k_BGTK, v_BGTK, attn_mask=attn_mask,
                                                          is_causal=is_causal, enable_gqa=gqa)
    return o_BHTK


class Attention(nn.Module):
    """Grouped-query causal attention through `scaled_dot_product_attention`, optionally within a sliding window
    and with RMSNorm on queries and keys (`qk_norm`: "head" normalises each head, Qwen3-MoE; "full" the whole
    projection, OLMoE)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, qkv_bias: bool = False, *,
                 qk_norm: str = "none", norm_eps: float = 1e-5, sliding_window: int | None = None) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.qk_norm, self.sliding_window = qk_norm, sliding_window
        self.q_proj = nn.Linear(dim, n_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(n_heads * head_dim, dim, bias=False)
        if qk_norm == "head":
            self.q_norm, self.k_norm = RMSNorm(head_dim, norm_eps), RMSNorm(head_dim, norm_eps)
        elif qk_norm == "full":
            self.q_norm, self.k_norm = RMSNorm(n_heads * head_dim, norm_eps), RMSNorm(n_kv_heads * head_dim, norm_eps)
        elif qk_norm != "none":
            raise ValueError(f"Attention: qk_norm must be none, head or full; got {qk_norm!r}")

    def project(self, x_BTD: torch.Tensor, proj: nn.Linear, heads: int, norm: str) -> torch.Tensor:
        """Queries (`q_proj`, "q_norm") or keys (`k_proj`, "k_norm") by head, with their q/k norm: [B, heads, T,
        K], before the rotary embedding. Also `moebal.models.subset`'s, on a subset of the positions."""
        B, T, _ = x_BTD.shape
        y: torch.Tensor = proj(x_BTD)
        if self.qk_norm == "full":
            y = getattr(self, norm)(y)
        y_BTHK = y.view(B, T, heads, self.head_dim)
        if self.qk_norm == "head":
            y_BTHK = getattr(self, norm)(y_BTHK)
        return y_BTHK.transpose(1, 2)

    def forward(self, x_BTD: torch.Tensor, cos_TK: torch.Tensor, sin_TK: torch.Tensor) -> torch.Tensor:
        T = x_BTD.shape[1]
        q_BHTK, k_BGTK, v_BGTK = self.qkv(x_BTD, cos_TK, sin_TK)
        if self.sliding_window is not None and self.sliding_window < T:
            # Within the window the mask is plain causal; only longer sequences need the explicit mask (and lose
            # the is_causal fast path).
            bias_TT = window_bias(T, self.sliding_window, x_BTD.device, q_BHTK.dtype)
            return self.attend(q_BHTK, k_BGTK, v_BGTK, bias_TT)
        return self.attend(q_BHTK, k_BGTK, v_BGTK, None)

    def qkv(self, x_BTD: torch.Tensor, cos_TK: torch.Tensor,
            sin_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries [B, H, T, K], keys and values [B, G, T, K] of `x_BTD`, the rotary tables those of its positions
        (also the KV-cached decoder's, moebal/models/generate.py)."""
        B, T, _ = x_BTD.shape
        q_BHTK = self.project(x_BTD, self.q_proj, self.n_heads, "q_norm")
        k_BGTK = self.project(x_BTD, self.k_proj, self.n_kv_heads, "k_norm")
        v_BGTK = self.v_proj(x_BTD).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rotary(q_BHTK, cos_TK, sin_TK), apply_rotary(k_BGTK, cos_TK, sin_TK), v_BGTK

    def attend(self, q_BHTK: torch.Tensor, k_BGSK: torch.Tensor, v_BGSK: torch.Tensor,
               mask_TS: torch.Tensor | None) -> torch.Tensor:
        """The output projection of attention over S keys: `mask_TS` (True: may attend; or SDPA's additive form,
        `window_bias`), or None for causal attention over as many keys as queries."""
        B, _, T, _ = q_BHTK.shape
        if mask_TS is None:
            o_BHTK = grouped_sdpa(q_BHTK, k_BGSK, v_BGSK, is_causal=True)
        else:
            o_BHTK = grouped_sdpa(q_BHTK, k_BGSK, v_BGSK, attn_mask=mask_TS)
        out_BTD: torch.Tensor = self.o_proj(o_BHTK.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))
        return out_BTD


def rotary_for(cfg: Config) -> Rotary:
    """The model's rotary tables: head_dim wide, or for multi-head latent attention qk_rope_head_dim wide and
    YaRN-scaled when model.rope_scaling is set (moebal/models/mla.py)."""
    m = cfg.model
    if m.mla is None:
        return Rotary(cfg.head_dim, m.max_seq_len, m.rope_theta)
    from moebal.models.mla import ScaledRotary

    return ScaledRotary(m.mla.qk_rope_head_dim, m.max_seq_len, m.rope_theta, m.rope_scaling)


def attention_for(cfg: Config) -> nn.Module:
    """Grouped-query attention, or multi-head latent attention when model.mla is set (DeepSeek)."""
    m = cfg.model
    if m.mla is None:
        return Attention(m.dim, m.n_heads, m.n_kv_heads, cfg.head_dim, m.attention_bias, qk_norm=m.qk_norm,
                         norm_eps=m.norm_eps, sliding_window=m.sliding_window)
    from moebal.models.mla import MLAttention, mla_softmax_scale

    scale = mla_softmax_scale(m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim, m.rope_scaling)
    return MLAttention(m.dim, m.n_heads, m.mla, scale, m.attention_bias)


class DecoderLayer(nn.Module):
    """Pre-norm block: h + attn(norm(h)), then h + ffn(norm(h)); the ffn is a dense MLP or an MoE block.

    `recompute` (`train.recompute`, changed with `moebal.models.recompute.set_recompute`) chooses which part's
    activations are recomputed in the backward pass instead of kept (moebal/models/recompute.py)."""

    def __init__(self, cfg: Config, index: int) -> None:
        super().__init__()
        m = cfg.model
        self.index = index
        self.recompute: str = cfg.train.recompute
        self.input_layernorm = RMSNorm(m.dim, m.norm_eps)
        self.self_attn = attention_for(cfg)
        self.post_attention_layernorm = RMSNorm(m.dim, m.norm_eps)
        self.is_moe = cfg.is_moe_layer(index)
        if self.is_moe:
            from moebal.models.moe import MoELayer

            self.block_sparse_moe = MoELayer.from_config(cfg)
            self.block_sparse_moe.noise_index = index  # its router noise, wherever the layer lives
        else:
            self.mlp = MLP(m.dim, m.ffn_dim)

    @property
    def ffn(self) -> nn.Module:
        return self.block_sparse_moe if self.is_moe else self.mlp

    def forward(self, h_BTD: torch.Tensor, cos_TK: torch.Tensor, sin_TK: torch.Tensor) -> torch.Tensor:
        if self.recomputes("full") and self.ffn_replayable():
            return recompute_call(self._forward, self.moe_block(), h_BTD, cos_TK, sin_TK)
        return self.ffn_part(self.attention_part(h_BTD, cos_TK, sin_TK))

    # The two halves run apart when a pipeline splits the layer over two stages (`pipeline.split_layers`).
    def attention_part(self, h_BTD: torch.Tensor, cos_TK: torch.Tensor, sin_TK: torch.Tensor) -> torch.Tensor:
        if self.recomputes("attention", "full"):
            return recompute_call(self._attention_part, None, h_BTD, cos_TK, sin_TK)
        return self._attention_part(h_BTD, cos_TK, sin_TK)

    def ffn_part(self, h_BTD: torch.Tensor, plain: bool = False) -> torch.Tensor:
        """`plain`: without this part's own recomputation (called inside a recomputed region that covers it, as
        a scheme's whole-layer replay does; an MoE block's `recompute_local` still applies)."""
        if not plain and self.recomputes("moe", "full") and self.ffn_replayable():
            return recompute_call(self._ffn_part, self.moe_block(), h_BTD)
        return self._ffn_part(h_BTD)

    # ---- the plain computation (nn.Module.__call__ is typed Any: the annotated locals give the results a type)
    def _forward(self, h_BTD: torch.Tensor, cos_TK: torch.Tensor, sin_TK: torch.Tensor) -> torch.Tensor:
        return self._ffn_part(self._attention_part(h_BTD, cos_TK, sin_TK))

    def _attention_part(self, h_BTD: torch.Tensor, cos_TK: torch.Tensor, sin_TK: torch.Tensor) -> torch.Tensor:
        a_BTD: torch.Tensor = self.self_attn(self.input_layernorm(h_BTD), cos_TK, sin_TK)
        return h_BTD + a_BTD

    def _ffn_part(self, h_BTD: torch.Tensor) -> torch.Tensor:
        f_BTD: torch.Tensor = self.ffn(self.post_attention_layernorm(h_BTD))
        return h_BTD + f_BTD

    # ---- recomputation ----
    def recomputes(self, *modes: str) -> bool:
        """Whether this layer's `recompute` mode is one of `modes` and gradients are on (a region to recompute;
        also read by `moebal.models.subset.subset_block`)."""
        return self.recompute in modes and torch.is_grad_enabled()

    def moe_block(self) -> MoELayer | None:
        return self.block_sparse_moe if self.is_moe else None

    def ffn_replayable(self) -> bool:
        """Whether the FFN part may run twice: a dense MLP, or a MoE block that talks to no other rank (else it
        recomputes its rank-local compute only, `MoELayer.recompute_local`)."""
        moe = self.moe_block()
        return moe is None or moe.is_local()


class MoebalModel(nn.Module):
    """Embedding, decoder layers and final norm (HF `model.` prefix)."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        m = cfg.model
        self.embed_tokens = nn.Embedding(m.vocab_size, m.dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(m.n_layers))
        self.norm = RMSNorm(m.dim, m.norm_eps)
        self.rotary = rotary_for(cfg)

    def forward(self, ids_BT: torch.Tensor, row_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """`row_tokens`: each row's real tokens (host int64 [B]) when rows end in right padding, for a forward served
        through a dynamism scheme (`dynamism.scheme.served_forward`: Mixture-of-Depths keeps padding out of its
        routed slots); the plain stack leaves the padding out of its MoE losses only (moebal/models/padding.py:
        causal attention keeps right padding from every real position)."""
        h_BTD = self.embed_tokens(ids_BT)
        cos_TK, sin_TK = self.rotary(ids_BT.shape[1], h_BTD.dtype)
        # given: these rows (none padded: none); not given: the caller's (the trainer sets them around its call)
        T = ids_BT.shape[1]
        rows = nullcontext() if row_tokens is None else padding.rows(padding.padded(row_tokens, T), T)
        with rows:
            for layer in self.layers:
                h_BTD = layer(h_BTD, cos_TK, sin_TK)
        out_BTD: torch.Tensor = self.norm(h_BTD)
        return out_BTD


@dataclass
class CausalLMOutput:
    logits: torch.Tensor
    """[B, T, V]"""
    loss: torch.Tensor | None
    """Mean next-token cross-entropy over labels != -100 (None without labels)."""
    aux_loss: torch.Tensor
    """Sum over MoE layers of their coefficient-weighted load-balancing and z losses."""


class MoebalForCausalLM(nn.Module):
    """Decoder LM with an (optionally tied) LM head. `labels` are already shifted by the caller's data."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.config = cfg
        self.model = MoebalModel(cfg)
        self.lm_head = nn.Linear(cfg.model.dim, cfg.model.vocab_size, bias=False)
        self.reset_parameters()
        if cfg.model.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def reset_parameters(self) -> None:
        """Normal(0, init_std) everywhere; residual output projections scaled by 1/sqrt(2 * n_layers)
        (GPT-2) so the residual stream's variance does not grow with depth: attention's o_proj, a dense MLP's
        down_proj and the routed experts' w2. The MoE layer's other weights, its shared expert's down projection
        included, keep its own Normal(0, init_std) (`MoELayer.reset_parameters`; rank-local initialisation
        rebuilds exactly this)."""
        std = self.config.model.init_std
        out_std = std / math.sqrt(2 * self.config.model.n_layers)
        for name, p in self.named_parameters():
            if name.endswith(".bias") and ".block_sparse_moe." not in name:
                nn.init.zeros_(p)  # attention biases (Qwen2-MoE) start at zero
            if p.dim() < 2 or ".block_sparse_moe." in name:
                continue  # norms stay at one; the MoE layer initialises its own router and experts
            is_out = name.endswith(("o_proj.weight", "down_proj.weight"))
            nn.init.normal_(p, mean=0.0, std=out_std if is_out else std)
        for layer in self.moe_layers():
            w2 = getattr(getattr(layer, "experts", None), "w2", None)
            if isinstance(w2, torch.Tensor):
                with torch.no_grad():
                    nn.init.normal_(w2, mean=0.0, std=out_std)

    def moe_layers(self) -> Iterator[MoELayer]:
        for layer in self.model.layers:
            block = cast(DecoderLayer, layer)  # nn.ModuleList yields nn.Module
            if block.is_moe:
                yield block.block_sparse_moe

    def forward(self, ids_BT: torch.Tensor, labels_BT: torch.Tensor | None = None,
                row_tokens: torch.Tensor | None = None) -> CausalLMOutput:
        """`row_tokens`: each row's real tokens when rows end in padding (`MoebalModel.forward`). `aux_loss`: the
        MoE layers' losses summed, with `moe.aux_loss_scope: pooled` plus the one balancing loss over them all."""
        for layer in self.moe_layers():
            layer.balance_sums = None  # a layer this forward does not run adds nothing to the pooled loss
        h_BTD = self.model(ids_BT) if row_tokens is None else self.model(ids_BT, row_tokens)
        logits_BTV = self.lm_head(h_BTD)
        loss = None
        if labels_BT is not None:
            loss = F.cross_entropy(logits_BTV.float().flatten(0, 1), labels_BT.flatten(), ignore_index=-100)
        aux = logits_BTV.new_zeros((), dtype=torch.float32)
        sums: list[torch.Tensor] = []
        for layer in self.moe_layers():  # the order of sum(..., start=aux)
            aux = aux + layer.aux_loss
            if layer.balance_sums is not None:
                sums.append(layer.balance_sums)
        if sums:
            aux = aux + self.config.moe.aux_loss_coef * pooled_balancing_loss(sums)
        return CausalLMOutput(logits=logits_BTV, loss=loss, aux_loss=aux)

    def num_parameters(self, active: bool = False) -> int:
        """Parameter count; with active=True only the top_k of E experts (and shared experts) count."""
        total = sum(p.numel() for p in self.parameters())
        if not active:
            return total
        moe = self.config.moe
        expert = sum(p.numel() for layer in self.moe_layers() for p in layer.experts.parameters())
        return total - expert + expert * moe.top_k // max(moe.num_experts, 1)


def build_model(cfg: Config, device: torch.device | str | None = None, *,
                load_weights: bool = True) -> MoebalForCausalLM:
    """The causal LM for a config: with `hf.init_from` (and `load_weights`), the weights of that checkpoint
    (moebal/interop/hf.py); otherwise initialised from the caller's torch RNG state (seed it first).
    `load_weights=False` skips reading a checkpoint whose weights a resumed run overwrites anyway."""
    if cfg.hf.init_from and load_weights:
        from moebal.interop.hf import from_hf

        return from_hf(cfg.hf.init_from, cfg=cfg, device=device or "cpu")
    model = MoebalForCausalLM(cfg)
    return model.to(device) if device is not None else model
