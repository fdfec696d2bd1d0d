"""Tied input and output embeddings (`model.tie_embeddings`) across pipeline stages.

One tensor is the embedding of the first stage and the LM head of the last. The first stage holds the weight:
it is the only one whose optimizer steps it, whose checkpoint state carries its AdamW moments, and whose
gradient-norm slot counts it. The last stage holds a copy for its head, made from the same initialisation
(or checkpoint, or HF tensor), which never steps on its own:

  1. after the backward pass and before the data-parallel sum, the last stage sends its copy's gradient (this
     replica's micro-batches) to the first stage of its own pipeline, which adds it to the embedding's gradient
     (`embedding + head`, in that order on every partition: a migration changes neither stage's end); the
     data-parallel sum of the first stage then sums the tied gradient over every replica, as it would sum one
     tensor's gradient, and the copy's gradient is not summed on the last stage at all;
  2. clipping counts the tied gradient once: in the embedding's slot (the runner leaves the copy out of the
     head's slot);
  3. after the optimizer step, the first stage sends the stepped weight to the last, which takes it as its
     copy: one weight, bit for bit, before every forward pass. A checkpoint keeps it once, as one process does:
     the last stage writes `lm_head.weight` as an alias of the embedding and loads its copy through it
     (`PipelineStage.checkpoint_links`).

Two messages of the embedding's size per step, each way once, on the pipeline's own point-to-point channels
(Megatron-LM instead all-reduces the gradient between the two stages and steps both copies, trusting that two
AdamW steps of equal inputs stay equal; sending the stepped weight keeps one source whatever the optimizer does).
A scheme that stops the embedding's training (freezing) stops the copy's with it (`Freezing`), and both ends
see it alike: the frozen flag is the scheme's global decision.

Under the sharded optimizer (`parallel.shard: optimizer`) a pipeline stage reduce-scatters its gradients after
the backward pass (`ShardedAdamW.reduce`), so the head's gradient joins the embedding's before that too: into
the embedding's gradient, or with bf16 compute copies (`parallel.param_dtype: bf16`) into the fp32 sum the
optimizer keeps for it (`ShardedAdamW.add`). The copy is no flat's: it stays fp32 and its gradient sums over the
micro-batches in fp32, and it takes the stepped compute copy's values (bf16 on the wire, exact in fp32), which
autocast casts back to the same bf16 for the head.

Under `parallel.shard: full` the first stage's embedding is an FSDP2 unit whose gradient FSDP2 reduce-scatters
in the backward pass (each micro-batch's, or the step's whole sum under `parallel.accumulate: whole`), before the
head's could join it. So the head's gradient is reduce-scattered by hand after the backward pass
(`DeferredGradReducer`, as FSDP2 lays the shards out, summed over the stage's ranks in `parallel.reduce_dtype`)
and added to the embedding's shards: the same sum, `embedding + head` per shard, in another order than the
unsharded runner's (within rounding). After the optimizer step the first stage gathers the stepped shards whole
(a collective over the stage) and sends them as in step 3. The copy is no FSDP2 unit: the last stage keeps it
whole (fp32 weight and gradient, V x D each, on every rank of the stage: the memory plan counts them), and
autocast casts it for the head as FSDP2 casts its units (`parallel.param_dtype`).

A dynamism scheme's one-stage pipeline under `parallel.shard: full` (over the stage's data-parallel ranks) holds
both ends, but FSDP2 shards its embedding and its head as units of their own, so one tensor would become two
shards trained apart. There the head takes a copy of its own too (`untie`, before the stage is sharded), and the
same three steps run without messages: the copy's gradient is reduce-scattered into the embedding's shards after
the backward pass, and the gathered stepped weight is copied into it after the step. A checkpoint keeps it as
the embedding's alias, as for a last stage.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from moebal.config import Config, tied_wire
from moebal.distributed.fsdp import DTYPES, DeferredGradReducer, whole_tensor
from moebal.distributed.sharded import ShardedAdamW
from moebal.pipeline.p2p import PipeChain
from moebal.pipeline.stage import PipelineStage

__all__ = ["TiedEmbedding", "wire_dtype"]


def wire_dtype(cfg: Config) -> torch.dtype | None:
    """The dtype a tied embedding's stepped weight travels in to its head copy: the sharded optimizer's compute
    copies' under `parallel.param_dtype` (the embedding is one), else the weight's own (None: fp32; under `full`
    the gathered fp32 shards)."""
    name = tied_wire(cfg.parallel)
    return None if name == "fp32" else DTYPES[name]


class TiedEmbedding:
    """The first stage's end (`weight`: the embedding) or the last stage's (`copy`: the LM head's weight) of one
    pipeline's tied embedding, or both on a fully sharded one-stage pipeline; `of` gives None where the stage
    holds neither, or both as one tensor (one stage, unsharded)."""

    def __init__(self, chain: PipeChain, embed: nn.Embedding | None, copy: torch.Tensor | None,
                 wire: torch.dtype | None = None) -> None:
        """`embed`: the first stage's embedding module (its weight is read when used: FSDP2 replaces it by its
        sharded form); `wire`: the dtype the stepped weight travels in (the sharded optimizer's compute copies'),
        None: the weight's own."""
        assert embed is not None or copy is not None
        self.chain, self.embed, self.copy, self.wire = chain, embed, copy, wire
        self.reducer: DeferredGradReducer | None = None
        """Under `parallel.shard: full`, on the first stage: reduce-scatters the head's gradient into the
        embedding's shards (`shard`)."""

    @classmethod
    def of(cls, stage: PipelineStage, chain: PipeChain, wire: torch.dtype | None = None, untie: bool = False
           ) -> TiedEmbedding | None:
        """`untie`: a one-stage pipeline that will shard its embedding and head apart (`parallel.shard: full`) gives
        its head a copy of the embedding (before FSDP2 sees the stage)."""
        if not stage.cfg.model.tie_embeddings or not (stage.first or stage.last):
            return None
        if stage.first and stage.last:
            assert stage.model.embed_tokens is not None and stage.lm_head is not None
            if not untie:
                return None
            weight = stage.model.embed_tokens.weight
            stage.lm_head.weight = nn.Parameter(weight.detach().clone(), requires_grad=weight.requires_grad)
            return cls(chain, stage.model.embed_tokens, stage.lm_head.weight, wire)
        if stage.first:
            assert stage.model.embed_tokens is not None
            return cls(chain, stage.model.embed_tokens, None, wire)
        assert stage.lm_head is not None
        return cls(chain, None, stage.lm_head.weight, wire)

    def shard(self, stage: PipelineStage, mesh: Any, reduce_dtype: torch.dtype) -> None:
        """`parallel.shard: full`: the first stage's embedding is an FSDP2 unit over the stage's ranks (`mesh`), so
        the head's whole gradient is reduce-scattered into its shards (summed over the stage's ranks in
        `reduce_dtype`, as FSDP2 sums the embedding's own) and the stepped weight is gathered whole before it
        leaves; the last stage's copy is no unit (`moebal.distributed.fsdp._stage_units`): whole on every rank."""
        if self.embed is not None:
            self.reducer = DeferredGradReducer(stage, mesh, reduce_dtype)

    @property
    def weight(self) -> torch.Tensor | None:
        """The embedding's weight on the first stage (a DTensor of shards under `parallel.shard: full`), else None."""
        return self.embed.weight if self.embed is not None else None

    def _peer(self) -> int:
        return self.chain.ranks[-1] if self.embed is not None else self.chain.ranks[0]

    def sum_grads(self, sharded: ShardedAdamW | None = None) -> None:
        """Step 1: the copy's gradient added to the embedding's (before the data-parallel sum, or before
        `sharded`'s reduce-scatter: into its fp32 sum where it keeps the embedding as a compute copy; under
        `parallel.shard: full` after FSDP2's reduce-scatter of the embedding's own, into its shards)."""
        if self.embed is None:
            assert self.copy is not None
            if self.copy.requires_grad:
                g = self.copy.grad if self.copy.grad is not None else torch.zeros_like(self.copy)
                self.chain.send(g, self._peer())  # the chain keeps it alive until the send completes
                self.copy.grad = None
            return
        weight = self.weight
        assert weight is not None
        if not weight.requires_grad:
            return
        if self.copy is not None:  # one stage: the copy's own gradient (its micro-batches' sum, fp32)
            head = self.copy.grad if self.copy.grad is not None else torch.zeros_like(self.copy)
            self.copy.grad = None
        else:
            head = self.chain.recv(torch.empty(weight.shape, device=weight.device), self._peer())  # fp32
        if self.reducer is not None:  # collective over the stage: every rank of it sums its pipeline's head
            self.reducer.add(weight, head)
            self.reducer.flush()
        elif sharded is not None and sharded.holds(weight):
            sharded.add(weight, head)
        elif weight.grad is None:
            weight.grad = head
        else:
            weight.grad.add_(head)

    def share_weight(self) -> None:
        """Step 3: the stepped weight to the copy (after the optimizer step; under `parallel.shard: full` gathered
        whole first, a collective over the first stage)."""
        weight = self.weight
        if weight is not None:
            if weight.requires_grad:
                gathered = isinstance(weight, DTensor)
                whole = whole_tensor(weight) if gathered else weight.detach()
                if self.copy is None:
                    self.chain.send(whole, self._peer())
                    if gathered:  # a whole fp32 [V, D] of its own: waited for here, not held into the next step
                        self.chain.flush()  # (gloo reports a send complete only once waited on: `PipeChain.send`)
                else:  # one stage: the copy is here
                    with torch.no_grad():
                        self.copy.copy_(whole)
            return
        assert self.copy is not None
        if not self.copy.requires_grad:
            return
        if self.wire is None or self.wire == self.copy.dtype:
            self.chain.recv(self.copy.detach(), self._peer())  # in place: the same storage
        else:
            with torch.no_grad():
                self.copy.copy_(self.chain.recv(torch.empty_like(self.copy, dtype=self.wire), self._peer()))
