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
the most likely token always kept), then one draw from the prompt's own generator seeded with the seed, so a seed
gives a prompt the same text whatever prompts share its batch (`generate_many`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, cast

import torch
import torch.nn.functional as F

from moebal.models import noise
from moebal.models.mla import MLAttention
from moebal.models.subset import skip_layer

if TYPE_CHECKING:
    from moebal.dynamism.mod import MixtureOfDepths
    from moebal.models.transformer import Attention, DecoderLayer, MoebalForCausalLM, MoebalModel

__all__ = ["DepthRule", "ExitRule", "Generation", "KVCache", "Lockstep", "Sampling", "cached_form", "cached_forward",
           "check_prompts", "dropless", "filter_logits", "generate", "generate_many", "next_tokens", "query_mask"]

_FP32_TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen from the logits (module docstring)."""

    temperature: float = 0.0
    """0: greedy (the most likely token); > 0: sample from softmax(logits / temperature). Below fp32's smallest
    normal number (1.2e-38) greedy too: the fp32 logits divided by it would overflow (0 / 0 at the top token)."""
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
        return self.temperature < _FP32_TINY


@dataclass
class KVCache:
    """Per decoder layer, the keys and values of every position decoded so far, in buffers of `capacity` positions
    ([B, heads, capacity, head_dim], allocated at a layer's first keys): a new position is written in place, not
    appended by a copy of the whole cache.

    A multi-head latent attention layer caches one entry per position when `latent` (the default): its normed
    latent and rotary key ([B, 1, capacity, C + R], no value buffer; `MLAttention.latent_qkv`), and attention
    runs through the latent; with `latent` False it caches the per-head keys and values of its training form."""

    capacity: int
    keys: list[torch.Tensor | None]
    values: list[torch.Tensor | None]
    length: int = 0
    """Positions held (the next new position's index)."""
    latent: bool = True
    ran: dict[int, torch.Tensor] = field(default_factory=dict)
    """Per Mixture-of-Depths routed layer, bool [B, capacity]: the positions that ran the layer, whose keys are
    the only ones its attention sees (`DepthRule`)."""

    @classmethod
    def empty(cls, n_layers: int, capacity: int, latent: bool = True) -> KVCache:
        return cls(capacity, [None] * n_layers, [None] * n_layers, latent=latent)

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Write the new positions' keys and values (None: a latent entry, keys only) of `layer` after the
        `length` held; every position's, old and new (views of the buffers)."""
        end = self.length + k.shape[2]
        if end > self.capacity:
            raise ValueError(f"the KV cache holds {self.capacity} positions; {end} asked for")
        buf_k, buf_v = self.keys[layer], self.values[layer]
        if buf_k is None:
            buf_k = self.keys[layer] = k.new_empty(*k.shape[:2], self.capacity, k.shape[3])
        buf_k[:, :, self.length:end] = k
        if v is None:
            return buf_k[:, :, :end], None
        if buf_v is None:
            buf_v = self.values[layer] = v.new_empty(*v.shape[:2], self.capacity, v.shape[3])
        buf_v[:, :, self.length:end] = v
        return buf_k[:, :, :end], buf_v[:, :, :end]

    def position_bytes(self) -> int:
        """Bytes the buffers hold per position (every layer's, summed over the batch's rows)."""
        return sum(b.numel() * b.element_size() for b in (*self.keys, *self.values) if b is not None) // self.capacity


def query_mask(start: int, new: int, window: int | None, device: torch.device,
               pad_B: torch.Tensor | None = None) -> torch.Tensor | None:
    """bool [new, start + new]: True where the query at position start + i may attend key j (j <= start + i, and
    within the sliding window: start + i - j < window). None where plain causal attention is the same (no earlier
    positions, no window cutting in, no padding): the model's own fast path.

    With `pad_B` (a batch of prompts, row b left-padded by pad_B[b] columns): [B, 1, new, start + new], the
    padding columns masked as keys; a padding query sees only itself (an output never read, kept finite)."""
    if pad_B is None and start == 0 and (window is None or window >= new):
        return None
    q_T1 = torch.arange(start, start + new, device=device)[:, None]
    k_1S = torch.arange(start + new, device=device)[None, :]
    mask_TS = k_1S <= q_T1
    if window is not None:
        mask_TS &= q_T1 - k_1S < window
    if pad_B is None:
        return mask_TS
    real_B1S = (k_1S >= pad_B[:, None])[:, None, :]
    padding_query_BT1 = (q_T1 < pad_B[:, None, None])
    mask_BTS = (mask_TS & real_B1S) | (padding_query_BT1 & (q_T1 == k_1S))
    return mask_BTS.unsqueeze(1)


@dataclass(frozen=True)
class ExitRule:
    """Early exit as a served run computes it (moebal/dynamism/early_exit.py): after each of layers first ..
    last - 1 a token whose hidden state's cosine similarity across the layer exceeds `threshold` leaves; later
    layers compute only its keys and values (from its frozen state, context for the tokens that go on)."""

    first: int
    last: int
    threshold: float


@dataclass(frozen=True)
class DepthRule:
    """Mixture-of-Depths routed by its causal predictors (moebal/dynamism/mod.py, `causal_routing`): at each layer
    of `routed` a token runs the block where its predictor's logit is positive, its output h + sigmoid(router
    score) x (layer(h) - h), its attention over the earlier tokens that ran the layer; the others pass through."""

    routed: frozenset[int]


def _mod_with_predictor(model: MoebalForCausalLM) -> MixtureOfDepths | None:
    from moebal.dynamism.mod import MixtureOfDepths
    from moebal.dynamism.scheme import served_scheme

    scheme = served_scheme(model.model)
    return scheme if isinstance(scheme, MixtureOfDepths) and scheme.predictor else None


def cached_form(model: MoebalForCausalLM) -> ExitRule | DepthRule | None:
    """How the KV-cached decoder runs `model`: None for the plain model, the exit rule of a model served through
    early exit, the routed layers of Mixture-of-Depths with causal predictors (at capacity 1 none routes); a
    model served through another scheme has no cached form (ValueError)."""
    from moebal.dynamism.early_exit import EarlyExit
    from moebal.dynamism.mod import MixtureOfDepths
    from moebal.dynamism.scheme import served_scheme

    scheme = served_scheme(model.model)
    if scheme is None:
        return None
    if isinstance(scheme, EarlyExit):
        return ExitRule(scheme.first_layer, scheme.L - 1, scheme.tau())
    if isinstance(scheme, MixtureOfDepths) and scheme.predictor:
        return DepthRule(frozenset(scheme.routed) if scheme.current_capacity() < 1.0 else frozenset())
    more = (" (a Mixture-of-Depths run trained with dynamism.mod.predictor > 0 has one)"
            if isinstance(scheme, MixtureOfDepths) else "")
    raise ValueError(f"this model is served through dynamism scheme {scheme.name} (Dynamism.serve), which has no "
                     f"KV-cached form{more}: generate with cache=False")


@contextmanager
def causal_routing(model: MoebalForCausalLM) -> Iterator[None]:
    """A model served through Mixture-of-Depths with causal predictors routes each token by its predictor while
    inside (the module docstring); no change for any other model; restored after."""
    scheme = _mod_with_predictor(model)
    if scheme is None:
        yield
        return
    saved, scheme.causal = scheme.causal, True
    try:
        yield
    finally:
        scheme.causal = saved


def _cached_layer(layer: DecoderLayer, h_BTD: torch.Tensor, cos_TK: torch.Tensor, sin_TK: torch.Tensor,
                  cache: KVCache, active_BT: torch.Tensor | None, pad_B: torch.Tensor | None,
                  masks: dict[int | None, torch.Tensor | None]) -> torch.Tensor:
    """The layer over the new positions; with `active_BT` (early exit) the positions that left keep their state
    and give only their keys and values. `masks`: the forward's attention masks by sliding window, made by the
    first layer that needs one (they depend on the cache's length, the new columns and the padding only)."""
    attn = cast("Attention | MLAttention", layer.self_attn)
    x_BTD = layer.input_layernorm(h_BTD)
    latent = attn if isinstance(attn, MLAttention) and cache.latent else None  # caches its latent (KVCache)
    v: torch.Tensor | None
    if latent is not None:
        q, k = latent.latent_qkv(x_BTD, cos_TK, sin_TK)
        k, v = cache.extend(layer.index, k, None)
    else:
        q, k, v = attn.qkv(x_BTD, cos_TK, sin_TK)
        k, v = cache.extend(layer.index, k, v)
    if active_BT is not None and not bool(active_BT.any()):  # (a host read per layer, as the scheme's own forward)
        return skip_layer(layer, h_BTD)  # an expert-parallel MoE layer still joins the other ranks' exchanges
    window = getattr(attn, "sliding_window", None)
    if window not in masks:
        masks[window] = query_mask(cache.length, h_BTD.shape[1], window, h_BTD.device, pad_B)
    mask = masks[window]
    if latent is not None:
        a_BTD = latent.attend_latent(q, k, mask)
    else:
        assert v is not None  # extend returns the values it was given
        a_BTD = attn.attend(q, k, v, mask)
    out_BTD = layer._ffn_part(h_BTD + a_BTD)
    return out_BTD if active_BT is None else torch.where(active_BT.unsqueeze(-1), out_BTD, h_BTD)


def _routed_cached_layer(layer: DecoderLayer, h_BTD: torch.Tensor, cos_TK: torch.Tensor, sin_TK: torch.Tensor,
                         cache: KVCache, pad_B: torch.Tensor | None) -> torch.Tensor:
    """A Mixture-of-Depths routed layer over the new positions (`DepthRule`): the keys and values of every new
    position are cached, and `cache.ran` marks those that ran the layer, the only keys its attention sees (the
    token-subset block's `keys="subset"`: a shorter sequence at the original positions and window). A position
    that does not run keeps its state."""
    attn = cast("Attention", layer.self_attn)
    B, T, _ = h_BTD.shape
    run_BT = layer.get_submodule("mod_predictor")(h_BTD).squeeze(-1) > 0
    score_BT = layer.get_submodule("mod_router")(h_BTD).squeeze(-1)
    q, k, v = attn.qkv(layer.input_layernorm(h_BTD), cos_TK, sin_TK)
    start = cache.length
    k, v_all = cache.extend(layer.index, k, v)
    assert v_all is not None  # extend returns the values it was given
    ran = cache.ran.get(layer.index)
    if ran is None:
        ran = cache.ran[layer.index] = torch.zeros(B, cache.capacity, dtype=torch.bool, device=h_BTD.device)
    ran[:, start:start + T] = run_BT
    if not bool(run_BT.any()):  # (a host read per routed layer, as the served forward's widths)
        return skip_layer(layer, h_BTD)  # as in `_cached_layer`
    S = start + T
    base = query_mask(start, T, getattr(attn, "sliding_window", None), h_BTD.device, pad_B)
    if base is None:
        base = torch.ones(T, S, dtype=torch.bool, device=h_BTD.device).tril(start)
    base_B1TS = base.expand(B, 1, T, S)
    # a running query sees the earlier keys that ran; one that does not run keeps its plain row (never read,
    # kept finite)
    mask_B1TS = torch.where(run_BT[:, None, :, None], base_B1TS & ran[:, None, None, :S], base_B1TS)
    out_BTD = layer._ffn_part(h_BTD + attn.attend(q, k, v_all, mask_B1TS))
    scale_BT1 = torch.sigmoid(score_BT).unsqueeze(-1).to(out_BTD.dtype)
    return torch.where(run_BT.unsqueeze(-1), h_BTD + scale_BT1 * (out_BTD - h_BTD), h_BTD)


def _rotary_at(body: MoebalModel, start: int, T: int, dtype: torch.dtype,
               pad_B: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary tables of columns start .. start + T - 1: [T, K], or [B, 1, T, K] at each row's own positions
    (column - pad_B[b]; a padding column takes position 0)."""
    cos_TK, sin_TK = body.rotary(start + T, dtype)
    if pad_B is None:
        return cos_TK[start:], sin_TK[start:]
    pos_BT = (torch.arange(start, start + T, device=pad_B.device)[None, :] - pad_B[:, None]).clamp(min=0)
    return cos_TK[pos_BT].unsqueeze(1), sin_TK[pos_BT].unsqueeze(1)


@torch.no_grad()
def cached_forward(model: MoebalForCausalLM, ids_BT: torch.Tensor, cache: KVCache,
                   pad_B: torch.Tensor | None = None) -> torch.Tensor:
    """Logits [B, T, V] of the T new columns `ids_BT`, which follow the `cache.length` columns the cache holds;
    the cache then holds them too. `pad_B`: row b's first pad_B[b] columns are left padding (prompts of
    different lengths in one batch: each row's positions start after its padding, and no row attends to
    padding). A model served through early exit decodes with its exits (`cached_form`)."""
    rule = cached_form(model)
    exits = rule if isinstance(rule, ExitRule) else None
    routed = rule.routed if isinstance(rule, DepthRule) else frozenset()
    body = model.model
    start, T = cache.length, ids_BT.shape[1]
    h_BTD = body.embed_tokens(ids_BT)
    cos_TK, sin_TK = _rotary_at(body, start, T, h_BTD.dtype, pad_B)
    active_BT = torch.ones(ids_BT.shape, dtype=torch.bool, device=ids_BT.device) if exits is not None else None
    masks: dict[int | None, torch.Tensor | None] = {}
    for i, layer in enumerate(body.layers):
        if i in routed:
            out_BTD = _routed_cached_layer(cast("DecoderLayer", layer), h_BTD, cos_TK, sin_TK, cache, pad_B)
        else:
            out_BTD = _cached_layer(cast("DecoderLayer", layer), h_BTD, cos_TK, sin_TK, cache, active_BT, pad_B,
                                    masks)
        if exits is not None and active_BT is not None and exits.first <= i < exits.last and exits.threshold < 1.0:
            conf_BT = F.cosine_similarity(out_BTD.float(), h_BTD.float(), dim=-1)
            active_BT = active_BT & ~(conf_BT > exits.threshold)
        h_BTD = out_BTD
    cache.length += T
    logits_BTV: torch.Tensor = model.lm_head(body.norm(h_BTD))
    return logits_BTV


def filter_logits(logits_BV: torch.Tensor, s: Sampling) -> torch.Tensor:
    """(fp32 logits - their row's max) / temperature with the tokens outside top-k and top-p at -inf (sampling
    only). The shift leaves the softmax as it is and keeps a tiny temperature from overflowing to inf - inf."""
    x = logits_BV.float()
    x = (x - x.amax(-1, keepdim=True)) / s.temperature
    if 0 < s.top_k < x.shape[-1]:
        kth_B1 = torch.topk(x, s.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth_B1, -math.inf)
    if s.top_p < 1:
        sorted_BV, order_BV = torch.sort(x, dim=-1, descending=True)
        p_BV = sorted_BV.softmax(-1)
        drop_BV = p_BV.cumsum(-1) - p_BV >= s.top_p  # the mass before a token already reaches p
        x = x.masked_fill(torch.zeros_like(drop_BV).scatter(-1, order_BV, drop_BV), -math.inf)
    return x


def next_tokens(logits_BV: torch.Tensor, s: Sampling,
                generators: torch.Generator | Sequence[torch.Generator] | None) -> torch.Tensor:
    """int64 [B]: each row's next token under `s`; `generators` (on the logits' device) draws: one for every row,
    or one per row (a row's draw then depends on its own logits and generator only)."""
    if s.greedy:
        return logits_BV.argmax(-1)
    probs_BV = filter_logits(logits_BV, s).softmax(-1)
    if generators is None or isinstance(generators, torch.Generator):
        return torch.multinomial(probs_BV, 1, generator=generators).squeeze(-1)
    return torch.cat([torch.multinomial(probs_BV[b:b + 1], 1, generator=g) for b, g in enumerate(generators)]
                     ).squeeze(-1)


@contextmanager
def dropless(model: MoebalForCausalLM) -> Iterator[None]:
    """Every MoE layer of `model` routes every token while inside (module docstring), and records no routing
    statistics or balancing loss (`MoELayer.records`: generation reads neither); restored after."""
    saved = [(layer, layer.spec, layer.records) for layer in model.moe_layers()]
    try:
        for layer, spec, _ in saved:
            layer.spec = dataclasses.replace(spec, capacity_factor=None)
            layer.records = False
        yield
    finally:
        for layer, spec, records in saved:
            layer.spec, layer.records = spec, records


class Lockstep(Protocol):
    """Ranks that decode together (expert parallelism: moebal/distributed/ep_generate.py): every rank runs the
    same forwards, since each MoE layer's all-to-alls need every rank, so a rank whose rows have all stopped goes
    on with them until every rank's have."""

    def before_forward(self) -> None:
        """Called before each forward."""

    def all_done(self, done_here: bool) -> bool:
        """Whether every rank's rows have stopped, given whether this rank's have (a collective)."""


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
    cache_bytes: int = 0
    """Bytes the KV cache holds per position of this prompt (every layer's; 0 without the cache)."""

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput: new tokens after the first per second."""
        return (len(self.tokens) - 1) / self.decode_s if len(self.tokens) > 1 and self.decode_s > 0 else 0.0


def check_prompts(model: MoebalForCausalLM, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                  cache: bool) -> None:
    """ValueError naming what `generate_many` cannot do with these arguments, before anything runs."""
    if not prompts or any(not p for p in prompts):
        raise ValueError("a prompt has no tokens: give at least one")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1; got {max_new_tokens}")
    limit, longest = model.model.rotary.cos_TK.shape[0], max(len(p) for p in prompts)
    if longest + max_new_tokens - 1 > limit:  # the last new token is returned, never fed back
        raise ValueError(f"the prompt's {longest} tokens and {max_new_tokens} new ones exceed the model's "
                         f"max_seq_len ({limit}): the forward runs over {longest + max_new_tokens - 1} positions "
                         f"(every token but the last new one); shorten the prompt or lower max_new_tokens "
                         f"(--max-new-tokens)")
    if cache:
        cached_form(model)  # refuses a served model without a cached form


def generate(model: MoebalForCausalLM, prompt: Sequence[int], max_new_tokens: int, sampling: Sampling = Sampling(),
             *, cache: bool = True, stop_ids: Sequence[int] = (), latent: bool = True) -> Generation:
    """Up to `max_new_tokens` tokens after `prompt` (token ids), ending early at a token of `stop_ids`
    (`generate_many` of one prompt)."""
    return generate_many(model, [prompt], max_new_tokens, sampling, cache=cache, stop_ids=stop_ids,
                         latent=latent)[0]


def generate_many(model: MoebalForCausalLM, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                  sampling: Sampling = Sampling(), *, cache: bool = True, stop_ids: Sequence[int] = (),
                  latent: bool = True, lockstep: Lockstep | None = None,
                  seeds: Sequence[int] | None = None) -> list[Generation]:
    """Each prompt's generation: up to `max_new_tokens` tokens, ending early at a token of `stop_ids`.

    `cache`: the KV-cached decoder (module docstring), every prompt in one batch, left-padded to the longest; each
    row computes what it would alone (its own positions, no attention to padding, dropless MoE), and draws from
    its own generator seeded with `sampling.seed`, so a prompt's text does not depend on the others beside it.
    Multi-head latent attention layers cache their latent (`latent`; KVCache's docstring). False: the model's
    whole forward over the prefix for every new token, one prompt after the other (a model served through a
    scheme without a cached form, or a reference). `lockstep`: this rank decodes beside others (`Lockstep`); each
    rank must pass as many prompts and the same `max_new_tokens` and `cache`. `seeds`: each prompt's generator seed
    (default `sampling.seed` for every one; `sequence_seed` gives a prompt's further samples theirs). The model is
    put in eval mode; the rows of a batch share its timings."""
    check_prompts(model, prompts, max_new_tokens, cache)
    if seeds is not None and len(seeds) != len(prompts):
        raise ValueError(f"generate_many: {len(seeds)} seeds for {len(prompts)} prompts: give one per prompt")
    seeds = [sampling.seed] * len(prompts) if seeds is None else list(seeds)
    model.eval()
    with torch.no_grad(), dropless(model), causal_routing(model):
        if not cache:
            return [_decode(model, [p], max_new_tokens, sampling, set(stop_ids), False, latent, lockstep, [seed])[0]
                    for p, seed in zip(prompts, seeds)]
        return _decode(model, prompts, max_new_tokens, sampling, set(stop_ids), True, latent, lockstep, seeds)


def sequence_seed(seed: int, sequence: int) -> int:
    """The generator seed of a prompt's `sequence`-th sample (`moebal generate --num-return-sequences`): `seed`
    itself for the first (the text one sample gives), then (seed, sequence) mixed as router noise's keys are
    (`noise.mixed_seed`), so no two samples of a prompt share a stream."""
    return seed if sequence == 0 else noise.mixed_seed(seed, sequence)


def _decode(model: MoebalForCausalLM, prompts: Sequence[Sequence[int]], max_new_tokens: int, sampling: Sampling,
            stops: set[int], cache: bool, latent: bool, lockstep: Lockstep | None,
            seeds: Sequence[int]) -> list[Generation]:
    """`generate_many`'s loop over one batch (a single prompt when not `cache`), each row drawing from a generator
    seeded with its seed."""
    device = model.lm_head.weight.device
    B, P = len(prompts), max(len(p) for p in prompts)
    gens = None if sampling.greedy else [torch.Generator(device=device).manual_seed(seed) for seed in seeds]
    outs = [Generation(prompt=list(p)) for p in prompts]
    pad = [P - len(p) for p in prompts]
    ids_BT = torch.tensor([[0] * k + list(p) for k, p in zip(pad, prompts)], dtype=torch.long, device=device)
    pad_B = torch.tensor(pad, device=device) if any(pad) else None
    kv = KVCache.empty(len(model.model.layers), P + max_new_tokens - 1, latent)  # the last token is not fed
    done = [False] * B
    t0 = time.perf_counter()
    step_BT = ids_BT
    for n in range(max_new_tokens):
        if lockstep is not None:
            lockstep.before_forward()
        logits_BV = (cached_forward(model, step_BT, kv, pad_B) if cache else model(ids_BT).logits)[:, -1]
        toks = next_tokens(logits_BV, sampling, gens).tolist()  # the host decides whether to stop
        if n == 0:
            for g in outs:
                g.prefill_s = time.perf_counter() - t0
            t0 = time.perf_counter()
        for b, tok in enumerate(toks):
            if not done[b]:
                outs[b].tokens.append(tok)
                if tok in stops:
                    done[b], outs[b].stop = True, "stop_token"
        if all(done) if lockstep is None else lockstep.all_done(all(done)):
            break
        step_BT = torch.tensor([[t] for t in toks], dtype=torch.long, device=device)
        if not cache:  # the whole-prefix forward reads the sequence; the cached decoder only the new column
            ids_BT = torch.cat([ids_BT, step_BT], dim=1)
    for g in outs:
        g.decode_s = time.perf_counter() - t0
        g.cache_bytes = kv.position_bytes() // B if cache else 0
    return outs
