"""Multi-head latent attention (MLA; DeepSeek-V2 section 2.1, used unchanged by DeepSeek-V3) and YaRN rotary tables.

Single-device code. Queries come from a low-rank latent (or one projection when `q_lora_rank` is null, as in
DeepSeek-V2-Lite); keys and values are expanded per head from one shared latent of `kv_lora_rank`, and the
rotary part of the key (`qk_rope_head_dim` wide) is one vector shared by every head ("decoupled RoPE", V2
eq. 14-19). Parameter names follow transformers' DeepseekV3Attention, so checkpoints map one to one:
`q_proj` or `q_a_proj`/`q_a_layernorm`/`q_b_proj`, `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`.
`forward` computes attention on the expanded keys and values (the training form). The KV-cached decoder
(moebal/models/generate.py) uses the absorbed form (`latent_qkv`, `attend_latent`; DeepSeek-V2 section 2.1.2's
"absorb W^UK into W^Q and W^UV into W^O"): the normed latent and the rotary key, C + R numbers per position
and layer, are cached instead of H * (N + R + V), and attention runs in the latent space:
  q . k_nope = q_nope^T W_UK c = (W_UK^T q_nope) . c,   sum_s p_s v_s = W_UV (sum_s p_s c_s),
with W_UK and W_UV each head's rows of `kv_b_proj` (no bias). The same function, summed in another order: the
two forms agree to rounding (tests/unit/test_generate.py).

Shape legend: B batch, T sequence, D model dim, H heads, Q q_lora_rank, C kv_lora_rank, N qk_nope_head_dim,
R qk_rope_head_dim, V v_head_dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from moebal.config import MLAConfig, RopeScalingConfig
from moebal.models.transformer import RMSNorm, Rotary, apply_rotary

__all__ = ["MLAttention", "ScaledRotary", "mla_softmax_scale", "rotate_interleaved", "yarn_frequencies",
           "yarn_mscale"]

# transformers builds q_a_layernorm and kv_a_layernorm with DeepseekV3RMSNorm's default eps, not rms_norm_eps
LATENT_NORM_EPS = 1e-6


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 * mscale * ln(s) + 1 (1 for s <= 1), as DeepSeek and transformers."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_frequencies(dim: int, theta: float, r: RopeScalingConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim / 2] fp32, factor on cos and sin): YaRN's "NTK-by-parts" frequencies (Peng et al. 2023,
    section 3.2), in the order of operations of transformers' `_compute_yarn_parameters`, so tables match."""
    attention_factor = r.attention_factor
    if attention_factor is None:
        if r.mscale and r.mscale_all_dim:
            attention_factor = yarn_mscale(r.factor, r.mscale) / yarn_mscale(r.factor, r.mscale_all_dim)
        else:
            attention_factor = yarn_mscale(r.factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(r.original_max_seq_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(r.beta_fast), correction_dim(r.beta_slow)
    if r.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (r.factor * pos_freqs)
    keep = 1 - ramp  # share of each frequency kept as pretrained (high frequencies) rather than interpolated
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def mla_softmax_scale(qk_head_dim: int, r: RopeScalingConfig | None) -> float:
    """1 / sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 under YaRN (DeepSeek's softmax scale,
    transformers' `yarn_apply_mscale`)."""
    scale: float = qk_head_dim ** -0.5  # int ** float is typed Any (a negative base gives a complex)
    if r is not None and r.mscale_all_dim:
        m = yarn_mscale(r.factor, r.mscale_all_dim)
        scale = scale * m * m
    return scale


class ScaledRotary(Rotary):
    """Rotary tables of width `dim` (rotate-half layout, fp32 angles), YaRN-scaled when `scaling` is given;
    the attention factor multiplies cos and sin as in transformers."""

    def __init__(self, dim: int, max_seq_len: int, theta: float, scaling: RopeScalingConfig | None) -> None:
        nn.Module.__init__(self)
        if scaling is None:
            inv_freq, factor = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)), 1.0
        else:
            inv_freq, factor = yarn_frequencies(dim, theta, scaling)
        t = torch.arange(max_seq_len, dtype=torch.float32)
        freqs_TR = torch.cat([torch.outer(t, inv_freq)] * 2, dim=-1)
        self.register_buffer("cos_TK", freqs_TR.cos() * factor, persistent=False)
        self.register_buffer("sin_TK", freqs_TR.sin() * factor, persistent=False)


def rotate_interleaved(x_BHTR: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek's layout), written out de-interleaved
    (rotated evens, then rotated odds) as transformers' `apply_rotary_pos_emb_interleave`. Queries and keys get
    the same permutation, so their dot products are those of the interleaved result."""
    half = x_BHTR.shape[-1] // 2
    cos, sin = cos_TR[..., :half], sin_TR[..., :half]  # tables are cat(freqs, freqs)
    x1, x2 = x_BHTR[..., 0::2], x_BHTR[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class MLAttention(nn.Module):
    """Causal multi-head latent attention through `scaled_dot_product_attention`; forward(x, cos, sin) as the
    grouped-query `Attention`, with tables `qk_rope_head_dim` wide."""

    def __init__(self, dim: int, n_heads: int, mla: MLAConfig, softmax_scale: float, bias: bool = False) -> None:
        super().__init__()
        H, Q, C = n_heads, mla.q_lora_rank, mla.kv_lora_rank
        N, R, V = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.n_heads, self.nope, self.rope, self.v_dim, self.kv_rank = H, N, R, V, C
        self.softmax_scale, self.interleave = softmax_scale, mla.rope_interleave
        if Q is None:
            self.q_proj = nn.Linear(dim, H * (N + R), bias=False)
        else:
            self.q_a_proj = nn.Linear(dim, Q, bias=bias)
            self.q_a_layernorm = RMSNorm(Q, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(Q, H * (N + R), bias=False)
        self.q_lora = Q is not None
        self.kv_a_proj_with_mqa = nn.Linear(dim, C + R, bias=bias)
        self.kv_a_layernorm = RMSNorm(C, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(C, H * (N + V), bias=False)
        self.o_proj = nn.Linear(H * V, dim, bias=bias)

    def _rotate(self, x: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor) -> torch.Tensor:
        return rotate_interleaved(x, cos_TR, sin_TR) if self.interleave else apply_rotary(x, cos_TR, sin_TR)

    def forward(self, x_BTD: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor) -> torch.Tensor:
        return self.attend(*self.qkv(x_BTD, cos_TR, sin_TR), None)

    def qkv(self, x_BTD: torch.Tensor, cos_TR: torch.Tensor,
            sin_TR: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries and keys [B, H, T, N + R] (the rotary key shared by every head), values [B, H, T, V]; as the
        grouped-query `Attention.qkv` (the training form; `latent_qkv` is the cached decoder's)."""
        B, T, _ = x_BTD.shape
        H, N, R, V = self.n_heads, self.nope, self.rope, self.v_dim
        q_nope_BHTN, q_rot_BHTR, c_BTC, k_rot_B1TR = self._projections(x_BTD, cos_TR, sin_TR)
        kv_BHTX = self.kv_b_proj(c_BTC).view(B, T, H, N + V).transpose(1, 2)
        k_nope_BHTN, v_BHTV = kv_BHTX.split([N, V], dim=-1)
        q_BHTK = torch.cat([q_nope_BHTN, q_rot_BHTR], dim=-1)
        k_BHTK = torch.cat([k_nope_BHTN, k_rot_B1TR.expand(B, H, T, R)], dim=-1)  # one rotary key for every head
        return q_BHTK, k_BHTK, v_BHTV

    def _projections(self, x_BTD: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q_nope [B, H, T, N], rotated q_rot [B, H, T, R], the normed latent [B, T, C], the rotated rotary key
        [B, 1, T, R]): what both forms share."""
        B, T, _ = x_BTD.shape
        H, N, R = self.n_heads, self.nope, self.rope
        q_BTX = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BTD))) if self.q_lora else self.q_proj(x_BTD)
        q_nope_BHTN, q_rot_BHTR = q_BTX.view(B, T, H, N + R).transpose(1, 2).split([N, R], dim=-1)
        c_BTC, k_rot_BTR = self.kv_a_proj_with_mqa(x_BTD).split([self.kv_rank, R], dim=-1)
        return (q_nope_BHTN, self._rotate(q_rot_BHTR, cos_TR, sin_TR), self.kv_a_layernorm(c_BTC),
                self._rotate(k_rot_BTR.view(B, 1, T, R), cos_TR, sin_TR))

    def _up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, N, C], W_UV [H, V, C]): each head's rows of `kv_b_proj` (views)."""
        w_HXC = self.kv_b_proj.weight.view(self.n_heads, self.nope + self.v_dim, self.kv_rank)
        return w_HXC[:, :self.nope], w_HXC[:, self.nope:]

    def latent_qkv(self, x_BTD: torch.Tensor, cos_TR: torch.Tensor,
                   sin_TR: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The absorbed form (module docstring): queries [B, H, T, C + R] (W_UK^T q_nope, then the rotated q_rot)
        and the cached entry [B, 1, T, C + R] (the normed latent, then the rotated rotary key), one for every
        head."""
        q_nope_BHTN, q_rot_BHTR, c_BTC, k_rot_B1TR = self._projections(x_BTD, cos_TR, sin_TR)
        w_uk_HNC, _ = self._up_weights()
        q_lat_BHTC = torch.einsum("bhtn,hnc->bhtc", q_nope_BHTN, w_uk_HNC)
        return torch.cat([q_lat_BHTC, q_rot_BHTR], dim=-1), torch.cat([c_BTC.unsqueeze(1), k_rot_B1TR], dim=-1)

    def attend_latent(self, q_BHTX: torch.Tensor, kv_B1SX: torch.Tensor, mask_TS: torch.Tensor | None) -> torch.Tensor:
        """Attention of `latent_qkv`'s queries over S cached entries under `mask_TS` (bool, True: attend; None:
        causal over the T last positions), through the latent: softmax in fp32, p @ c, then W_UV and `o_proj`.
        The shared entry broadcasts over the heads in the products: no per-head copy is made."""
        B, H, T, _ = q_BHTX.shape
        S = kv_B1SX.shape[2]
        c_B1SC = kv_B1SX[..., :self.kv_rank]
        s_BHTS = torch.matmul(q_BHTX, kv_B1SX.transpose(-1, -2)).float() * self.softmax_scale
        if mask_TS is None:
            mask_TS = torch.ones(T, S, dtype=torch.bool, device=q_BHTX.device).tril(S - T)
        p_BHTS = s_BHTS.masked_fill(~mask_TS, -math.inf).softmax(dim=-1).to(q_BHTX.dtype)
        _, w_uv_HVC = self._up_weights()
        o_BHTV = torch.einsum("bhtc,hvc->bhtv", torch.matmul(p_BHTS, c_B1SC), w_uv_HVC)
        out_BTD: torch.Tensor = self.o_proj(o_BHTV.transpose(1, 2).reshape(B, T, H * self.v_dim))
        return out_BTD

    def attend(self, q_BHTK: torch.Tensor, k_BHSK: torch.Tensor, v_BHSV: torch.Tensor,
               mask_TS: torch.Tensor | None) -> torch.Tensor:
        """As `Attention.attend`: over S keys under `mask_TS`, or causal (None)."""
        B, H, T, _ = q_BHTK.shape
        o_BHTV = F.scaled_dot_product_attention(q_BHTK, k_BHSK, v_BHSV, attn_mask=mask_TS, is_causal=mask_TS is None,
                                                scale=self.softmax_scale)
        out_BTD: torch.Tensor = self.o_proj(o_BHTV.transpose(1, 2).reshape(B, T, H * self.v_dim))
        return out_BTD
