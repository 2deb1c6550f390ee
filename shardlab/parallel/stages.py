"""The modules a rank's pipeline stages run, built from the model's own modules so that parameter names, optimizer
state and checkpoints stay the model's.

`keep_own_stages` replaces the other ranks' stages by `OtherStage` (on the meta device, before anything is
allocated). What torch's PipelineStage then runs (`build_stages`) depends on how the model is called
(`PipelinePlan.call`): a model whose forward is the sequence of its parts with tensors in and out (shardlab's Llama,
most hand-written models) runs itself, or one `StageModule` per stage when the rank holds several; a transformers
model runs its own forward (rotary tables, masks) inside a `TransformersStage`.

The stage modules are FSDP roots, so the step must run the very ones `apply` built: they are returned to the caller
(`shardlab.parallel.apply.Parallelized.stages`), not remembered here or on the model.
"""

from __future__ import annotations

import torch
from torch import nn

from shardlab.models.stand_in import OtherStage
from shardlab.models.transformers.stage import TransformersStage
from shardlab.sharding.pipeline import StagePlan
from shardlab.sharding.plan import Plan


def build_stages(model: nn.Module, plan: Plan, own: tuple[StagePlan, ...]) -> tuple[nn.Module, ...]:
    """The modules torch's PipelineStage runs for this rank's stages `own`, in model order (each an FSDP root under
    FSDP): the model itself for one stage it runs by its own forward, else new modules over the model's parts."""
    last = len(plan.pipeline.stages) - 1
    if plan.pipeline.call == "transformers":
        (stage,) = own
        return (TransformersStage(model, stage.index == 0, stage.index == last),)
    if len(own) > 1:
        return tuple(StageModule(model, s, last=s.index == last) for s in own)
    return (model,)


def keep_own_stages(model: nn.Module, plan: Plan, pp_rank: int) -> tuple[StagePlan, ...]:
    """Replace every block and module of the other ranks' pipeline stages by OtherStage, so this rank holds,
    builds and checkpoints only its own stages; parameter names stay those of the whole model. On the meta
    device, before materialising, the other stages are never allocated. Returns this rank's stages."""
    own = plan.pipeline.stages_of(pp_rank)
    for s in plan.pipeline.stages:
        if s.pp_rank != pp_rank:
            for fqn in (*s.blocks, *s.others):
                if not isinstance(model.get_submodule(fqn), OtherStage):
                    model.set_submodule(fqn, OtherStage(like=model.get_submodule(fqn)))
    return own


def in_stages(fqn: str, stages: tuple[StagePlan, ...]) -> bool:
    """Whether module or parameter `fqn` belongs to one of `stages`."""
    return any(fqn == m or fqn.startswith(m + ".") for s in stages for m in (*s.blocks, *s.others))


class StageModule(nn.Module):
    """One pipeline stage of a rank that holds several: runs, in model order, the modules before the blocks (first
    stage), the stage's blocks, and the modules after them (last stage), each on the previous one's output.

    Its parts are the model's own modules; with FSDP each StageModule is a root. Assumes what Llama does: the
    model's forward is that sequence (`PipelinePlan.call == "tensor"`).
    """

    def __init__(self, model: nn.Module, stage: StagePlan, last: bool) -> None:
        super().__init__()
        names = (*stage.blocks, *stage.others) if last else (*stage.others, *stage.blocks)
        self.parts = nn.ModuleList(model.get_submodule(n) for n in names)
        self.is_block = tuple(n in stage.blocks for n in names)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """positions: the tokens' places in their sequences, for the blocks (a context-parallel rank's chunks)."""
        for part, is_block in zip(self.parts, self.is_block):
            x = part(x, positions=positions) if is_block and positions is not None else part(x)
        return x
