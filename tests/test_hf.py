"""shardlab.hf on one process: HF checkpoints load with transformers' logits, exports load in transformers,
and every bad checkpoint is a one-line ValueError that leaves the model untouched. Sharded (DTensor) loads
and exports are in tests/worlds/test_hf_io.py."""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from shardlab.config import ModelConfig, MoEConfig, RopeScaling
from shardlab.hf import from_hf, load_hf_weights, read_hf_config, to_hf
from shardlab.models.llama.model import Llama, materialize

transformers = pytest.importorskip("transformers")

TOKENS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))


def hf_model(*, tied: bool = False, hidden: int = 64, inter: int = 96) -> torch.nn.Module:
    """A random transformers Llama, configured in HF's own terms (not through shardlab's to_hf_config)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rope_theta=500_000.0, max_position_embeddings=131_072, tie_word_embeddings=tied,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # HF initialises norms to 1: make them random so a skipped norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def saved(tmp_path, name: str = "hf", **kwargs) -> tuple[torch.nn.Module, str]:
    save_kwargs = {"max_shard_size": kwargs.pop("max_shard_size")} if "max_shard_size" in kwargs else {}
    model = hf_model(**kwargs)
    path = str(tmp_path / name)
    model.save_pretrained(path, **save_kwargs)
    return model, path


def hf_logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS)


def small_llama(*, tied: bool = False) -> Llama:
    cfg = ModelConfig(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=128, rope_scaling=RopeScaling(),
        tie_embeddings=tied,
    )  # fmt: skip
    with torch.device("meta"):
        model = Llama(cfg)
    materialize(model, "cpu", seed=3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_unchanged(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> None:
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed by a failed load"


# --- HF -> shardlab ---


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_from_hf_matches_transformers(tmp_path, tied):
    hf, path = saved(tmp_path, tied=tied)
    if tied:
        assert "lm_head.weight" not in json.dumps(sorted(os.listdir(path)))
    model = from_hf(path)
    assert model.cfg.tie_embeddings is tied
    assert (model.lm_head.weight is model.model.embed_tokens.weight) is tied
    assert (logits(model) - hf_logits(hf)).abs().max().item() <= 1e-5


def test_sharded_hf_checkpoint_loads(tmp_path):
    hf, path = saved(tmp_path, max_shard_size="50KB")
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) > 2
    assert (logits(from_hf(path)) - hf_logits(hf)).abs().max().item() <= 1e-5


def test_bf16_checkpoint_is_converted_to_the_model_dtype(tmp_path):
    hf = hf_model().to(torch.bfloat16)
    hf.save_pretrained(tmp_path / "bf16")
    model = from_hf(tmp_path / "bf16")
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert torch.equal(model.model.embed_tokens.weight, hf.model.embed_tokens.weight.float())


# --- shardlab -> HF ---


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_to_hf_loads_in_transformers(tmp_path, tied):
    model = small_llama(tied=tied)
    to_hf(model, tmp_path / "out")
    files = sorted(os.listdir(tmp_path / "out"))
    assert files == ["config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"], "the temporary directory is left behind"
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert hf.config.tie_word_embeddings is tied
    assert (hf_logits(hf) - logits(model)).abs().max().item() <= 1e-5
    assert read_hf_config(tmp_path / "out") == model.cfg


def test_to_hf_splits_into_shards_with_an_index(tmp_path):
    model = small_llama()
    to_hf(model, tmp_path / "out", max_shard_bytes=40_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert set(index["weight_map"]) == {n for n, _ in model.named_parameters()}
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert (hf_logits(hf) - logits(model)).abs().max().item() <= 1e-5
    assert (logits(from_hf(tmp_path / "out")) - logits(model)).abs().max().item() == 0


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_every_exported_file_gets_the_mode_of_a_new_file(tmp_path, umask):
    """The weights (one file or shards), the config, the index and the files written beside them get the mode any
    new file gets under the umask (0644 under 022), not the 0600 of safetensors' temporary file."""
    model = small_llama()
    before = os.umask(umask)
    try:
        to_hf(model, tmp_path / "one", extra_files={"tokenizer.json": b"{}"})
        to_hf(model, tmp_path / "shards", max_shard_bytes=40_000)
    finally:
        os.umask(before)
    assert sorted(os.listdir(tmp_path / "one")) == ["config.json", "model.safetensors", "tokenizer.json"]
    for out in ("one", "shards"):
        modes = {f.name: oct(f.stat().st_mode & 0o777) for f in (tmp_path / out).iterdir()}
        assert set(modes.values()) == {oct(0o666 & ~umask)}, modes


def test_to_hf_accepts_a_state_dict(tmp_path):
    model = small_llama(tied=True)
    to_hf(model.state_dict(), tmp_path / "out", config=model.cfg)
    assert torch.equal(logits(from_hf(tmp_path / "out")), logits(model))


def test_to_hf_refuses_a_non_empty_directory_and_a_wrong_state(tmp_path):
    model = small_llama()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match=r"full: already exists and is not an empty directory"):
        to_hf(model, tmp_path / "full")
    sd = model.state_dict()
    del sd["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"to_hf: tensor 'model.layers.1.mlp.up_proj.weight' .* is missing"):
        to_hf(sd, tmp_path / "partial", config=model.cfg)
    with pytest.raises(ValueError, match=r"to_hf: `model` has no ModelConfig"):
        to_hf(model.state_dict(), tmp_path / "noconfig")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]


# --- bad input: one-line ValueErrors, no partial load ---


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(ValueError, match=r"nowhere: no such directory"):
        read_hf_config(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=r"nowhere: no such directory"):
        load_hf_weights(small_llama(), tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty/config.json: no such file"):
        from_hf(tmp_path / "empty")
    with pytest.raises(ValueError, match=r"empty: no model.safetensors or model.safetensors.index.json"):
        load_hf_weights(small_llama(), tmp_path / "empty")


def test_pickle_checkpoints_are_refused(tmp_path):
    _, path = saved(tmp_path)
    os.remove(os.path.join(path, "model.safetensors"))
    open(os.path.join(path, "pytorch_model.bin"), "wb").close()
    with pytest.raises(ValueError, match=r"has pytorch_model.bin but no model.safetensors.*only safetensors are read"):
        from_hf(path)


def test_truncated_file_is_refused_and_nothing_is_loaded(tmp_path):
    _, path = saved(tmp_path, max_shard_size="50KB")
    shards = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    last = os.path.join(path, shards[-1])  # the earlier shards are fine: a partial load would show
    data = Path(last).read_bytes()
    Path(last).write_bytes(data[: len(data) // 2])
    model = small_llama()
    before = snapshot(model)
    with pytest.raises(ValueError, match=rf"{shards[-1]}: not a readable safetensors file .*truncated"):
        load_hf_weights(model, path)
    assert_unchanged(model, before)


def test_shard_named_in_the_index_but_missing(tmp_path):
    _, path = saved(tmp_path, max_shard_size="50KB")
    second = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))[1]
    os.remove(os.path.join(path, second))
    model = small_llama()
    before = snapshot(model)
    with pytest.raises(ValueError, match=rf"{second}: listed in model.safetensors.index.json but missing"):
        load_hf_weights(model, path)
    assert_unchanged(model, before)


def test_checkpoint_of_another_shape_is_refused_and_nothing_is_loaded(tmp_path):
    _, path = saved(tmp_path, hidden=32)
    model = small_llama()
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"tensor 'model.embed_tokens.weight' has shape \(128, 32\) .* \(128, 64\)"):
        load_hf_weights(model, path)
    # same embeddings, other MLP width: the embedding would load first if loading did not wait for every check
    _, path = saved(tmp_path, name="wide", inter=128)
    with pytest.raises(
        ValueError, match=r"'model.layers.0.mlp.gate_proj.weight' has shape \(128, 64\) but .* \(96, 64\)"
    ):
        load_hf_weights(model, path)
    assert_unchanged(model, before)


def test_missing_and_unexpected_tensors(tmp_path):
    _, path = saved(tmp_path, tied=True)
    with pytest.raises(ValueError, match=r"no tensor 'lm_head.weight' in the checkpoint .*tie_embeddings=True"):
        load_hf_weights(small_llama(tied=False), path)
    _, path = saved(tmp_path, name="untied", tied=False)
    with pytest.raises(
        ValueError, match=r"'lm_head.weight' differs from 'model.embed_tokens.weight' but the model ties"
    ):
        load_hf_weights(small_llama(tied=True), path)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**json.loads(Path(path, "config.json").read_text())))
    sd = {k: v for k, v in model.state_dict().items() if k != "model.layers.1.mlp.up_proj.weight"}
    save_file(sd, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"no tensor 'model.layers.1.mlp.up_proj.weight' in the checkpoint"):
        load_hf_weights(small_llama(), path)


def test_tied_checkpoint_with_both_names_loads_when_equal(tmp_path):
    hf, path = saved(tmp_path, tied=True)
    sd = {k: v.clone() for k, v in hf.state_dict().items()}
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    save_file(sd, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    assert (logits(from_hf(path)) - hf_logits(hf)).abs().max().item() <= 1e-5


def test_bad_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral", "hidden_size": 64}))
    with pytest.raises(ValueError, match=r"config.json: model_type='mistral'; only Llama and Mixtral checkpoints"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config.json: not readable JSON"):
        read_hf_config(tmp_path)


# --- Mixtral: MoE models ---


def hf_mixtral(tmp_path) -> tuple[torch.nn.Module, Path]:
    """A random transformers Mixtral, saved in several files (Mixtral's per-expert tensors on disk)."""
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    model = transformers.MixtralForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path / "mixtral", max_shard_size="50KB")
    return model, tmp_path / "mixtral"


def small_moe(**moe: object) -> Llama:
    options = dict(n_experts=4, top_k=2, expert_ffn_dim=48) | moe
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=128, moe=MoEConfig(**options))
    with torch.device("meta"):
        model = Llama(cfg)
    materialize(model, "cpu", seed=3)
    return model


def test_mixtral_loads_with_transformers_logits(tmp_path):
    hf, path = hf_mixtral(tmp_path)
    model = from_hf(path)
    assert model.cfg.moe == MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=48, aux_loss_coef=0.001)
    assert (logits(model) - hf_logits(hf)).abs().max().item() <= 1e-5
    expert_2_up = hf.state_dict()["model.layers.1.mlp.experts.gate_up_proj"][2, 48:]  # transformers fuses gate, up
    assert torch.equal(model.model.layers[1].mlp.experts.up_proj[2], expert_2_up)


def test_moe_exports_as_mixtral(tmp_path):
    model = small_moe()
    to_hf(model, tmp_path / "out", max_shard_bytes=60_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in index["weight_map"]
    hf = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert (hf_logits(hf) - logits(model)).abs().max().item() <= 1e-5
    assert read_hf_config(tmp_path / "out") == model.cfg
    assert (logits(from_hf(tmp_path / "out")) - logits(model)).abs().max().item() == 0


@pytest.mark.parametrize(
    ("moe", "what"),
    [
        (dict(shared_expert=True), "a shared expert"),
        (dict(score="sigmoid"), "sigmoid router scores"),
        (dict(balance="bias"), r"a selection bias \(balance='bias'\)"),
        (dict(top_k=1), "top_k=1"),
        (dict(capacity_factor=1.0), r"a capacity limit \(capacity_factor\)"),
    ],
)
def test_moe_without_a_mixtral_form_is_refused_before_writing(tmp_path, moe, what):
    with pytest.raises(ValueError, match=rf"^to_hf: an MoE model exports as Mixtral, which cannot express {what}"):
        to_hf(small_moe(**moe), tmp_path / "out")
    assert not any(tmp_path.iterdir())


def test_mixtral_of_another_shape_or_missing_an_expert_is_refused_and_nothing_is_loaded(tmp_path):
    _, path = hf_mixtral(tmp_path)
    model = small_moe()
    before = snapshot(model)
    with pytest.raises(
        ValueError, match=r"tensor 'model\.layers\.0\.block_sparse_moe\.gate\.weight' has shape \(4, 64\)"
    ):
        load_hf_weights(small_moe(n_experts=8), path)
    with pytest.raises(ValueError, match=r"experts\.0\.w1\.weight' has shape \(48, 64\) but each expert of"):
        load_hf_weights(small_moe(expert_ffn_dim=32), path)
    tensors = {}
    for file in path.glob("*.safetensors"):
        with safe_open(file, framework="pt") as f:
            tensors |= {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        file.unlink()
    (path / "model.safetensors.index.json").unlink()
    del tensors["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"no tensor 'model\.layers\.1\.block_sparse_moe\.experts\.3\.w3\.weight' for"):
        load_hf_weights(model, path)
    assert_unchanged(model, before)


def test_a_block_of_concatenated_rows_reads_from_each_part():
    """An expert slice made of two row blocks (transformers' gate, then up): a rank whose block straddles them
    (FSDP on dim 1) reads the end of one and the start of the other into the right rows."""
    from shardlab.hf.io import _slice_reads

    into = torch.empty(4, 3)
    reads = _slice_reads(("gate", "up"), into, (slice(2, 6), slice(0, 3)), rows=8)
    assert [(n, b) for n, _, b in reads] == [("gate", (slice(2, 4), slice(0, 3))), ("up", (slice(0, 2), slice(0, 3)))]
    assert reads[0][1].data_ptr() == into[0:2].data_ptr() and reads[1][1].data_ptr() == into[2:4].data_ptr()
    ((name, dest, block),) = _slice_reads("w2", into, (slice(0, 4),), rows=4)
    assert name == "w2" and dest.data_ptr() == into.data_ptr() and dest.shape == into.shape and block == (slice(0, 4),)
