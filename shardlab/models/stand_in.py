"""OtherStage: what stands in for the modules another pipeline rank holds, so this rank builds, initialises and
checkpoints only its own while every parameter keeps the whole model's name."""

from __future__ import annotations

import torch
from torch import nn


class OtherStage(nn.Identity):
    """What stands in for another pipeline stage's module: passes its input on, whatever keywords come with it
    (a block's `positions`), and keeps the replaced module's plain attributes (a transformers layer's
    `attention_type`, which the model's forward reads to pick the layer's mask)."""

    def __init__(self, like: nn.Module | None = None) -> None:
        super().__init__()
        if like is not None:
            for name, value in vars(like).items():
                if not name.startswith("_") and name != "training" and isinstance(value, (str, int, float, bool)):
                    setattr(self, name, value)

    def forward(self, x: torch.Tensor, *_: object, **__: object) -> torch.Tensor:
        return x
