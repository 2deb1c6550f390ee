"""Any model through the whole loop on 4 gloo ranks, each layout reproducing the one-process curve (fp32, 4 steps,
loss within 1e-5, grad norm within 1e-4 relative).

transformers causal LMs trained by directory (`model.hf_path`), starting from the directory's safetensors weights,
their layout derived from transformers' TP plan; every layout on at least one family, each family in FSDP x TP where
tp is allowed:
- Llama: FSDP 2 x TP 2 (+SP, loss parallel), CP 2 x TP 2 (+SP), PP 2 x TP 2 (1F1B; no SP under pp);
- Qwen3: FSDP 2 x TP 2 with full activation checkpointing, CP 2 x FSDP 2, PP 2 x FSDP 2;
- Mistral (a sliding window shorter than the sequence, honoured by the cp attention): FSDP 2 x TP 2, CP 2 x FSDP 2,
  PP 2 x CP 2 (GPipe);
- Qwen2 (q/k/v biases), Gemma 3 text (scaled embeddings, four norms per block, sliding layers, its own attention
  scale): FSDP 2 x TP 2; Gemma 3 also CP 2 x FSDP 2;
- Phi-3 (fused q/k/v, so tp is refused): FSDP 4;
- MoE (stacked experts read from per-expert tensors, split by experts over ep x tp): Mixtral HSDP 2x2, FSDP 2 x TP 2
  (+SP) and FSDP 4 with EP 2 (also with op-level activation checkpointing), Qwen3-MoE TP 2 x DP 2 and FSDP 2 x TP 2 with EP 2 (experts over ep x tp);
- packed rows with document masks (transformers' packed-sequence masks, and the cp attention's): Mistral CP 2 x FSDP 2
  matches one process packing the same documents.
And recipes/custom_gpt.py's own nn.Module (fused QKV, learned positions, GELU): FSDP 2 x TP 2."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from shardlab.cli.recipe import load_recipe
from shardlab.config import MeshSpec, ModelConfig

from ._harness import run_world
from .layouts import assert_matches, curves, packed, tiny, with_plan, write_documents

transformers = pytest.importorskip("transformers")

FAMILIES = {
    "llama": lambda c: transformers.LlamaConfig(**c),
    "qwen3": lambda c: transformers.Qwen3Config(**c, head_dim=16),
    "mistral": lambda c: transformers.MistralConfig(**c, sliding_window=24),
    "qwen2": lambda c: transformers.Qwen2Config(**c),
    "gemma3": lambda c: transformers.Gemma3TextConfig(**c, head_dim=16, sliding_window=24),
    "phi3": lambda c: transformers.Phi3Config(**c, pad_token_id=None, bos_token_id=None, eos_token_id=None),
    "mixtral": lambda c: transformers.MixtralConfig(**c, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": lambda c: transformers.Qwen3MoeConfig(
        **c, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16
    ),
}
SHAPE = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256,
)  # fmt: skip
FSDP_TP = MeshSpec(dp_shard=2, tp=2)
LAYOUTS = {
    "llama": ("fsdp2xtp2", "cp2xtp2", "pp2xtp2-no_sp"),
    "qwen3": ("fsdp2xtp2-ac_full", "cp2xfsdp2", "pp2xfsdp2"),
    "mistral": ("fsdp2xtp2", "cp2xfsdp2", "pp2xcp2-gpipe"),
    "qwen2": ("fsdp2xtp2",),
    "gemma3": ("fsdp2xtp2", "cp2xfsdp2"),
    "phi3": ("fsdp4",),
    "mixtral": ("hsdp2x2", "fsdp2xtp2", "fsdp4-ep2", "fsdp4-ep2-ac_op"),
    "qwen3_moe": ("tp2-no_sp", "fsdp2xtp2-ep2"),
}
"""Every layout on at least one family (FSDP: Phi-3; HSDP: Mixtral), every family in FSDP x TP where tp is allowed."""
STEPS = 4
"""Fewer steps than the other worlds (the suite's time budget); every layout still trains through its warmup."""


def make_dirs(root: Path) -> dict[str, str]:
    """A tiny random model of each family saved as transformers saves it (config.json + model.safetensors)."""
    import torch

    out = {}
    for name, config in FAMILIES.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config(SHAPE))
        model.save_pretrained(root / name)
        out[name] = str(root / name)
    return out


def layout(name: str, hf_path: str):
    base = tiny()
    base = msgspec.structs.replace(base, train=msgspec.structs.replace(base.train, steps=STEPS))
    cfg = msgspec.structs.replace(base, model=ModelConfig(hf_path=hf_path))
    meshes = {
        "one": MeshSpec(dp_shard=1),
        "fsdp4": MeshSpec(dp_shard=4),
        "fsdp4-ep2": MeshSpec(dp_shard=4, ep=2),
        "fsdp2xtp2-ep2": MeshSpec(dp_shard=2, tp=2, ep=2),
        "hsdp2x2": MeshSpec(dp_replicate=2, dp_shard=2),
        "fsdp2xtp2": FSDP_TP,
        "tp2-no_sp": MeshSpec(dp_replicate=2, dp_shard=1, tp=2),
        "fsdp2xtp2-ac_full": FSDP_TP,
        "fsdp4-ep2-ac_op": MeshSpec(dp_shard=4, ep=2),
        "cp2xfsdp2": MeshSpec(dp_shard=2, cp=2),
        "cp2xtp2": MeshSpec(dp_shard=1, cp=2, tp=2),
        "pp2xtp2-no_sp": MeshSpec(pp=2, dp_shard=1, tp=2),
        "pp2xfsdp2": MeshSpec(pp=2, dp_shard=2),
        "pp2xcp2-gpipe": MeshSpec(pp=2, dp_shard=1, cp=2),
    }
    cfg = msgspec.structs.replace(cfg, mesh=meshes[name])
    ac = name.rsplit("-ac_", 1)[1] if "-ac_" in name else "none"
    return with_plan(
        cfg, sequence_parallel=not name.endswith("no_sp"), loss_parallel=True, activation_checkpoint=ac,
        pp_schedule="gpipe" if name.endswith("gpipe") else "1f1b",
    )  # fmt: skip


PACKED = ("mistral", "cp2xfsdp2")
"""The family and layout trained on packed rows with document masks."""


def run(rank, world_size, dirs, docs):
    return {(family, name): curves(layout(name, dirs[family])) for family, names in LAYOUTS.items() for name in names}


def small_gpt():
    """recipes/custom_gpt.py's model at a test's size, and its config."""
    recipe = load_recipe(Path(__file__).parents[2] / "recipes" / "custom_gpt.py")
    provider = recipe.model(recipe.config).with_args(vocab_size=512, dim=64, n_layers=2, n_heads=4, max_seq=64)
    cfg = tiny()
    return provider, msgspec.structs.replace(
        cfg, model=ModelConfig(), train=msgspec.structs.replace(cfg.train, steps=STEPS)
    )


def run_packed(rank, world_size, dirs, docs):
    family, name = PACKED
    return curves(packed(layout(name, dirs[family]), docs))


def custom(rank, world_size, dirs, docs):
    provider, cfg = small_gpt()
    return curves(msgspec.structs.replace(cfg, mesh=FSDP_TP), provider=provider)


CHECKS = [run, custom, run_packed]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return make_dirs(tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    return str(write_documents(tmp_path_factory.mktemp("docs") / "docs.jsonl"))


@pytest.fixture(scope="module")
def world4(dirs, docs):
    return run_world(4, CHECKS, timeout_s=600, dirs=dirs, docs=docs)


@pytest.fixture(scope="module")
def references(dirs):
    return {family: curves(layout("one", dirs[family])) for family in LAYOUTS}


@pytest.mark.world
@pytest.mark.parametrize("family,name", [(f, n) for f, names in LAYOUTS.items() for n in names])
def test_transformers_model_matches_one_process(world4, references, family, name):
    want = references[family]
    assert want["loss"][-1] < want["loss"][0], f"{family}: the one-process loss should fall"
    assert_matches(world4.value(run)[family, name], want, f"{family} {name}", steps=STEPS)


@pytest.mark.world
def test_recipe_model_matches_one_process(world4):
    provider, cfg = small_gpt()
    want = curves(cfg, provider=provider)
    assert want["loss"][-1] < want["loss"][0] - 0.2, "the one-process loss should fall"
    assert_matches(world4.value(custom), want, "custom_gpt fsdp2xtp2", steps=STEPS)


@pytest.mark.world
def test_packed_rows_match_one_process(world4, dirs, docs):
    family, name = PACKED
    want = curves(packed(layout("one", dirs[family]), docs))
    assert want["loss"][-1] < want["loss"][0], f"{family}: the one-process loss should fall"
    assert_matches(world4.value(run_packed), want, f"{family} {name} packed", steps=STEPS)
