"""Held-out evaluation: every `eval.every` steps, the mean token loss (and perplexity) of the same `eval.steps`
global batches of text that training never sees.

Forward only, without gradients and with the model in eval mode; the training state, its data position and
torch's random state are untouched, so evaluation never changes the training curve. Each rank sums its rows'
token losses; the sums are reduced over the ranks holding different tokens (and over pipeline stages), so the
numbers are the same in every layout. The held-out text is `eval.paths`, or the training data's last documents
(`shardlab.data.documents.hold_out`), which training then leaves out.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import msgspec
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import loss_parallel

from shardlab.config import Config
from shardlab.data.documents import Split
from shardlab.data.loader import TokenLoader, make_loader, run_data
from shardlab.data.tokenizer import Tokenizer
from shardlab.models.provider import ModelProvider
from shardlab.sharding.plan import Plan
from shardlab.training.loss import all_reduce_sum, counted, local_value, summed_loss
from shardlab.training.step import chunks, local_tokens, model_device, step_layout

Evaluate = Callable[[nn.Module, TokenLoader], dict[str, float]]


def train_split(cfg: Config) -> Split:
    """What training reads: everything, or all but the held-out documents when they are the evaluation's."""
    return "train" if cfg.eval.every and not cfg.eval.paths else "all"


def eval_loader(
    cfg: Config, *, vocab_size: int, dp_rank: int, dp_size: int, micro_batches: int, tokenizer: Tokenizer | None
) -> TokenLoader:
    """This rank's rows of the evaluation's global batches (the training batch's shape)."""
    data = run_data(cfg)
    if cfg.eval.paths:
        data = msgspec.structs.replace(data, source="files", paths=cfg.eval.paths)
    return make_loader(
        data, seq_len=cfg.train.seq_len, global_batch=cfg.train.global_batch, vocab_size=vocab_size,
        dp_rank=dp_rank, dp_size=dp_size, micro_batches=micro_batches, tokenizer=tokenizer,
        split="all" if cfg.eval.paths else "held_out", named_by="eval.paths" if cfg.eval.paths else "data.paths",
    )  # fmt: skip


def make_eval(
    cfg: Config,
    plan: Plan,
    mesh: DeviceMesh | None,
    provider: ModelProvider,
    stages: tuple[nn.Module, ...] | None = None,
) -> Evaluate:
    """evaluate(model, loader) -> {"eval_loss", "eval_ppl"} over the loader's first `eval.steps` batches. stages: as
    `make_step`'s."""
    cfg = cfg.resolve(plan.mesh.world_size)
    micro_batches, positions, group, pipeline = step_layout(cfg, plan, mesh, stages)
    stage_group = pipeline.group if pipeline is not None else None

    @torch.no_grad()
    def evaluate(model: nn.Module, loader: TokenLoader) -> dict[str, float]:
        device = model_device(model)
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        tokens = torch.zeros((), dtype=torch.float64, device=device)
        training = model.training
        model.train(False)
        try:
            for k in range(cfg.eval.steps):
                inputs, labels, at = local_tokens(loader.batch(k), positions, device)
                tokens += counted(labels)
                if pipeline is not None:
                    loss_sum += pipeline.evaluate(model, inputs, labels, positions=at)
                    continue
                for x, y, p in zip(inputs.chunk(micro_batches), labels.chunk(micro_batches), chunks(at, micro_batches)):
                    with loss_parallel() if plan.loss_parallel else contextlib.nullcontext():
                        loss = summed_loss(provider.forward(model, x, p), y)
                    loss_sum += local_value(loss).to(torch.float64)
        finally:
            model.train(training)
        total = all_reduce_sum(all_reduce_sum(loss_sum, stage_group), group)  # only the last stage has a loss
        mean = (total / all_reduce_sum(tokens, group)).item()
        return {"eval_loss": mean, "eval_ppl": math.exp(min(mean, 700.0))}

    return evaluate
