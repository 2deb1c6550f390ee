"""PipelineRun: one optimizer step's forward and backward through torch.distributed.pipelining, for the step.

The rank's model is its own stage (apply replaced the other stages' modules by nn.Identity); torch's
PipelineStage and schedule are built on the first call and reused while the model is the same object. The
loss of a micro batch is its summed cross-entropy times the step's scale (dp / tokens in the global batch),
as in the non-pipelined step, and the schedule does not rescale gradients: every layout gets the same ones.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from shardlab.pipeline import StagePlan
from shardlab.plan import Plan

SCHEDULE_NAMES = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved_1f1b": "Interleaved1F1B",
    "looped_bfs": "LoopedBFS",
    "interleaved_zero_bubble": "InterleavedZeroBubble",
    "zbv_zero_bubble": "ZBVZeroBubble",
    "dualpipev": "DualPipeV",
}
"""shardlab's schedule names -> torch's (get_schedule_class)."""


class StageView(nn.Module):
    """One pipeline stage of a rank that holds several: runs, in model order, the modules before the blocks (first
    stage), the stage's blocks, and the modules after them (last stage), each on the previous one's output.

    Holds the rank's model without registering it, so parameter names and the optimizer stay the model's. Assumes
    what Llama does: the model's forward is that sequence.
    """

    def __init__(self, model: nn.Module, stage: StagePlan, last: bool) -> None:
        super().__init__()
        names = (*stage.blocks, *stage.others) if last else (*stage.others, *stage.blocks)
        self._parts = [model.get_submodule(n) for n in names]
        self._params = [p for part in self._parts for p in part.parameters()]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for part in self._parts:
            x = part(x)
        return x

    def parameters(self, recurse: bool = True):  # what PipelineStage reads (device, gradient hooks)
        return iter(self._params)


class PipelineRun:
    """Runs a batch through this rank's stages under the plan's schedule; returns the last stage's summed loss."""

    def __init__(self, plan: Plan, mesh: DeviceMesh, ignore_index: int) -> None:
        pipeline = plan.pipeline
        if pipeline is None:
            raise ValueError("PipelineRun: the plan has no pipeline stages (mesh.pp is 1)")
        self.pipeline = pipeline
        self.pp_mesh = mesh["pp"]
        self.pp_rank = self.pp_mesh.get_local_rank()
        self.stages = pipeline.stages_of(self.pp_rank)
        self.n_stages = len(pipeline.stages)
        self.is_first = any(s.index == 0 for s in self.stages)
        self.is_last = any(s.index == self.n_stages - 1 for s in self.stages)
        self.ignore_index = ignore_index
        self.vocab_parallel = plan.loss_parallel
        self.scale = 1.0
        self._summed: list[torch.Tensor] = []
        self._model: nn.Module | None = None
        self._schedule = None

    @property
    def group(self) -> dist.ProcessGroup:
        return self.pp_mesh.get_group()

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        summed = F.cross_entropy(
            logits.flatten(0, 1).float(), labels.flatten(), reduction="sum", ignore_index=self.ignore_index
        )
        value = summed.detach()
        self._summed.append(
            value.full_tensor() if isinstance(value, DTensor) else value
        )  # replicated under loss parallel
        return summed * self.scale

    def _schedule_for(self, model: nn.Module, device: torch.device):
        if self._model is not model:
            cls = get_schedule_class(SCHEDULE_NAMES[self.pipeline.schedule])
            m = self.pipeline.microbatches
            if issubclass(cls, PipelineScheduleSingle):  # one stage: the rank's model is it (the rest is Identity)
                (s,) = self.stages
                stage = PipelineStage(model, s.index, self.n_stages, device, group=self.group)
                self._schedule = cls(stage, n_microbatches=m, loss_fn=self._loss, scale_grads=False)
            else:
                stages = [
                    PipelineStage(
                        StageView(model, s, s.index == self.n_stages - 1), s.index, self.n_stages, device,
                        group=self.group,
                    )
                    for s in self.stages
                ]  # fmt: skip
                self._schedule = cls(stages, n_microbatches=m, loss_fn=self._loss, scale_grads=False)
            self._model = model
        return self._schedule

    def __call__(self, model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, scale: float) -> torch.Tensor:
        """Forward and backward of the whole batch; the summed (unscaled) loss on the last stage, else 0."""
        device = inputs.device
        schedule = self._schedule_for(model, device)
        self.scale, self._summed = scale, []
        args = (inputs,) if self.is_first else ()
        if self.is_last:
            with loss_parallel() if self.vocab_parallel else contextlib.nullcontext():  # the loss and its backward
                schedule.step(*args, target=labels)
            # The first step also computes one loss while torch infers the stages' shapes: count the last m calls.
            return torch.stack(self._summed[-self.pipeline.microbatches :]).to(torch.float64).sum()
        schedule.step(*args)
        return torch.zeros((), dtype=torch.float64, device=device)
