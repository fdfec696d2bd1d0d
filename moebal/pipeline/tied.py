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
autocast casts back to the same bf16 for the head. Under `parallel.shard: full` FSDP2 reduce-scatters each
micro-batch's gradients in its backward pass, before the head's could join them: `moebal.config` refuses it.
"""

from __future__ import annotations

import torch

from moebal.distributed.sharded import ShardedAdamW
from moebal.pipeline.p2p import PipeChain
from moebal.pipeline.stage import PipelineStage

__all__ = ["TiedEmbedding"]


class TiedEmbedding:
    """The first stage's end (`weight`: the embedding) or the last stage's (`copy`: the LM head's weight) of one
    pipeline's tied embedding; `of` gives None where the stage holds both (one stage) or neither."""

    def __init__(self, chain: PipeChain, weight: torch.Tensor | None, copy: torch.Tensor | None,
                 wire: torch.dtype | None = None) -> None:
        """`wire`: the dtype the stepped weight travels in (the sharded optimizer's compute copies'), None: the
        weight's own."""
        assert (weight is None) != (copy is None)
        self.chain, self.weight, self.copy, self.wire = chain, weight, copy, wire

    @classmethod
    def of(cls, stage: PipelineStage, chain: PipeChain, wire: torch.dtype | None = None) -> TiedEmbedding | None:
        if not stage.cfg.model.tie_embeddings or stage.first == stage.last:
            return None
        if stage.first:
            assert stage.model.embed_tokens is not None
            return cls(chain, stage.model.embed_tokens.weight, None, wire)
        assert stage.lm_head is not None
        return cls(chain, None, stage.lm_head.weight, wire)

    def _peer(self) -> int:
        return self.chain.ranks[-1] if self.weight is not None else self.chain.ranks[0]

    def sum_grads(self, sharded: ShardedAdamW | None = None) -> None:
        """Step 1: the copy's gradient added to the embedding's (before the data-parallel sum, or before
        `sharded`'s reduce-scatter: into its fp32 sum where it keeps the embedding as a compute copy)."""
        if self.copy is not None:
            if self.copy.requires_grad:
                g = self.copy.grad if self.copy.grad is not None else torch.zeros_like(self.copy)
                self.chain.send(g, self._peer())  # the chain keeps it alive until the send completes
                self.copy.grad = None
            return
        assert self.weight is not None
        if not self.weight.requires_grad:
            return
        head = self.chain.recv(torch.empty(self.weight.shape, device=self.weight.device), self._peer())  # fp32
        if sharded is not None and sharded.holds(self.weight):
            sharded.add(self.weight, head)
        elif self.weight.grad is None:
            self.weight.grad = head
        else:
            self.weight.grad.add_(head)

    def share_weight(self) -> None:
        """Step 3: the stepped weight to the copy (after the optimizer step)."""
        if self.weight is not None:
            if self.weight.requires_grad:
                self.chain.send(self.weight.detach(), self._peer())
            return
        assert self.copy is not None
        if not self.copy.requires_grad:
            return
        if self.wire is None or self.wire == self.copy.dtype:
            self.chain.recv(self.copy.detach(), self._peer())  # in place: the same storage
        else:
            with torch.no_grad():
                self.copy.copy_(self.chain.recv(torch.empty_like(self.copy, dtype=self.wire), self._peer()))
