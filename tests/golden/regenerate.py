"""Regenerate the golden plans: `python tests/golden/regenerate.py`, then review the diff of tests/golden/plans/.

Each golden file is `Plan.to_json()` of `make_plan(Llama(size) on meta, mesh, llama_rules(size))` with the default
PlanConfig (sequence parallel, loss parallel), or for `hf-<family>` cases of a small transformers model of that
family with the rules shardlab derives from transformers' TP plan (needs transformers). tests/test_plan.py rebuilds the same plans and compares them with
these files, so any change to the rules, the planner or the model layout shows up as a reviewable JSON diff.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from shardlab.config import PlanConfig
from shardlab.models.llama.model import Llama, llama_config
from shardlab.models.llama.rules import llama_rules
from shardlab.sharding.mesh import MeshSpec
from shardlab.sharding.plan import Plan, make_plan

PLANS_DIR = Path(__file__).resolve().parent / "plans"

CASES: dict[str, tuple[str, MeshSpec]] = {
    # <model size>__<mesh>: (size in shardlab.models.llama.model.SIZES, mesh)
    "debug__dp_shard2xtp2": ("debug", MeshSpec(dp_shard=2, tp=2)),
    "debug__dp_replicate2xdp_shard2": ("debug", MeshSpec(dp_replicate=2, dp_shard=2)),
    "debug__tp2": ("debug", MeshSpec(dp_shard=1, tp=2)),
    "debug__dp_shard2xcp2": ("debug", MeshSpec(dp_shard=2, cp=2)),
    "8B__dp_shard8xtp8": ("8B", MeshSpec(dp_shard=8, tp=8)),
    # hf-<family>: a small transformers model of the family (HF_CONFIGS), rules derived from its TP plan
    **{
        f"hf-{f}__dp_shard2xtp2": (f"hf-{f}", MeshSpec(dp_shard=2, tp=2))
        for f in ("llama", "qwen2", "qwen3", "mistral", "gemma3_text", "mixtral", "qwen3_moe")
    },
    "hf-phi3__dp_shard4": ("hf-phi3", MeshSpec(dp_shard=4)),
}
HF_SHAPE = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2,
}  # fmt: skip
HF_CONFIGS = {
    "llama": {},
    "qwen2": {},
    "qwen3": {"head_dim": 16},
    "mistral": {"sliding_window": 24},
    "gemma3_text": {"head_dim": 16, "sliding_window": 24},
    "phi3": {"pad_token_id": None, "bos_token_id": None, "eos_token_id": None},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 16},
}
"""config.json values per model_type on top of HF_SHAPE (the version of transformers is pinned by the dev extra)."""


def build(name: str) -> Plan:
    """The plan a golden file holds, made now."""
    size, mesh = CASES[name]
    if size.startswith("hf-"):
        from shardlab.models.transformers.provider import HFCausalLM

        family = size.removeprefix("hf-")
        provider = HFCausalLM.from_dict({"model_type": family, **HF_SHAPE, **HF_CONFIGS[family]}, source=family)
        with torch.device("meta"):
            model = provider.build()
        return make_plan(model, mesh, provider.rules(PlanConfig()), PlanConfig())
    cfg = llama_config(size)
    with torch.device("meta"):
        model = Llama(cfg)
    return make_plan(model, mesh, llama_rules(cfg, PlanConfig()), PlanConfig())


def path(name: str) -> Path:
    return PLANS_DIR / f"{name}.json"


def main() -> int:
    PLANS_DIR.mkdir(parents=True, exist_ok=True)
    for name in CASES:
        data = build(name).to_json() + b"\n"
        file = path(name)
        old = file.read_bytes() if file.exists() else None
        file.write_bytes(data)
        state = "unchanged" if old == data else "written" if old is None else "UPDATED"
        print(f"{state:9}  {file.relative_to(Path.cwd()) if file.is_relative_to(Path.cwd()) else file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
