"""How a transformers causal LM runs: the whole model with its tokens' positions given (`call_causal_lm`), and one
pipeline stage of it (`TransformersStage`), which runs the model's own forward (rotary tables, masks) over the modules
this rank holds."""

from __future__ import annotations

import weakref

import torch
from torch import nn

from shardlab._errors import ShardlabError


def call_causal_lm(
    model: nn.Module, positions: torch.Tensor | None, output: str = "logits", **feed: torch.Tensor
) -> torch.Tensor:
    """A transformers model's `output` (a causal LM's `logits`, a base model's `last_hidden_state`) for `input_ids`
    or `inputs_embeds` [b, s, ...], with the tokens' positions always given: under sequence or context parallelism
    the tensors a layer sees are shards, from whose length transformers would otherwise count positions. Packed
    rows' positions [b, s] restart at each document, which transformers' masks read as packed sequences."""
    (x,) = feed.values()
    if positions is None:
        positions = torch.arange(x.shape[1], device=x.device)
    position_ids = positions if positions.dim() == 2 else positions.unsqueeze(0)
    return getattr(model(**feed, position_ids=position_ids, use_cache=False), output)


class TransformersStage(nn.Module):
    """This rank's one pipeline stage of a transformers causal LM: the model's own forward (its base model's before
    the last stage, which alone has the head), fed the token ids on the first stage and the previous stage's hidden
    states (`inputs_embeds`) on the others. The other stages' modules are OtherStage, which pass their input on.

    Its children are the model's, so it is the FSDP root of its parameters; the model itself is held by a weak
    reference, not as a submodule (its parameters would show twice): whoever runs the stage holds the model."""

    def __init__(self, model: nn.Module, first: bool, last: bool) -> None:
        super().__init__()
        if next(model.parameters(recurse=False), None) is not None:
            raise ShardlabError(
                f"{type(model).__name__} holds parameters outside its submodules, which its pipeline stage cannot "
                "own; use mesh.pp=1"
            )
        self.parts = nn.ModuleList(model.children())
        self.model = weakref.ref(model)
        self.first, self.last = first, last

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        model = self.model()
        feed = {"input_ids" if self.first else "inputs_embeds": x}
        if self.last:
            return call_causal_lm(model, positions, **feed)
        return call_causal_lm(model.base_model, positions, "last_hidden_state", **feed)
