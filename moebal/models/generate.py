"""Autoregressive generation from a causal LM: a KV-cached decoder and the sampling rules (`moebal generate`).

The KV-cached decoder runs the model's own modules (embedding, each layer's norms, attention projections and FFN
or MoE block, final norm, head) over the new positions only, attending over the keys and values the earlier
positions left in the cache (`KVCache`); it computes the same function as the model's forward over the whole
sequence, so its logits match the full forward's to rounding (tests/unit/test_generate.py). A model served
through early exit (`Dynamism.serve`) decodes with its exits: a token that leaves after a layer keeps its state
and gives later layers only its keys and values, as the scheme's forward computes it (CALM's state propagation),
and its compute stops there. A model served through Mixture-of-Depths or sparse attention has no cached form (a
token's path depends on later tokens in the training forward): its forward over the whole prefix runs once per
new token (`cache=False`), as `moebal eval` runs it.

MoE layers route every token (dropless) while generating: a capacity factor is a training-time limit on the
tokens of one batch, and one decoded token per forward would make it a different limit from the prompt's.

Sampling (`Sampling`): greedy at temperature 0; otherwise the logits divided by the temperature, then the top-k
filter, then the top-p (nucleus) filter (the smallest set of most likely tokens whose probability reaches p,
the most likely token always kept), then one draw from a seeded generator, so a seed gives the same text.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from moebal.models.mla import MLAttention
    from moebal.models.transformer import Attention, DecoderLayer, MoebalForCausalLM

__all__ = ["ExitRule", "Generation", "KVCache", "Sampling", "cached_form", "cached_forward", "dropless",
           "filter_logits", "generate", "next_tokens", "query_mask"]


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen from the logits (module docstring)."""

    temperature: float = 0.0
    """0: greedy (the most likely token); > 0: sample from softmax(logits / temperature)."""
    top_k: int = 0
    """Sample among the k most likely tokens only (0: all)."""
    top_p: float = 1.0
    """Sample among the smallest set of most likely tokens whose probability reaches p (1: all)."""
    seed: int = 0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0 (0: greedy); got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: no top-k filter); got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1: no nucleus filter); got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class KVCache:
    """Per decoder layer, the keys and values of every position decoded so far, in buffers of `capacity` positions
    ([B, heads, capacity, head_dim], allocated at a layer's first keys): a new position is written in place, not
    appended by a copy of the whole cache."""

    capacity: int
    keys: list[torch.Tensor | None]
    values: list[torch.Tensor | None]
    length: int = 0
    """Positions held (the next new position's index)."""

    @classmethod
    def empty(cls, n_layers: int, capacity: int) -> KVCache:
        return cls(capacity, [None] * n_layers, [None] * n_layers)

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new positions' keys and values of `layer` after the `length` held; every position's, old and
        new (views of the buffers)."""
        end = self.length + k.shape[2]
        if end > self.capacity:
            raise ValueError(f"the KV cache holds {self.capacity} positions; {end} asked for")
        buf_k, buf_v = self.keys[layer], self.values[layer]
        if buf_k is None or buf_v is None:
            buf_k = k.new_empty(*k.shape[:2], self.capacity, k.shape[3])
            buf_v = v.new_empty(*v.shape[:2], self.capacity, v.shape[3])
            self.keys[layer], self.values[layer] = buf_k, buf_v
        buf_k[:, :, self.length:end] = k
        buf_v[:, :, self.length:end] = v
        return buf_k[:, :, :end], buf_v[:, :, :end]


def query_mask(start: int, new: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """bool [new, start + new]: True where the query at position start + i may attend key j (j <= start + i, and
    within the sliding window: start + i - j < window). None where plain causal attention is the same (no earlier
    positions, no window cutting in): the model's own fast path."""
    if start == 0 and (window is None or window >= new):
        return None
    q_T = torch.arange(start, start + new, device=device)[:, None]
    k_S = torch.arange(start + new, device=device)[None, :]
    mask_TS = k_S <= q_T
    if window is not None:
        mask_TS &= q_T - k_S < window
    return mask_TS


@dataclass(frozen=True)
class ExitRule:
    """Early exit as a served run computes it (moebal/dynamism/early_exit.py): after each of layers first ..
    last - 1 a token whose hidden state's cosine similarity across the layer exceeds `threshold` leaves; later
    layers compute only its keys and values (from its frozen state, context for the tokens that go on)."""

    first: int
    last: int
    threshold: float


def cached_form(model: MoebalForCausalLM) -> ExitRule | None:
    """How the KV-cached decoder runs `model`: None for the plain model, the exit rule of a model served through
    early exit; a model served through another scheme has no cached form (ValueError)."""
    from moebal.dynamism.early_exit import EarlyExit
    from moebal.dynamism.scheme import served_scheme

    scheme = served_scheme(model.model)
    if scheme is None:
        return None
    if isinstance(scheme, EarlyExit):
        return ExitRule(scheme.first_layer, scheme.L - 1, scheme.tau())
    raise ValueError(f"this model is served through dynamism scheme {scheme.name} (Dynamism.serve), which has no "
                     f"KV-cached form: generate with cache=False")


def _cached_layer(layer: DecoderLayer, h_BTD: torch.Tensor, cos_TK: torch.Tensor, sin_TK: torch.Tensor,
                  cache: KVCache, active_BT: torch.Tensor | None) -> torch.Tensor:
    """The layer over the new positions; with `active_BT` (early exit) the positions that left keep their state
    and give only their keys and values."""
    attn = cast("Attention | MLAttention", layer.self_attn)
    q, k, v = attn.qkv(layer.input_layernorm(h_BTD), cos_TK, sin_TK)
    k, v = cache.extend(layer.index, k, v)
    if active_BT is not None and not bool(active_BT.any()):  # (a host read per layer, as the scheme's own forward)
        return h_BTD
    window = getattr(attn, "sliding_window", None)
    a_BTD: torch.Tensor = attn.attend(q, k, v, query_mask(cache.length, h_BTD.shape[1], window, h_BTD.device))
    out_BTD = layer._ffn_part(h_BTD + a_BTD)
    return out_BTD if active_BT is None else torch.where(active_BT.unsqueeze(-1), out_BTD, h_BTD)


@torch.no_grad()
def cached_forward(model: MoebalForCausalLM, ids_BT: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits [B, T, V] of the T new positions `ids_BT`, which follow the `cache.length` positions the cache
    holds; the cache then holds them too. A model served through early exit decodes with its exits
    (`cached_form`)."""
    rule = cached_form(model)
    body = model.model
    start, T = cache.length, ids_BT.shape[1]
    h_BTD = body.embed_tokens(ids_BT)
    cos_TK, sin_TK = body.rotary(start + T, h_BTD.dtype)
    cos_TK, sin_TK = cos_TK[start:], sin_TK[start:]
    active_BT = torch.ones(ids_BT.shape, dtype=torch.bool, device=ids_BT.device) if rule is not None else None
    for i, layer in enumerate(body.layers):
        out_BTD = _cached_layer(cast("DecoderLayer", layer), h_BTD, cos_TK, sin_TK, cache, active_BT)
        if rule is not None and active_BT is not None and rule.first <= i < rule.last and rule.threshold < 1.0:
            conf_BT = F.cosine_similarity(out_BTD.float(), h_BTD.float(), dim=-1)
            active_BT = active_BT & ~(conf_BT > rule.threshold)
        h_BTD = out_BTD
    cache.length += T
    logits_BTV: torch.Tensor = model.lm_head(body.norm(h_BTD))
    return logits_BTV


def filter_logits(logits_BV: torch.Tensor, s: Sampling) -> torch.Tensor:
    """fp32 logits / temperature with the tokens outside top-k and top-p at -inf (sampling only)."""
    x = logits_BV.float() / s.temperature
    if 0 < s.top_k < x.shape[-1]:
        kth_B1 = torch.topk(x, s.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth_B1, -math.inf)
    if s.top_p < 1:
        sorted_BV, order_BV = torch.sort(x, dim=-1, descending=True)
        mass_BV = sorted_BV.softmax(-1).cumsum(-1)
        drop_BV = mass_BV - sorted_BV.softmax(-1) >= s.top_p  # the mass before a token already reaches p
        x = x.masked_fill(torch.zeros_like(drop_BV).scatter(-1, order_BV, drop_BV), -math.inf)
    return x


def next_tokens(logits_BV: torch.Tensor, s: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """int64 [B]: each row's next token under `s` (`generator`: the draw's, on the logits' device)."""
    if s.greedy:
        return logits_BV.argmax(-1)
    probs_BV = filter_logits(logits_BV, s).softmax(-1)
    return torch.multinomial(probs_BV, 1, generator=generator).squeeze(-1)


@contextmanager
def dropless(model: MoebalForCausalLM) -> Iterator[None]:
    """Every MoE layer of `model` routes every token while inside (module docstring); restored after."""
    saved = [(layer, layer.spec) for layer in model.moe_layers()]
    try:
        for layer, spec in saved:
            layer.spec = dataclasses.replace(spec, capacity_factor=None)
        yield
    finally:
        for layer, spec in saved:
            layer.spec = spec


@dataclass
class Generation:
    """One prompt's generation."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    """The new tokens, a stop token included."""
    stop: str = "length"
    """'length' (max_new_tokens reached) or 'stop_token'."""
    prefill_s: float = 0.0
    """Seconds to the first new token (the prompt's forward)."""
    decode_s: float = 0.0
    """Seconds of the forwards after the first new token."""

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput: new tokens after the first per second."""
        return (len(self.tokens) - 1) / self.decode_s if len(self.tokens) > 1 and self.decode_s > 0 else 0.0


def generate(model: MoebalForCausalLM, prompt: Sequence[int], max_new_tokens: int, sampling: Sampling = Sampling(),
             *, cache: bool = True, stop_ids: Sequence[int] = ()) -> Generation:
    """Up to `max_new_tokens` tokens after `prompt` (token ids), ending early at a token of `stop_ids`.

    `cache`: the KV-cached decoder (module docstring); False runs the model's whole forward over the prefix for
    every new token (a model served through a dynamism scheme, or a reference). The model is put in eval mode."""
    if not prompt:
        raise ValueError("the prompt has no tokens: give at least one")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1; got {max_new_tokens}")
    limit = model.model.rotary.cos_TK.shape[0]
    if len(prompt) + max_new_tokens > limit:
        raise ValueError(f"the prompt's {len(prompt)} tokens and {max_new_tokens} new ones exceed the model's "
                         f"max_seq_len ({limit}): shorten the prompt or lower max_new_tokens")
    if cache:
        cached_form(model)  # refuses a served model without a cached form before anything runs
    model.eval()
    device = model.lm_head.weight.device
    gen = torch.Generator(device=device).manual_seed(sampling.seed) if not sampling.greedy else None
    out = Generation(prompt=list(prompt))
    ids_1T = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    kv = KVCache.empty(len(model.model.layers), len(prompt) + max_new_tokens)
    stops = set(stop_ids)
    with torch.no_grad(), dropless(model):
        t0 = time.perf_counter()
        step_ids = ids_1T
        while True:
            logits_1V = (cached_forward(model, step_ids, kv) if cache else model(ids_1T).logits)[:, -1]
            tok = int(next_tokens(logits_1V, sampling, gen).item())  # the host decides whether to stop
            if not out.tokens:
                out.prefill_s = time.perf_counter() - t0
                t0 = time.perf_counter()
            out.tokens.append(tok)
            if tok in stops:
                out.stop = "stop_token"
                break
            if len(out.tokens) == max_new_tokens:
                break
            step_ids = torch.tensor([[tok]], dtype=torch.long, device=device)
            ids_1T = torch.cat([ids_1T, step_ids], dim=1)
        out.decode_s = time.perf_counter() - t0
    return out
