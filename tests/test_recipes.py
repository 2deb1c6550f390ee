"""Every recipe in recipes/ loads and plans at the world size it is written for (no process group)."""

from pathlib import Path

import msgspec
import pytest

from shardlab.cli.recipe import load_recipe
from shardlab.config import ModelConfig
from shardlab.models import provider_for
from shardlab.models.provider import check_layout
from shardlab.training.loop import plan_model

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
WORLD = {
    "llama_debug.py": 1,
    "llama_fsdp.py": 2,
    "llama_fsdp_tp.py": 4,
    "llama_hsdp_tp.py": 8,
    "llama_pp.py": 2,
    "llama_cp.py": 4,
    "moe_fsdp.py": 2,
    "moe_ep.py": 4,
    "moe_ep_tp.py": 4,
    "llama_3d.py": 8,
    "llama3_1b.py": 1,
    "llama3_8b.py": 8,
    "llama3_70b.py": 256,
    "llama3_405b.py": 4096,
    "llama3_405b_pp.py": 512,
    "mixtral_8x7b.py": 64,
    "custom_gpt.py": 4,
    "hf_causal_lm.py": 4,
    "sft_hf.py": 4,
    "qwen3_32b.py": 256,
    "qwen2_5_72b.py": 512,
}
NEEDS_TRANSFORMERS = ("hf_causal_lm.py", "sft_hf.py", "qwen3_32b.py", "qwen2_5_72b.py")


def test_every_recipe_has_a_world():
    assert sorted(p.name for p in RECIPES.glob("*.py")) == sorted(WORLD)


@pytest.mark.parametrize("name", sorted(WORLD))
def test_recipe_plans(name, request):
    if name in NEEDS_TRANSFORMERS:
        pytest.importorskip("transformers")
    recipe = load_recipe(RECIPES / name)
    cfg = recipe.config
    if name in ("hf_causal_lm.py", "sft_hf.py"):
        cfg = msgspec.structs.replace(cfg, model=ModelConfig(hf_path=str(request.getfixturevalue("hf_dir"))))
    cfg = cfg.validated().resolve(WORLD[name])
    provider = provider_for(cfg, recipe.model(cfg))
    check_layout(cfg, provider)
    _, plan = plan_model(cfg, recipe.rules(cfg), provider)
    assert plan.mesh.world_size == WORLD[name]
    assert (plan.pipeline is not None) == (cfg.mesh.pp > 1)


def test_the_search_of_every_recipe_knows_its_world():
    """scripts/search_recipes.py searches each recipe on the world it is written for: a new recipe needs one there."""
    import importlib.util

    path = RECIPES.parent / "scripts" / "search_recipes.py"
    spec = importlib.util.spec_from_file_location("search_recipes", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert set(script.WORLDS) == {p.stem for p in RECIPES.glob("*.py")}
