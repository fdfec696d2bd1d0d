"""`moebal generate`: text from a trained run's newest checkpoint (or one of its checkpoints, RUN_DIR/ckpt-NNNNNNN),
or from a HF (or converted) checkpoint directory, with a KV cache (moebal/models/generate.py).

Example: moebal generate runs/default-2026... --prompt "def main(" --max-new-tokens 64
         moebal generate hf/Mixtral-8x7B-v0.1 --prompt "The capital of France is" --device cuda --dtype bf16
         moebal generate runs/default-2026... --prompt "def " --prompt "import" --nproc 2 --policy lina
(greedy by default; `--temperature 0.8 --top-p 0.95 --seed 1` samples, the same text for the same seed;
`--nproc N` decodes with expert parallelism on N local gloo ranks: moebal/distributed/ep_generate.py.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moebal.errors import ConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="a run directory of `moebal train` (its newest checkpoint) or one of its "
                   "checkpoints (RUN_DIR/ckpt-NNNNNNN), or a HF checkpoint directory (config.json) or one `moebal "
                   "convert hf-to-moebal` wrote")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", action="append", help="a prompt (repeat for several: see --batch-size)")
    what.add_argument("--prompt-ids", action="append",
                      help="a prompt as comma-separated token ids (no tokenizer needed; repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per prompt at most (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sample")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (default 0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1: all)")
    p.add_argument("--seed", type=int, default=0, help="the sampling generator's seed (default 0)")
    p.add_argument("--num-return-sequences", type=int, default=1,
                   help="samples per prompt, each from its own generator (the first from --seed; default 1; "
                        "needs --temperature > 0)")
    p.add_argument("--stop-id", type=int, action="append", default=None,
                   help="end a generation at this token id (repeatable; default: the checkpoint's eos_token_id "
                        "where its HF config names one, else none; -1: none)")
    p.add_argument("--tokenizer", default=None, help="'byte' or a tokenizer.json (default: the run's data.tokenizer, "
                   "or the checkpoint directory's tokenizer.json)")
    p.add_argument("--batch-size", type=int, default=8,
                   help="prompts decoded together, over all ranks with --nproc (default 8; each row computes and "
                        "draws as it would alone)")
    p.add_argument("--no-cache", action="store_true",
                   help="run the whole prefix's forward for every new token instead of the KV cache (a reference)")
    p.add_argument("--nproc", type=int, default=1, help="expert-parallel gloo ranks on this machine, each decoding "
                   "its share of every batch (default 1: one process)")
    p.add_argument("--policy", default="static", choices=("static", "lina", "phase1", "oracle", "all"),
                   help="with --nproc > 1, how each MoE layer's tokens find their experts (as `moebal eval`): static "
                        "expert parallelism (default), Lina (phases 1 and 2), phase 1 only, FFD on the real counts; "
                        "a policy other than static runs after static, whose tokens it must equal; all: each")
    p.add_argument("--profile", default=None, help="path profile for lina and phase1 (default RUN_DIR/paths.npz; "
                   "`moebal paths RUN_DIR`)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="weights and compute (default fp32)")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")


def eos_ids(hf_dir: Path | None) -> list[int]:
    """The `eos_token_id` (an id or a list) of a HF checkpoint directory: its generation_config.json's, as
    transformers' `generate` takes it, else its config.json's (hf_config.json in a converted directory); none
    where they name none."""
    if hf_dir is None:
        return []
    for name in ("generation_config.json", "config.json", "hf_config.json"):
        f = hf_dir / name
        if f.is_file():
            try:
                eos = json.loads(f.read_text()).get("eos_token_id")
            except (OSError, ValueError, AttributeError):
                return []
            ids = eos if isinstance(eos, list) else [eos]
            return [int(i) for i in ids if isinstance(i, int)]
    return []


@dataclass
class Source:
    """What `moebal generate` serves."""

    cfg: Any
    model: Any
    served: Any
    """How a dynamism scheme serves the run (moebal.commands.eval.Served), None for the plain model."""
    hf_dir: Path | None
    """The HF directory the eos id comes from."""
    special_tokens: bool
    """Encode prompts with the tokenizer's special tokens: a run's data.add_special_tokens (prompts as its samples
    were); for a checkpoint directory, yes (a LLaMA tokenizer's BOS, as transformers' tokenizers encode)."""


def load_source(source: Path) -> Source:
    """A run directory's newest checkpoint, one of a run's checkpoints, or a HF (or converted) checkpoint
    directory's weights."""
    from moebal.commands.eval import load_run_model
    from moebal.interop.hf import config_from_hf, from_hf

    if not source.is_dir():
        raise ConfigError(f"{source}: not a directory: give a run directory of `moebal train` or a checkpoint "
                          f"directory (HF, or one `moebal convert hf-to-moebal` wrote)")
    if (source / "config.yaml").is_file() and not (source / "hf_config.json").is_file():
        cfg, model, served = load_run_model(source)
        init = Path(cfg.hf.init_from) if cfg.hf.init_from else None
        return Source(cfg, model, served, init if init is not None and init.is_dir() else None,
                      cfg.data.add_special_tokens)
    if not ((source / "config.json").is_file() or (source / "hf_config.json").is_file()):
        raise ConfigError(f"{source}: neither a run directory (config.yaml) nor a checkpoint directory "
                          f"(config.json, or hf_config.json from `moebal convert`)")
    try:
        cfg = config_from_hf(source)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    return Source(cfg, from_hf(source, cfg=cfg).eval(), None, source, True)


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from moebal.data import load_tokenizer
    from moebal.models.generate import (
        DepthRule,
        ExitRule,
        Sampling,
        cached_form,
        causal_routing,
        check_prompts,
        sequence_seed,
    )

    counts = {"--max-new-tokens": args.max_new_tokens, "--batch-size": args.batch_size, "--nproc": args.nproc,
              "--num-return-sequences": args.num_return_sequences}
    low = {k: v for k, v in counts.items() if v < 1}
    if low:
        raise ConfigError(f"{' and '.join(low)} must be >= 1; got {', '.join(str(v) for v in low.values())}")
    if args.nproc > 1 and args.device != "cpu":
        raise ConfigError(f"--nproc {args.nproc} decodes on local gloo ranks on the CPU; drop --device "
                          f"{args.device} (or generate on one process: --nproc 1)")
    try:
        sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    except ValueError as e:
        raise ConfigError(f"--{str(e).replace('_', '-')}") from None
    if args.num_return_sequences > 1 and sampling.greedy:
        raise ConfigError(f"--num-return-sequences {args.num_return_sequences} draws several samples of a prompt, "
                          f"but greedy decoding (--temperature {args.temperature}) gives one text: set "
                          f"--temperature > 0, or drop --num-return-sequences")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise ConfigError(f"--device {args.device!r} is not a device: cpu or cuda[:N]") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {args.device}: this machine has no CUDA device torch can use; use --device cpu")
    source = Path(args.source)
    src = load_source(source)
    cfg, model, served = src.cfg, src.model, src.served
    # the new tokens are shown as text wherever a tokenizer is at hand, also for --prompt-ids
    spec = args.tokenizer or cfg.data.tokenizer
    tok = load_tokenizer(spec, src.special_tokens) if spec == "byte" or Path(spec).is_file() else None
    if tok is None and args.prompt is not None:
        raise ConfigError(f"no tokenizer for text prompts: {spec} does not exist; give --tokenizer (a "
                          f"tokenizer.json) or the prompt as --prompt-ids")
    if tok is not None and tok.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"the tokenizer has {tok.vocab_size} tokens and the model {cfg.model.vocab_size}: give "
                          f"the model's own tokenizer (--tokenizer)")
    if args.prompt is not None:
        assert tok is not None  # refused above
        prompts = [[int(i) for i in tok.encode(t.encode())] for t in args.prompt]
    else:
        prompts = [_ids(s, cfg.model.vocab_size) for s in args.prompt_ids]
    n = args.num_return_sequences  # each prompt n times in a row, sample s from its own generator
    sequences = [s for _ in prompts for s in range(n)]
    prompts = [p for p in prompts for _ in range(n)]
    seeds = [sequence_seed(args.seed, s) for s in sequences]
    stops = args.stop_id if args.stop_id is not None else eos_ids(src.hf_dir)
    bad = [s for s in args.stop_id or [] if s != -1 and not 0 <= s < cfg.model.vocab_size]
    if bad:  # a stop id no token can match: the generation would never stop early
        raise ConfigError(f"--stop-id {bad[0]} is not a token of this model (ids 0..{cfg.model.vocab_size - 1}; "
                          f"-1: no stop id)")
    model = model.to(device=device, dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    form: Any = None
    try:
        form = cached_form(model)
        cache = not args.no_cache
    except ValueError:  # a scheme whose tokens' paths depend on later tokens (moebal/models/generate.py)
        cache = False
    line = served.line if served is not None else None
    if isinstance(form, DepthRule):  # Mixture-of-Depths generates through its causal predictors, cached or not
        from moebal.dynamism.scheme import served_scheme

        scheme = served_scheme(model.model)
        assert scheme is not None  # a DepthRule comes from a served scheme
        with causal_routing(model):
            line = scheme.served_as()
    if served is not None and not args.json:
        how = ("no KV cache (the whole prefix runs for every new token)" if not cache else
               "KV-cached, exits included" if isinstance(form, ExitRule) else "KV-cached")
        print(f"served as the run validated after step {served.step}: {line}; {how}")
    try:  # every prompt before the first is decoded: a bad one in a later batch after printed batches wastes them
        check_prompts(model, prompts, args.max_new_tokens, cache)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    ep = _expert_parallel(args, src, model, prompts, sampling, cache, stops, seeds) if args.nproc > 1 else None
    gens = ep[-1] if ep is not None else _generations(model, prompts, args.batch_size, args.max_new_tokens, sampling,
                                                        cache, stops, seeds)
    for g, seq in zip(gens, sequences):
        text = tok.decode(np.asarray(g.tokens)) if tok is not None else None
        if args.json:
            print(json.dumps({"prompt_ids": g.prompt, "sequence": seq, "tokens": g.tokens, "text": text,
                              "stop": g.stop,
                              "prefill_s": round(g.prefill_s, 6), "decode_tokens_per_s": round(g.tokens_per_s, 3),
                              "cache": cache, "cache_bytes_per_position": g.cache_bytes,
                              "served": line,
                              "sampling": dataclasses.asdict(sampling)}))
        else:
            shown = repr(tok.decode(np.asarray(g.prompt)) + text) if tok is not None and text is not None else \
                f"{g.prompt} -> {g.tokens}"
            which = f"sample {seq + 1} of {n}, " if n > 1 else ""
            print(f"{shown}\n  [{which}{len(g.tokens)} tokens, stop: {g.stop}, first token {g.prefill_s * 1e3:.0f} ms, "
                  f"{g.tokens_per_s:.1f} tokens/s after it{'' if cache else ', no KV cache'}]")
    if ep is not None:
        summary = ep[0]
        if args.json:
            print(json.dumps({"expert_parallel": summary}))
        else:
            for p, s in summary["policies"].items():
                eq = "" if s["tokens_equal_static"] is None else f", tokens equal static: {s['tokens_equal_static']}"
                print(f"{p:7s} MoE layers {s['moe_s_median'] * 1e3:.1f} ms per forward (slowest rank, median) on "
                      f"{args.nproc} ranks{eq}")
    return 0


def _expert_parallel(args: argparse.Namespace, src: Source, model: Any, prompts: list[list[int]], sampling: Any,
                     cache: bool, stops: list[int], seeds: list[int]) -> tuple[dict[str, Any], list[Any]]:
    """(the policies' summary, the last policy's generations) of an expert-parallel run on `--nproc` ranks."""
    from moebal.commands.eval import policies_and_profile, run_of
    from moebal.distributed.ep_generate import expert_parallel_generate

    policies, profile = policies_and_profile(args.policy, args.profile, run_of(Path(args.source)),
                                             src.cfg.dynamism.scheme, model)
    try:
        res = expert_parallel_generate(model, prompts, args.nproc, args.max_new_tokens, sampling,
                                       batch_size=args.batch_size, stop_ids=stops, cache=cache, policies=policies,
                                       profile=profile, seeds=seeds)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    static = [g.tokens for g in res["static"].generations]
    summary = {"nproc": args.nproc, "policies": {
        p: {"moe_s_median": r.moe_s_median, "forwards": len(r.moe_s), "replans": r.replans, "replicas": r.replicas,
            "tokens_equal_static": None if p == "static" else [g.tokens for g in r.generations] == static}
        for p, r in res.items()}}
    return summary, res[policies[-1]].generations


def _generations(model: Any, prompts: list[list[int]], batch: int, new: int, sampling: Any, cache: bool,
                 stops: list[int], seeds: list[int]) -> Iterator[Any]:
    """Each prompt's generation, `batch` prompts at a time (moebal.models.generate.generate_many), prompt i
    sampling from a generator seeded with `seeds[i]`."""
    from moebal.models.generate import generate_many

    for i in range(0, len(prompts), batch):
        try:
            yield from generate_many(model, prompts[i:i + batch], new, sampling, cache=cache, stop_ids=stops,
                                     seeds=seeds[i:i + batch])
        except ValueError as e:
            raise ConfigError(str(e)) from None


def _ids(text: str, vocab: int) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise ConfigError(f"--prompt-ids {text!r}: give comma-separated integers, e.g. 1,17,42") from None
    bad = [i for i in ids if not 0 <= i < vocab]
    if not ids or bad:
        raise ConfigError(f"--prompt-ids {text!r}: " + (f"ids {bad} are outside the vocabulary 0..{vocab - 1}"
                                                       if bad else "no ids"))
    return ids
