"""The planner works on any nn.Module by names: an unmodified transformers LlamaForCausalLM, sharded by a
rule table written against its own names, gives the logits of the unsharded model (2 gloo ranks, fp32)."""

import pytest
import torch
import torch.distributed as dist

from shardlab import Activation, MeshSpec, PlanConfig, Rule, Rules, apply, make_mesh, make_plan

transformers = pytest.importorskip("transformers")

HF_RULES = Rules(
    params=(
        Rule(pattern="model.embed_tokens.weight", axes=("vocab", "embed")),
        Rule(pattern="model.layers.*.self_attn.o_proj.weight", axes=("embed", "heads")),
        Rule(pattern="model.layers.*.self_attn.?_proj.weight", axes=("heads", "embed")),  # q, k, v (o: first match)
        Rule(pattern="model.layers.*.mlp.gate_proj.weight", axes=("mlp", "embed")),
        Rule(pattern="model.layers.*.mlp.up_proj.weight", axes=("mlp", "embed")),
        Rule(pattern="model.layers.*.mlp.down_proj.weight", axes=("embed", "mlp")),
        Rule(pattern="**norm.weight", spec=(None,)),
        Rule(pattern="lm_head.weight", axes=("vocab", "embed")),
    ),
    logical=(("vocab", "tp"), ("heads", "tp"), ("mlp", "tp"), ("embed", None), ("batch", None), ("seq", None)),
    # HF's decoder layer calls its submodules with keyword arguments: no sequence parallel here, and the
    # logits are gathered (output replicated) because transformers computes its own loss on full logits.
    activations=(Activation(pattern="lm_head", output=("batch", "seq", "embed")),),
    fsdp_units=(("model.layers.*",),),
    blocks=("model.layers.*",),
)


def hf_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rope_theta=10000.0, attn_implementation="sdpa",
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


def sharded_logits(mesh_spec: MeshSpec) -> tuple[float, dict[str, str]]:
    model = hf_model()
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(tokens).logits
    with torch.device("meta"):
        meta = hf_model()
    plan = make_plan(meta, mesh_spec, HF_RULES, PlanConfig())
    apply(model, plan, make_mesh(mesh_spec))
    with torch.no_grad():
        got = model(tokens).logits
    got = got.full_tensor() if hasattr(got, "full_tensor") else got
    styles = {m.fqn: m.style for m in plan.modules if m.fqn.startswith(("model.layers.0.", "lm_head", "model.embed"))}
    return (got - want).abs().max().item(), styles


def tp2(rank, world_size):
    return sharded_logits(MeshSpec(dp_shard=1, tp=2))


def fsdp2(rank, world_size):
    diff, _ = sharded_logits(MeshSpec(dp_shard=2))
    dist.barrier()
    return diff


CHECKS = [tp2, fsdp2]


@pytest.fixture(scope="module")
def world2(shared_world2):
    return shared_world2


@pytest.mark.world
def test_hf_llama_tensor_parallel_by_names(world2):
    diff, styles = world2.value(tp2)
    assert diff <= 1e-5, diff
    assert styles["model.layers.0.self_attn.q_proj"] == "colwise"
    assert styles["model.layers.0.mlp.down_proj"] == "rowwise"
    assert styles["model.embed_tokens"] == "embedding_rowwise"


@pytest.mark.world
def test_hf_llama_fsdp_by_names(world2):
    assert world2.value(fsdp2) <= 1e-5
