"""Parallel code and the estimator write nothing onto the model's modules, torch's DeviceMesh or the provider: what
they hand a model goes in with each call (the keywords `attend` and `dispatch` its forward declares), and what they
build beside it (pipeline stages, the expert mesh, block counts) is returned to the caller.

Run: pytest tests/test_outside_state.py (fake worlds; a few seconds).
"""

from __future__ import annotations

import msgspec
import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from shardlab import Config, MeshSpec, ModelConfig, MoEConfig, PlanConfig, TrainConfig, apply, make_mesh
from shardlab.estimate._fake import fake_world
from shardlab.models.llama.model import Attention
from shardlab.models.llama.moe import Experts
from shardlab.parallel.apply import parallelize
from shardlab.parallel.stages import StageModule
from shardlab.sharding.mesh import AXES
from shardlab.training.loop import plan_model

TINY = ModelConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256)
TORCH_KEYS = ("_fsdp", "_is_fsdp", "__composable_api_state_key", "_distribute_module_applied")
"""What torch's own fully_shard and parallelize_module record in a module's __dict__ (their bookkeeping)."""


def own_state(model: torch.nn.Module) -> dict[int, tuple[torch.nn.Module, str, dict[str, object]]]:
    """Each module's __dict__ as it is now: id(module) -> (the module, its name, {key: value}). The module is kept
    alive with it: a module dropped from the model and freed could leave its id to a new one."""
    return {id(m): (m, name, dict(vars(m))) for name, m in model.named_modules()}


def changed_by(model: torch.nn.Module, before: dict[int, tuple[torch.nn.Module, str, dict[str, object]]]) -> list[str]:
    """Attributes of the modules in `before` that were set or rebound since, but for torch's FSDP bookkeeping (the
    dicts torch keeps parameters, submodules and hooks in stay the same objects: their contents may change)."""
    out = []
    for m in model.modules():
        if id(m) not in before:
            continue
        _, name, was = before[id(m)]
        for key, value in vars(m).items():
            if key.startswith(TORCH_KEYS):
                continue
            if key not in was or was[key] is not value:
                out.append(f"{name or '(root)'}.{key}")
    return out


def given_by_apply(module: torch.nn.Module) -> dict[str, object]:
    """The keywords apply's forward pre-hooks add to a call of `module` (torch's own hooks, FSDP's, left out)."""
    given: dict[str, object] = {}
    for hook in module._forward_pre_hooks.values():
        if getattr(hook, "__module__", None) == "shardlab.parallel.apply":
            given |= hook(module, (), {})[1]
    return given


def config(mesh: MeshSpec, model: ModelConfig = TINY, **plan) -> Config:
    return Config(mesh=mesh, model=model, plan=PlanConfig(**plan), train=TrainConfig(seq_len=64)).resolve(
        mesh.world_size
    )


MOE = msgspec.structs.replace(TINY, moe=MoEConfig(n_experts=4, expert_ffn_dim=64))
LAYOUTS = {
    "cp2": config(MeshSpec(dp_shard=1, cp=2)),
    "fsdp2_ep2": config(MeshSpec(dp_shard=2, ep=2), MOE),
    "cp2_ep2_tp2": config(MeshSpec(dp_shard=1, cp=2, tp=2, ep=2), MOE),
    "pp2_interleaved": config(MeshSpec(pp=2, dp_shard=1), pp_schedule="interleaved_1f1b", pp_stages_per_rank=2),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_apply_sets_nothing_on_the_modules_nor_on_the_mesh(layout):
    cfg = LAYOUTS[layout]
    model, plan = plan_model(cfg)
    before = own_state(model)
    with fake_world(cfg.mesh.world_size, 0):
        mesh = make_mesh(cfg.mesh, "cpu")
        plain = init_device_mesh("cpu", cfg.mesh.axis_sizes, mesh_dim_names=AXES)
        assert set(vars(mesh)) == set(vars(plain)), "make_mesh keeps something of its own on torch's DeviceMesh"
        on_mesh = dict(vars(mesh))
        built = parallelize(model, plan, mesh)
        assert all(vars(mesh)[k] is v for k, v in on_mesh.items()) and set(vars(mesh)) == set(on_mesh)
    assert built.model is model
    assert changed_by(model, before) == []
    for m in model.modules():
        assert "attend" not in vars(m) and "dispatch" not in vars(m), type(m).__name__
    if plan.context is not None:  # every attention module gets the cp attention with each call
        for fqn in plan.context.modules:
            module = model.get_submodule(fqn)
            assert callable(given_by_apply(module).get("attend")), fqn
    if plan.experts is not None:
        assert built.experts is not None and built.experts.mesh_dim_names == ("dp_replicate", "dp_shard_mod_ep", "ep")
        for fqn in plan.experts.modules:
            module = model.get_submodule(fqn)
            assert callable(given_by_apply(module).get("dispatch")), fqn
    if plan.pipeline is not None:  # two stages on this rank: the modules the step must run, returned
        assert len(built.stages) == 2 and all(isinstance(s, StageModule) for s in built.stages)
    else:
        assert built.stages == (model,)


def test_apply_still_returns_the_model():
    cfg = LAYOUTS["pp2_interleaved"]
    model, plan = plan_model(cfg)
    with fake_world(2, 0):
        assert apply(model, plan, make_mesh(cfg.mesh, "cpu")) is model


def test_a_step_without_the_stages_apply_built_says_to_pass_them():
    """The stage modules live with the caller, not in a registry: a pipeline step given none where the rank runs
    modules built beside the model says so in one line, before any schedule runs the wrong module."""
    from shardlab import ShardlabError
    from shardlab.training.pipeline_schedule import PipelineRun

    cfg = LAYOUTS["pp2_interleaved"]
    model, plan = plan_model(cfg)
    with fake_world(2, 0):
        mesh = make_mesh(cfg.mesh, "cpu")
        built = parallelize(model, plan, mesh)
        with pytest.raises(ShardlabError, match=r"pass the stages parallelize\(model, plan, mesh\) returns"):
            PipelineRun(plan, mesh)._schedule_for(model, torch.device("cpu"))
        assert PipelineRun(plan, mesh, built.stages)._schedule_for(model, torch.device("cpu")) is not None


def test_llamas_attention_and_experts_run_what_their_call_gives_them():
    """The keywords the modules declare are the ones they run: no slot, so nothing to forget to reset."""
    attention = Attention(TINY)
    seen = []

    def attend(q, k, v, positions):
        seen.append(tuple(positions.shape))
        return torch.zeros_like(q)

    x = torch.randn(1, 8, TINY.dim)
    assert attention(x, attend=attend).abs().sum() == 0 and seen == [(8,)]
    assert attention(x).abs().sum() > 0  # causal attention again: the call before left nothing behind

    experts = Experts(2, 8, 16)
    for w in experts.parameters():
        torch.nn.init.normal_(w)
    rows = torch.randn(3, 8)
    ran = []
    out = experts(rows, [1, 2], dispatch=lambda compute, r, c: ran.append(c) or compute(r, c))
    assert ran == [[1, 2]] and torch.allclose(out, experts(rows, [1, 2]))


def test_transformers_attention_takes_attend_from_its_call():
    """shardlab's transformers attention function reads `attend` from the keywords transformers hands it, and the
    built model's modules carry no slot for it."""
    pytest.importorskip("transformers")
    from shardlab.models.transformers.provider import HFCausalLM, _attention

    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256)  # fmt: skip
    provider = HFCausalLM.from_dict({"model_type": "llama", **shape}, "llama")
    model = provider.meta_model()
    for m in model.modules():
        assert "attend" not in vars(m), type(m).__name__
    module = model.get_submodule("model.layers.0.self_attn")
    q, k, v = torch.randn(1, 4, 6, 16), torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16)
    positions = torch.arange(6)[None]
    given = []

    def attend(q, k, v, positions, *, scale=None, window=None):
        given.append((tuple(positions.shape), scale, window))
        return torch.ones_like(q)

    out, _ = _attention(module, q, k, v, None, scaling=0.25, position_ids=positions, attend=attend)
    assert given == [((1, 6), 0.25, None)] and out.shape == (1, 6, 4, 16) and bool((out == 1).all())


def test_floors_keep_nothing_on_the_provider():
    """The floors' block counts go to the caller's cache (`blocks`), not into the provider, a user's object."""
    from shardlab.estimate.devices import device
    from shardlab.estimate.floors import Floors
    from shardlab.models.llama.provider import LlamaProvider

    provider = LlamaProvider(msgspec.structs.replace(TINY, n_layers=2))
    model = provider.meta_model()  # the provider's own cache of its model, made before the snapshot
    was = dict(vars(provider))
    c = Config(model=provider.cfg, train=TrainConfig(global_batch=2, seq_len=64))
    blocks: dict = {}
    floors = Floors.of(c, provider, model, device("h100"), own_rules=False, blocks=blocks)
    assert vars(provider) == was and all(vars(provider)[k] is v for k, v in was.items())
    assert len(blocks) == 1 and next(iter(blocks.values())) is floors.block and floors.block is not None
    again = Floors.of(c, provider, model, device("h100"), own_rules=False, blocks=blocks)
    assert again.block is floors.block  # read from the caller's cache, not counted again
