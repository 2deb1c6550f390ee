"""PipelineRun: one optimizer step's forward and backward through torch.distributed.pipelining, for the step.

The rank's stages are the modules `parallelize` built for it and returned (`Parallelized.stages`: the model, whose
other stages are OtherStage, or one StageModule per stage when it runs several, or a TransformersStage), given to
PipelineRun by its caller; torch's PipelineStage and schedule are built on the first call and reused while the model
is the same object. The loss of a micro batch is its summed cross-entropy times the step's scale (dp / tokens in the global batch),
as in the non-pipelined step, and the schedule does not rescale gradients: every layout gets the same ones.

torch.distributed.pipelining is imported where a pipeline is built, not with this module: it imports torch._dynamo
(0.6 s of the 2.9 s `import shardlab` took), which a process that builds no pipeline and runs no meta op (a
command that fails on bad input, a script importing one piece of shardlab) then never loads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import loss_parallel

from shardlab._errors import ShardlabError
from shardlab.sharding.pipeline import PipelinePlan
from shardlab.sharding.plan import Plan
from shardlab.training.loss import local_value, scaled, summed_loss

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


class PipelineRun:
    """Runs a batch through this rank's stages under the plan's schedule; returns the last stage's summed loss.

    stages: the modules `parallelize` built for this rank's stages (`Parallelized.stages`); None: the model itself
    runs this rank's one stage (a model whose forward is its parts in sequence)."""

    def __init__(self, plan: Plan, mesh: DeviceMesh, stages: tuple[nn.Module, ...] | None = None) -> None:
        pipeline = plan.pipeline
        if pipeline is None:
            raise ShardlabError("PipelineRun: the plan has no pipeline stages (mesh.pp is 1)")
        self.pipeline = pipeline
        self.pp_mesh = mesh["pp"]
        self.pp_rank = self.pp_mesh.get_local_rank()
        self.stages = pipeline.stages_of(self.pp_rank)
        self.n_stages = len(pipeline.stages)
        self.is_first = any(s.index == 0 for s in self.stages)
        self.is_last = any(s.index == self.n_stages - 1 for s in self.stages)
        self.stage_modules = stages
        self.vocab_parallel = plan.loss_parallel
        self.context_parallel = plan.context is not None
        self.scale: torch.Tensor | None = None
        self._summed: list[torch.Tensor] = []
        self._model: nn.Module | None = None
        self._schedule = None

    @property
    def group(self) -> dist.ProcessGroup:
        return self.pp_mesh.get_group()

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        summed = summed_loss(logits, labels)
        self._summed.append(local_value(summed.detach()))
        return summed if self.scale is None else scaled(summed, self.scale)

    def _schedule_for(self, model: nn.Module, device: torch.device):
        if self._model is not model:
            from torch.distributed.pipelining import PipelineStage
            from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

            cls = get_schedule_class(SCHEDULE_NAMES[self.pipeline.schedule])
            m = self.pipeline.microbatches
            modules = self.stage_modules if self.stage_modules is not None else (model,)
            if self.stage_modules is None and (self.pipeline.call == "transformers" or len(self.stages) > 1):
                raise ShardlabError(
                    f"PipelineRun: pp rank {self.pp_rank} runs stage modules built beside the model (several stages, "
                    "or a transformers model's stage), not the model itself; pass the stages parallelize(model, plan, "
                    "mesh) returns: make_step(..., stages=...)"
                )
            if len(modules) != len(self.stages):
                raise ShardlabError(
                    f"PipelineRun: {len(modules)} stage module(s) but the plan gives pp rank {self.pp_rank} "
                    f"{len(self.stages)}; pass the stages parallelize(model, plan, mesh) returns (make_step(..., "
                    "stages=))"
                )
            stages = [
                PipelineStage(module, s.index, self.n_stages, device, group=self.group)
                for module, s in zip(modules, self.stages, strict=True)
            ]
            single = issubclass(cls, PipelineScheduleSingle)
            self._schedule = cls(
                stages[0] if single else stages, n_microbatches=m, loss_fn=self._loss, scale_grads=False
            )
            self._model = model
        return self._schedule

    def _kwargs(self, schedule, positions: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """The schedule's keyword inputs: a context-parallel rank's sequence positions [s] go whole to every micro
        batch; packed rows' positions [rows, s] are split with the rows."""
        if (positions is None) == self.context_parallel and (positions is None or positions.dim() == 1):
            raise ShardlabError(
                "PipelineRun: positions [s] are given under context parallelism (plan.context), and only then; "
                "packed rows' positions [rows, s] in any layout"
            )
        from torch.distributed.pipelining.microbatch import _Replicate  # every micro batch gets the whole kwarg

        whole = positions is not None and positions.dim() == 1  # LoopedBFS takes no kwargs_chunk_spec argument
        schedule._kwargs_chunk_spec = {"positions": _Replicate()} if whole else None
        return {"positions": positions} if positions is not None else {}

    def __call__(
        self,
        model: nn.Module,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        scale: torch.Tensor | float,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Forward and backward of the whole batch; the summed (unscaled) loss on the last stage, else 0.
        positions: where this rank's tokens sit in their sequences (context parallelism) or documents (packed rows),
        given to every stage."""
        device = inputs.device
        schedule = self._schedule_for(model, device)
        kwargs = self._kwargs(schedule, positions)
        self.scale, self._summed = scale, []
        args = (inputs,) if self.is_first else ()
        if self.is_last:
            with loss_parallel() if self.vocab_parallel else contextlib.nullcontext():  # the loss and its backward
                schedule.step(*args, target=labels, **kwargs)
            # The first step also computes one loss while torch infers the stages' shapes: count the last m calls.
            return torch.stack(self._summed[-self.pipeline.microbatches :]).to(torch.float64).sum()
        schedule.step(*args, **kwargs)
        return torch.zeros((), dtype=torch.float64, device=device)

    def evaluate(
        self, model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Forward only (torch's `schedule.eval`): the summed loss of the batch on the last stage, else 0."""
        schedule = self._schedule_for(model, inputs.device)
        kwargs = self._kwargs(schedule, positions)
        self.scale, self._summed = None, []
        args = (inputs,) if self.is_first else ()
        if not self.is_last:
            schedule.eval(*args, **kwargs)
            return torch.zeros((), dtype=torch.float64, device=inputs.device)
        with loss_parallel() if self.vocab_parallel else contextlib.nullcontext():
            schedule.eval(*args, target=labels, **kwargs)
        return torch.stack(self._summed[-self.pipeline.microbatches :]).to(torch.float64).sum()


def stage_actions(pipeline: PipelinePlan, pp_rank: int, group: dist.ProcessGroup) -> dict[int, str]:
    """Each stage pp rank `pp_rank` runs -> its compute actions in the order torch's schedule runs them: F
    (forward), B (backward), I and W (a zero-bubble schedule's input- and weight-gradient halves).

    Multi-stage schedules are asked for their own `pipeline_order` (built on placeholder stages over `group`, the
    pp group; no communication). GPipe and 1F1B keep no such list: GPipe runs every forward, then every backward;
    1F1B on stage s runs w = min(m, stages - s) forwards, then alternates backward and forward, then the last w
    backwards (torch's Schedule1F1B._step_microbatches).
    """
    m, n = pipeline.microbatches, len(pipeline.stages)
    own = pipeline.stages_of(pp_rank)
    if pipeline.schedule == "gpipe":
        return {s.index: "F" * m + "B" * m for s in own}
    if pipeline.schedule == "1f1b":
        return {s.index: "F" * (w := min(m, n - s.index)) + "BF" * (m - w) + "B" * w for s in own}
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    cls = _compute_order_only(get_schedule_class(SCHEDULE_NAMES[pipeline.schedule]))
    placeholders = [PipelineStage(nn.Linear(1, 1), s.index, n, torch.device("cpu"), group=group) for s in own]
    return compute_actions(cls(placeholders, n_microbatches=m).pipeline_order[pp_rank], [s.index for s in own])


def compute_actions(order: list, stages: list[int]) -> dict[int, str]:
    """A torch schedule's order for one rank (its `pipeline_order[rank]`) -> each of `stages`' compute actions."""
    actions = {index: "" for index in stages}
    for stage, kind, _ in compute_steps(order):
        actions[stage] += kind
    return actions


def compute_steps(order: list) -> Iterator[tuple[int, str, int]]:
    """(stage, F / B / I / W, micro batch) of each compute action in a torch schedule's order for one rank, in
    order (an overlapped action's parts one after the other; idle slots and communication left out)."""
    for action in order:
        for a in (action.sub_actions or (action,)) if action is not None else ():
            kind = a.computation_type.value
            if kind in "FBIW":
                yield a.stage_index, kind, a.microbatch_index


def _compute_order_only(cls: type) -> type:
    """`cls` without the lowering of its order to communication actions, which torch's multi-stage schedules run
    for every rank when built (7 s at 32 ranks x 256 micro batches) and which `stage_actions` never reads."""
    return type(cls.__name__, (cls,), {"_prepare_schedule_with_comms": lambda self, actions, format=None: None})
