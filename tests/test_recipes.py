"""Every recipe in recipes/ loads and plans at the world size it is written for (no process group)."""

from pathlib import Path

import pytest

from shardlab.loop import plan_model
from shardlab.recipe import load_recipe

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
}


def test_every_recipe_has_a_world():
    assert sorted(p.name for p in RECIPES.glob("*.py")) == sorted(WORLD)


@pytest.mark.parametrize("name", sorted(WORLD))
def test_recipe_plans(name):
    recipe = load_recipe(RECIPES / name)
    cfg = recipe.config.validated().resolve(WORLD[name])
    _, plan = plan_model(cfg, recipe.rules(cfg))
    assert plan.mesh.world_size == WORLD[name]
    assert (plan.pipeline is not None) == (cfg.mesh.pp > 1)
