"""The embedded default run learns: its config, shrunk to a test budget, ends far below the unigram entropy."""

from __future__ import annotations

import pytest

from moebal.config import Config, with_overrides
from moebal.train import Trainer

# The default model and data with one (MoE) layer and a short schedule (~25 s on 2 cores; two layers reach
# 0.74x of the entropy in twice the time, one layer 0.75x).
SHRINK = ["model.n_layers=1", "train.steps=100", "train.warmup_steps=10", "train.eval_every=0",
          "train.eval_batches=4", "train.ckpt_every=0", "train.progress=plain", "train.time_limit_min=null"]


@pytest.mark.slow
def test_default_config_learns_well_below_the_unigram_entropy(tmp_path):
    cfg = with_overrides(Config(), SHRINK)
    # still the MoE default (its one layer an MoE layer) on the stdlib corpus
    assert cfg.moe.num_experts > 1 and cfg.moe.every == 1 and cfg.data.source == "stdlib"
    result = Trainer(cfg, tmp_path).train()
    assert result.val_loss is not None
    # a context-free model cannot beat the entropy; 100 steps of the default reach ~0.75x of it
    assert result.val_loss < 0.8 * result.unigram_entropy, (result.val_loss, result.unigram_entropy)
    assert result.train_loss < 0.8 * result.unigram_entropy
