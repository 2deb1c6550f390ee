"""Which tensors of a Hugging Face checkpoint hold each shardlab parameter.

A dense Llama's names are HF's own. An MoE model maps to Mixtral's layout on disk (what transformers writes and
Mixtral releases use): the router is `block_sparse_moe.gate`, and a stacked expert weight [E, ...] is E tensors
`block_sparse_moe.experts.{e}.w1|w3|w2.weight` (gate, up, down), one per expert, stacked along dim 0.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_EXPERT_WEIGHTS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_MOE = re.compile(r"(model\.layers\.\d+)\.mlp\.(?:(router)\.weight|experts\.(gate_proj|up_proj|down_proj))")


def hf_name(name: str) -> str:
    """The checkpoint name of a parameter held by one tensor (a router's is Mixtral's gate)."""
    m = _MOE.fullmatch(name)
    return f"{m[1]}.block_sparse_moe.gate.weight" if m is not None and m[2] else name


def expert_names(name: str, shape: Sequence[int]) -> tuple[str, ...] | None:
    """The checkpoint names of a stacked expert weight's experts (dim 0 of its `shape`), in order; None for any
    other parameter."""
    m = _MOE.fullmatch(name)
    if m is None or m[3] is None or not shape:
        return None
    return tuple(f"{m[1]}.block_sparse_moe.experts.{e}.{_EXPERT_WEIGHTS[m[3]]}.weight" for e in range(shape[0]))


def llama_names(name: str, shape: Sequence[int]) -> str | tuple[str, ...]:
    """The checkpoint tensor(s) of a shardlab Llama parameter: one name, or one per expert of a stacked weight."""
    return expert_names(name, shape) or hf_name(name)
