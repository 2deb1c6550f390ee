"""Model providers: the config picks one (shardlab's Llama, a transformers directory), and everything shardlab asks
of a model (build, init, rules, logits, FLOPs, divisibility, shallower copies, identity) it answers; bad
directories and unsupported layouts fail in one line before anything launches."""

from __future__ import annotations

import json
import re

import msgspec
import pytest
import torch

from shardlab.config import Config, MeshSpec, ModelConfig, PlanConfig
from shardlab.models import provider_for
from shardlab.models.llama.provider import LlamaProvider
from shardlab.models.provider import check_layout, first_difference
from shardlab.training.loop import plan_model

transformers = pytest.importorskip("transformers")

from shardlab.models.transformers.provider import HFCausalLM  # noqa: E402

SHAPE = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2,
)  # fmt: skip


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3")
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(**SHAPE, head_dim=16)).save_pretrained(root)
    return root


MOE = {
    "mixtral": lambda: transformers.MixtralConfig(**SHAPE, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **SHAPE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16
    ),
}
"""MoE families whose checkpoints transformers converts on load (per-expert tensors <-> stacked experts)."""


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, qwen3_dir):
    out = {"qwen3": qwen3_dir}
    for name, config in MOE.items():
        out[name] = tmp_path_factory.mktemp(name)
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config()).save_pretrained(out[name])
    return out


def hf_cfg(path, mesh: MeshSpec = MeshSpec(dp_shard=1), **plan) -> Config:
    return Config(mesh=mesh, model=ModelConfig(hf_path=str(path)), plan=PlanConfig(**plan))


def test_the_config_names_the_provider(qwen3_dir):
    assert isinstance(provider_for(Config()), LlamaProvider)
    p = provider_for(hf_cfg(qwen3_dir))
    assert isinstance(p, HFCausalLM) and p.name == "transformers Qwen3ForCausalLM"
    assert (p.n_layers, p.vocab_size, p.dim) == (3, 512, 64)


@pytest.mark.world  # a fresh interpreter importing torch and transformers: the full suite's tier
def test_transformers_model_classes_import_torchao_without_a_word():
    """transformers' model classes import torchao where it is installed, whose import logs warnings about torch's
    pytree registry and its CPU build: shardlab imports them quietly, so an estimate or a run prints none of it."""
    import subprocess
    import sys

    pytest.importorskip("torchao")
    code = ("import sys; from shardlab.models.transformers.provider import _transformers; _transformers(); "
            "assert 'torchao' in sys.modules")  # fmt: skip
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stderr == "", run.stderr


def test_llama_fields_beside_hf_path_are_refused():
    with pytest.raises(ValueError, match=r"model.dim is set but model.hf_path is too.*drop --model.dim"):
        ModelConfig(hf_path="somewhere", dim=512)
    with pytest.raises(ValueError, match=r"model.from_scratch is set without model.hf_path"):
        ModelConfig(from_scratch=True)


def test_bad_directories_fail_in_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"model.hf_path='.*nowhere': no .*config.json; pass a local transformers"):
        provider_for(hf_cfg(tmp_path / "nowhere"))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config.json: not readable JSON"):
        provider_for(hf_cfg(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "vit", "hidden_size": 64}))
    with pytest.raises(ValueError, match=r"model_type='vit' has no causal-LM class in transformers"):
        provider_for(hf_cfg(tmp_path))


def test_weights_are_functions_of_seed_and_name(qwen3_dir):
    """Each module is drawn from (seed, its name): two builds agree, a shallower copy has the same first blocks,
    and another seed differs."""
    p = HFCausalLM.from_dir(qwen3_dir)

    def built(provider, seed):
        with torch.device("meta"):
            m = provider.build()
        return provider.materialize(m, "cpu", seed).state_dict()

    a, b, shallow, other = built(p, 1), built(p, 1), built(p.with_layers(2), 1), built(p, 2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(a[k], v) for k, v in shallow.items())
    assert not torch.equal(a["model.layers.0.self_attn.q_proj.weight"], other["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(a["model.layers.0.input_layernorm.weight"], torch.ones(64))
    assert len(shallow) < len(a)


def test_logits_are_the_models_own(qwen3_dir):
    p = HFCausalLM.from_dir(qwen3_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(qwen3_dir)
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(p.forward(model, tokens), model(tokens).logits)


def test_flops_count_the_matmuls_and_attention(qwen3_dir):
    p = HFCausalLM.from_dir(qwen3_dir)
    with torch.device("meta"):
        model = p.build()
    n = sum(q.numel() for q in model.parameters()) - 512 * 64  # the untied embedding is a lookup
    assert p.flops_per_token(128) == 6 * n + 12 * 3 * 64 * 128


def test_tp_must_divide_the_heads(qwen3_dir):
    cfg = hf_cfg(qwen3_dir, MeshSpec(dp_shard=1, tp=4), sequence_parallel=False)
    with pytest.raises(ValueError, match=r"config.json num_key_value_heads=2 is not divisible by mesh.tp=4"):
        check_layout(cfg, provider_for(cfg))


def test_expert_parallelism_needs_stacked_experts_it_divides(dirs):
    cfg = hf_cfg(dirs["qwen3"], MeshSpec(dp_shard=2, ep=2))
    with pytest.raises(ValueError, match=r"mesh.ep=2, but the model has no stacked experts to split over ep"):
        check_layout(cfg, provider_for(cfg))
    cfg = hf_cfg(dirs["mixtral"], MeshSpec(dp_shard=4, ep=4, tp=2))
    with pytest.raises(ValueError, match=r"4 experts do not split over mesh.ep=4 x mesh.tp=2"):
        check_layout(cfg, provider_for(cfg))
    cfg = hf_cfg(dirs["mixtral"], MeshSpec(dp_shard=2, ep=2, tp=2))
    check_layout(cfg, provider_for(cfg))
    _, plan = plan_model(cfg)
    assert plan.experts.stacked and plan.experts.ep == 2 and plan.experts.tensor_parallel
    assert plan.param("model.layers.0.mlp.experts.down_proj").spec[0] == ("ep", "tp")


def test_estimate_prices_the_expert_parallel_gathers(dirs):
    """The fake world runs transformers' grouped matmuls (in fp32 too) and counts their FLOPs; ep gathers the
    group's tokens, routing weights and ids, and reduce-scatters the outputs, once per MoE layer."""
    from shardlab.estimate import estimate
    from shardlab.estimate.devices import device

    cfg = hf_cfg(dirs["mixtral"], MeshSpec(dp_shard=4, ep=2)).resolve(4)
    _, plan = plan_model(cfg)
    e = estimate(cfg, plan, dev=device("h100"))
    by_axis = {(x.axis, x.kind, x.phase): x.bytes for x in e.collectives}
    tokens = cfg.train.global_batch // 4 // cfg.micro_batches * cfg.train.seq_len  # this rank's micro batch
    layers, top_k, dim = SHAPE["num_hidden_layers"], 2, SHAPE["hidden_size"]
    assert by_axis["ep", "all_gather", "forward"] == layers * 2 * tokens * (dim * 4 + top_k * (4 + 8))
    assert by_axis["ep", "reduce_scatter", "forward"] == layers * 2 * tokens * dim * 4  # the gathered outputs
    one = estimate(hf_cfg(dirs["mixtral"]).resolve(1), plan_model(hf_cfg(dirs["mixtral"]))[1], dev=device("h100"))
    assert e.executed_flops * 4 == pytest.approx(one.executed_flops, rel=0.02)  # the same work, split 4 ways


def test_pipelines_take_what_a_stage_can_feed_the_model(qwen3_dir):
    """A later stage feeds transformers its hidden states as inputs_embeds: one stage per rank, no sequence
    parallelism (masks are sized by what a stage receives), no forward that changes the hidden states outside its
    modules (Gemma 2 scales its embeddings there); the plan says how stages call the model."""
    cfg = hf_cfg(qwen3_dir, MeshSpec(pp=2, dp_shard=1, tp=2))
    with pytest.raises(ValueError, match=r"mesh.pp=2 with sequence parallelism.*plan.sequence_parallel=False"):
        check_layout(cfg, provider_for(cfg))
    ok = hf_cfg(qwen3_dir, MeshSpec(pp=2, dp_shard=1, tp=2), sequence_parallel=False)
    check_layout(ok, provider_for(ok))
    _, plan = plan_model(ok)
    assert plan.pipeline.call == "transformers" and len(plan.pipeline.stages) == 2
    looped = hf_cfg(qwen3_dir, MeshSpec(pp=2, dp_shard=1), pp_schedule="interleaved_1f1b", pp_stages_per_rank=2)
    with pytest.raises(ValueError, match=r"plan.pp_stages_per_rank=2: a transformers model's forward runs whole"):
        plan_model(msgspec.structs.replace(looped, model=ModelConfig(hf_path=str(qwen3_dir))))
    gemma2 = {"model_type": "gemma2", **SHAPE, "head_dim": 16, "pad_token_id": 0, "attn_logit_softcapping": None}
    with pytest.raises(ValueError, match=r"mesh.pp=2, but the model's forward changes the hidden states"):
        HFCausalLM.from_dict(gemma2, "gemma2").check(Config(mesh=MeshSpec(pp=2, dp_shard=1)))
    HFCausalLM.from_dict(gemma2, "gemma2").check(Config(mesh=MeshSpec(dp_shard=2)))
    capped = HFCausalLM.from_dict(gemma2 | {"attn_logit_softcapping": 50.0}, "gemma2")  # Gemma 2's default
    with pytest.raises(ValueError, match=r"attn_logit_softcapping=50.0, which the attention shardlab builds"):
        capped.check(Config(mesh=MeshSpec(dp_shard=2)))


def test_fused_projections_refuse_tensor_parallelism():
    p = HFCausalLM.from_dict(
        {"model_type": "phi3", **SHAPE, "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}, "phi3"
    )
    cfg = Config(mesh=MeshSpec(dp_shard=2, tp=2))
    with pytest.raises(ValueError, match=r"qkv_proj is a fused weight.*use mesh.tp=1"):
        p.check(cfg)
    p.check(Config(mesh=MeshSpec(dp_shard=4)))  # FSDP is fine


def test_a_model_without_a_tensor_parallel_plan_for_its_blocks_refuses_tp():
    p = HFCausalLM.from_dict({"model_type": "stablelm", **SHAPE}, "stablelm")  # transformers ships no plan for it
    with pytest.raises(ValueError, match=r"no tensor-parallel plan for this model's blocks.*use mesh.tp=1"):
        p.check(Config(mesh=MeshSpec(dp_shard=2, tp=2)))
    p.check(Config(mesh=MeshSpec(dp_shard=4)))
    HFCausalLM.from_dict({"model_type": "qwen3", **SHAPE}, "qwen3").check(Config(mesh=MeshSpec(dp_shard=2, tp=2)))


def test_norms_with_a_weight_per_head_refuse_tp():
    cohere = {"model_type": "cohere", **SHAPE, "use_qk_norm": True}
    with pytest.raises(ValueError, match=r"q_norm normalises each head with weights of its own.*use mesh.tp=1"):
        HFCausalLM.from_dict(cohere, "cohere").check(Config(mesh=MeshSpec(dp_shard=2, tp=2)))
    HFCausalLM.from_dict(cohere, "cohere").check(Config(mesh=MeshSpec(dp_shard=4)))
    HFCausalLM.from_dict(cohere | {"use_qk_norm": False}, "cohere").check(Config(mesh=MeshSpec(dp_shard=2, tp=2)))


def test_norms_over_all_heads_refuse_tp_for_that_reason():
    """OLMo2's q/k norms have one weight across every head's features: tp is refused naming the norm and why, not
    as a fused weight (its q_proj is a plain projection, which transformers' plan gathers for the norm)."""
    olmo2 = {"model_type": "olmo2", **SHAPE, "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}
    with pytest.raises(ValueError) as err:
        HFCausalLM.from_dict(olmo2, "olmo2").check(Config(mesh=MeshSpec(dp_shard=2, tp=2)))
    assert re.search(
        r"model\.layers\.0\.self_attn\.q_norm normalises over all heads together \(one weight across their 64 "
        r"features\), which a rank holding a share of the heads cannot compute; use mesh\.tp=1",
        str(err.value),
    ), err.value
    assert "fused" not in str(err.value)
    HFCausalLM.from_dict(olmo2, "olmo2").check(Config(mesh=MeshSpec(dp_shard=4)))  # FSDP is fine
    qwen3 = HFCausalLM.from_dict({"model_type": "qwen3", **SHAPE}, "qwen3")  # q/k norms of head_dim: per head
    qwen3.check(Config(mesh=MeshSpec(dp_shard=2, tp=2)))


def test_attention_given_the_hidden_states_by_position_refuses_sequence_parallelism():
    neox = HFCausalLM.from_dict({"model_type": "gpt_neox", **SHAPE}, "gpt_neox")  # attention(norm(x), ...)
    with pytest.raises(ValueError, match=r"hand gpt_neox.layers.0.attention its hidden states by position.*set plan"):
        neox.check(Config(mesh=MeshSpec(dp_shard=2, tp=2)))
    neox.check(Config(mesh=MeshSpec(dp_shard=2, tp=2), plan=PlanConfig(sequence_parallel=False)))


def test_an_encoder_trains_as_a_causal_lm_only_as_a_decoder():
    bert = {"model_type": "bert", **SHAPE}
    with pytest.raises(ValueError, match=r'bert is an encoder .* unless config.json sets "is_decoder": true'):
        HFCausalLM.from_dict(bert, "bert").check(Config(mesh=MeshSpec(dp_shard=1)))
    HFCausalLM.from_dict(bert | {"is_decoder": True}, "bert").check(Config(mesh=MeshSpec(dp_shard=1)))
    bart = {"model_type": "bart", "vocab_size": 512, "d_model": 64, "decoder_layers": 2, "encoder_layers": 2,
            "decoder_attention_heads": 4, "encoder_attention_heads": 4, "decoder_ffn_dim": 128, "encoder_ffn_dim": 128}  # fmt: skip
    HFCausalLM.from_dict(bart, "bart").check(Config(mesh=MeshSpec(dp_shard=1)))  # its causal class is a decoder


def test_weights_in_files_shardlab_does_not_read_are_refused_not_ignored(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", **SHAPE}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    p = HFCausalLM.from_dir(tmp_path)
    with pytest.raises(ValueError, match=r"the weights are in pytorch_model.bin, but shardlab reads only model.safet"):
        p.check(hf_cfg(tmp_path))
    p.check(Config(model=ModelConfig(hf_path=str(tmp_path), from_scratch=True)))


def test_identity_round_trips_and_names_what_differs(qwen3_dir):
    p = HFCausalLM.from_dir(qwen3_dir)
    assert HFCausalLM.from_identity(p.identity()).identity() == p.identity()
    deeper = p.with_layers(4)
    assert first_difference(p.identity(), deeper.identity()) == "config.json:num_hidden_layers"


def test_plan_is_derived_and_explained(qwen3_dir):
    cfg = hf_cfg(qwen3_dir, MeshSpec(dp_shard=2, tp=2)).resolve(4)
    _, plan = plan_model(cfg)
    assert plan.param("model.layers.1.self_attn.k_proj.weight").spec == (("tp", "dp_shard"), None)
    assert plan.param("model.layers.1.self_attn.o_proj.weight").spec == ("dp_shard", "tp")
    styles = {m.fqn: m.style for m in plan.modules}
    assert styles["model.layers.0.self_attn.q_norm"] == "sequence_parallel"  # replicated_with_grad_allreduce
    assert styles["model.layers.0"] == "prepare_input"  # the first block takes its sequence shard
    assert "model.layers.*.self_attn.q_proj.weight" in plan.explain("model.layers.2.self_attn.q_proj.weight")


def test_llama_identity_is_its_model_fields():
    a = LlamaProvider(ModelConfig()).identity()
    b = LlamaProvider(msgspec.structs.replace(ModelConfig(), ffn_dim=64)).identity()
    assert first_difference(a, b) == "model.ffn_dim"


@pytest.mark.parametrize("family", ["qwen3", "mixtral"])
def test_export_round_trips_a_transformers_model(dirs, family, tmp_path):
    """Trained from its directory's weights, saved, exported: transformers loads the export with the trained model's
    logits, and the export does not need the directory it came from. Mixtral's stacked experts are written back
    as transformers writes them (one w1, w3, w2 per expert)."""
    import shutil

    qwen3_dir = shutil.copytree(dirs[family], tmp_path / "source")  # removed before the export
    from shardlab.data.loader import make_loader
    from shardlab.hf import load_hf_weights
    from shardlab.training.checkpoint import save
    from shardlab.training.export import export_to_hf
    from shardlab.training.loop import build_model
    from shardlab.training.step import init_state, make_step

    cfg = msgspec.structs.replace(hf_cfg(qwen3_dir), train=msgspec.structs.replace(Config().train, seq_len=32))
    provider = provider_for(cfg)
    model, plan, mesh = build_model(cfg, provider=provider)
    load_hf_weights(model, qwen3_dir, provider.hf_names)
    state, step = init_state(model, cfg.optim), make_step(cfg, plan, mesh, provider)
    loader = make_loader(cfg.data, seq_len=32, global_batch=4, vocab_size=512, dp_rank=0, dp_size=1)
    for _ in range(2):
        state, _ = step(state, next(loader))
    save(state, loader, cfg, tmp_path / "checkpoints", provider=provider)
    shutil.rmtree(qwen3_dir)
    export_to_hf(tmp_path, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == {"qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM"}[family]
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, provider.forward(model, tokens), atol=1e-5, rtol=0)


def gpt_provider(**kwargs):
    """recipes/custom_gpt.py's own model at a test's size."""
    from pathlib import Path

    from shardlab.cli.recipe import load_recipe

    recipe = load_recipe(Path(__file__).parents[1] / "recipes" / "custom_gpt.py")
    args = dict(vocab_size=300, dim=64, n_layers=2, n_heads=4, max_seq=32) | kwargs
    return recipe.model(recipe.config).with_args(**args)


def test_a_recipe_model_exports_as_the_transformers_class_it_names(tmp_path):
    """GPT's head-major fused QKV and [out, in] weights become GPT2LMHeadModel's q|k|v blocks and Conv1D [in, out]:
    transformers loads the directory and gives the same logits."""
    from shardlab.hf import to_hf

    provider = gpt_provider()
    model = provider.build()
    provider.init_weights(model, seed=3)
    to_hf(model, tmp_path / "hf", provider=provider)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "GPT2LMHeadModel"
    tokens = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model.eval()(tokens), atol=1e-5, rtol=0)


def test_a_wrong_export_mapping_is_one_line_before_anything_is_written(tmp_path):
    import dataclasses

    from shardlab.hf import to_hf

    provider = gpt_provider()
    model = provider.build()
    right = provider.hf.tensors

    def drop_positions(name, t, **kw):
        return [] if name == "wpe.weight" else right(name, t, **kw)

    def untransposed(name, t, **kw):
        return [(n, w.T if n.endswith("c_fc.weight") else w) for n, w in right(name, t, **kw)]

    cases = [
        (dataclasses.replace(provider.hf, tensors=drop_positions), r"writes no 'transformer.wpe.weight' \(and 0 more"),
        (dataclasses.replace(provider.hf, tensors=untransposed), r"'transformer.h.0.mlp.c_fc.weight' with shape \(256, 64\)"),
        (dataclasses.replace(provider.hf, architecture="GPT3"), r"'GPT3' is not a transformers model class"),
    ]  # fmt: skip
    for hf, message in cases:
        provider.hf = hf
        with pytest.raises(ValueError, match=message):
            to_hf(model, tmp_path / "hf", provider=provider)
        assert not (tmp_path / "hf").exists()
    provider.hf = None
    with pytest.raises(ValueError, match=r"no transformers class is named for this model.*hf=HFExport"):
        to_hf(model, tmp_path / "hf", provider=provider)


def test_a_recipe_model_checkpoint_exports_with_its_recipe(tmp_path):
    """`export` needs the recipe of a recipe's own model, and refuses one whose model differs from the checkpoint's."""
    from shardlab.data.loader import make_loader
    from shardlab.training.checkpoint import save
    from shardlab.training.export import export_to_hf
    from shardlab.training.loop import build_model
    from shardlab.training.step import init_state

    provider = gpt_provider()
    cfg = msgspec.structs.replace(Config(), train=msgspec.structs.replace(Config().train, seq_len=32, global_batch=2))
    model, _, _ = build_model(cfg, provider=provider)
    loader = make_loader(cfg.data, seq_len=32, global_batch=2, vocab_size=300, dp_rank=0, dp_size=1)
    save(init_state(model, cfg.optim), loader, cfg, tmp_path / "checkpoints", provider=provider)
    with pytest.raises(ValueError, match=r"holds a recipe's own model \(.*GPT\); pass its recipe: `export RUN_DIR"):
        export_to_hf(tmp_path, tmp_path / "hf")
    with pytest.raises(ValueError, match=r"differs from the checkpoint's in model.dim \(checkpoint 64, recipe 32\)"):
        export_to_hf(tmp_path, tmp_path / "hf", gpt_provider(dim=32))
    export_to_hf(tmp_path, tmp_path / "hf", provider)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model.eval()(tokens), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"holds shardlab's Llama, not a recipe's own model; leave out --recipe"):
        llama = tmp_path / "llama"
        model, _, _ = build_model(Config())
        save(init_state(model, cfg.optim), loader, Config(), llama / "checkpoints")
        export_to_hf(llama, tmp_path / "hf2", provider)


@pytest.mark.parametrize(
    "family,from_scratch", [("qwen3", False), ("qwen3", True), ("mixtral", False), ("qwen3_moe", False)]
)
def test_training_starts_from_the_directory_weights(dirs, family, tmp_path, from_scratch):
    """The first step's loss is the saved model's loss on the first batch, unless model.from_scratch; MoE
    directories hold per-expert tensors, which become the stacked experts transformers builds."""
    qwen3_dir = dirs[family]
    import torch.nn.functional as F

    from shardlab.config import LogConfig, TrainConfig
    from shardlab.data.loader import make_loader
    from shardlab.training.loop import train

    cfg = Config(
        model=ModelConfig(hf_path=str(qwen3_dir), from_scratch=from_scratch),
        train=TrainConfig(steps=1, global_batch=4, seq_len=32, run_dir=str(tmp_path)),
        log=LogConfig(wandb="disabled", progress=False),
    )
    got = train(cfg, write=False)[0]["loss"]
    batch = next(make_loader(cfg.data, seq_len=32, global_batch=4, vocab_size=512, dp_rank=0, dp_size=1))
    hf = transformers.AutoModelForCausalLM.from_pretrained(qwen3_dir)
    with torch.no_grad():
        want = F.cross_entropy(hf(batch.inputs).logits.flatten(0, 1), batch.labels.flatten()).item()
    assert (abs(got - want) < 1e-5) != from_scratch, (got, want)


def test_moe_checkpoint_names_are_transformers_own(dirs, tmp_path):
    """Read off transformers' conversion: each expert's slice of gate_up_proj is its w1 rows, then its w3 rows; a
    directory missing an expert's tensor fails in one line before launch."""
    import shutil

    from safetensors.torch import load_file, save_file

    provider = HFCausalLM.from_dir(dirs["mixtral"])
    names = provider.hf_names("model.layers.0.mlp.experts.gate_up_proj", (4, 256, 64))
    prefix = "model.layers.0.block_sparse_moe.experts"
    assert names[1] == (f"{prefix}.1.w1.weight", f"{prefix}.1.w3.weight")
    assert provider.hf_names("model.layers.0.mlp.experts.down_proj", (4, 64, 128))[3] == f"{prefix}.3.w2.weight"
    assert provider.hf_names("model.layers.0.mlp.gate.weight", (4, 64)) == "model.layers.0.block_sparse_moe.gate.weight"
    shutil.copytree(dirs["mixtral"], tmp_path / "m")
    tensors = load_file(tmp_path / "m" / "model.safetensors")
    del tensors[f"{prefix}.2.w3.weight"]
    save_file(tensors, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    cfg = Config(model=ModelConfig(hf_path=str(tmp_path / "m")), mesh=MeshSpec(dp_shard=1))
    with pytest.raises(ValueError, match=rf"no tensor '{prefix}.2.w3.weight' for model.layers.0.mlp.experts"):
        build_and_load(cfg)


def build_and_load(cfg: Config) -> None:
    from shardlab.hf import load_hf_weights
    from shardlab.training.loop import build_model

    provider = provider_for(cfg)
    model, _, _ = build_model(cfg, provider=provider)
    load_hf_weights(model, cfg.model.hf_path, provider.hf_names)


def test_stacked_experts_split_by_experts_over_tp(dirs):
    """Mixtral's experts are planned whole per expert, E / tp on each tp rank; tp must divide the experts."""
    cfg = hf_cfg(dirs["mixtral"], MeshSpec(dp_shard=2, tp=2))
    check_layout(cfg, provider_for(cfg))
    _, plan = plan_model(cfg)
    assert plan.param("model.layers.0.mlp.experts.gate_up_proj").spec[0] == ("tp", "dp_shard")  # experts: tp, then FSDP
    assert plan.experts.stacked and plan.experts.tensor_parallel and plan.experts.ep == 1
    assert "model.layers.0.mlp.experts" in plan.experts.modules
    assert "model.layers.0.mlp.experts" not in {m.fqn for m in plan.modules}  # no ParallelStyle: expert parallelism
    odd = HFCausalLM.from_dict({"model_type": "mixtral", **SHAPE, "num_local_experts": 3}, "mixtral")
    with pytest.raises(ValueError, match=r"num_local_experts=3 is not divisible by mesh.tp=2"):
        check_layout(Config(mesh=MeshSpec(dp_shard=2, tp=2)), odd)
