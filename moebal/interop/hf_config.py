"""A run config whose model comes from a Hugging Face checkpoint (`hf.init_from`).

`moebal.config.load` reads YAML and validates it; it knows nothing of checkpoints. This is the loader the
commands call: without `hf.init_from` it is `moebal.config.load`; with it, the checkpoint's config.json
(`moebal.interop.hf.config_fields`) fills in model.* and moe.*: shape fields the config leaves out are taken
from it and ones it sets must agree; training defaults (the balancing coefficient, router noise) apply unless
the config sets its own. torch is imported only in that second case (the checkpoint reader needs it).
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

from moebal.config import Config, from_dict, load_data
from moebal.errors import CheckpointError, ConfigError

__all__ = ["load", "with_hf_fields"]


def load(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Config from a YAML file (a path or a preset name in configs/) plus `a.b=value` overrides, its model
    shape read from `hf.init_from` when that is set."""
    data, source = load_data(path, overrides)
    return with_hf_fields(data, source)


def with_hf_fields(data: dict[str, Any], source: str) -> Config:
    """With `hf.init_from`, fill model.* and moe.* from the checkpoint's config.json: shape fields the config
    leaves out are taken from it and ones it sets must agree; training defaults (the balancing coefficient,
    router noise) apply unless the config sets its own."""
    hf = data.get("hf")
    init = hf.get("init_from") if isinstance(hf, dict) else None
    if not isinstance(init, str) or not init:
        return from_dict(data, source=source)
    from moebal.interop.hf import config_fields  # torch: only for a run that starts from a checkpoint

    user = {s: dict(v) if isinstance(v, dict) else v for s, v in data.items()}
    try:
        fields = config_fields(init)
    except CheckpointError as e:
        set_all = (all(k in (user.get("model") or {}) for k in ("dim", "n_layers", "vocab_size"))
                   and not Path(init).exists())
        if set_all:  # a run's own resolved config: the shape is all there; resuming needs no HF directory
            return from_dict(data, source=source)
        raise ConfigError(f"{source}: hf.init_from: {e}") from None
    merged = {s: dict(v) if isinstance(v, dict) else v for s, v in data.items()}
    for group in (fields.shape, fields.defaults):
        for section, values in group.items():
            sec = merged.setdefault(section, {})
            if not isinstance(sec, dict):
                raise ConfigError(f"{source}: '{section}' must be a mapping")
            for key, value in values.items():
                sec.setdefault(key, value)
    cfg = from_dict(merged, source=source)
    clash = []
    for section, values in fields.shape.items():
        given = user.get(section) or {}
        for key, value in values.items():
            if key not in given:
                continue
            ours = cfg.head_dim if key == "head_dim" else getattr(getattr(cfg, section), key)
            # model.mla, model.rope_scaling: compared as config.json's dicts
            if dataclasses.is_dataclass(ours) and not isinstance(ours, type):
                ours = dataclasses.asdict(ours)
            theirs = (value or cfg.model.dim // cfg.model.n_heads) if key == "head_dim" else value
            if ours != theirs:
                clash.append(f"{section}.{key} is {ours!r} here but {theirs!r} in the checkpoint")
    if clash:
        raise ConfigError(f"{source}: the config disagrees with hf.init_from ({init}/config.json): "
                          f"{'; '.join(clash)}: remove these keys (they are read from the checkpoint)")
    return cfg
