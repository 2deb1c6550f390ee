"""shardlab.models.llama.model: matches transformers' LlamaForCausalLM, initialises from meta, survives local TP shards.

Run: pytest tests/test_llama.py -q (CPU, tiny shapes, a few seconds).
"""

from __future__ import annotations

import copy

import pytest
import torch
from msgspec.structs import replace
from torch import nn

from shardlab.config import ModelConfig, RopeScaling
from shardlab.models.llama.model import (
    SIZES,
    Llama,
    from_hf_config,
    llama_config,
    materialize,
    rope_inv_freq,
    to_hf_config,
)

transformers = pytest.importorskip("transformers")

# original_max_position=64 puts this tiny model's RoPE wavelengths in all three scaling bands.
TINY = ModelConfig(
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=96,
    vocab_size=128,
    rope_scaling=RopeScaling(factor=32.0, original_max_position=64),
)

# Llama-3.2-1B's published config.json (the fields that define the architecture).
HF_LLAMA_3_2_1B = {
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
    "initializer_range": 0.02, "max_position_embeddings": 131072,
}  # fmt: skip


def _hf_model(cfg: ModelConfig) -> nn.Module:
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**to_hf_config(cfg))).eval()
    with torch.no_grad():  # weights wide enough that logits are O(1) and norm weights that are not all ones
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    return hf


def _initialised(cfg: ModelConfig, seed: int = 0) -> Llama:
    with torch.device("meta"):
        model = Llama(cfg)
    return materialize(model, "cpu", seed)


@pytest.mark.parametrize(
    "cfg",
    [TINY, replace(TINY, tie_embeddings=True), replace(TINY, rope_scaling=None)],
    ids=["llama3_rope", "tied", "plain_rope"],
)
def test_logits_match_transformers(cfg: ModelConfig) -> None:
    hf = _hf_model(cfg)
    assert from_hf_config(hf.config.to_dict()) == cfg
    model = Llama(cfg).eval()
    model.load_state_dict(hf.state_dict(), strict=True)
    assert model.state_dict().keys() == hf.state_dict().keys()
    tokens = torch.randint(0, cfg.vocab_size, (2, 24))
    with torch.no_grad():
        diff = (model(tokens) - hf(tokens).logits).abs().max().item()
    assert diff <= 1e-5, diff


def test_rope_inv_freq_is_transformers_bit_for_bit() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for cfg in (TINY, SIZES["1B"], SIZES["8B"]):
        expected, _ = ROPE_INIT_FUNCTIONS["llama3"](transformers.LlamaConfig(**to_hf_config(cfg)))
        assert torch.equal(rope_inv_freq(cfg), expected)
    plain = llama_config("8B", rope_scaling=None)
    hf_rope = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding
    assert torch.equal(rope_inv_freq(plain), hf_rope(transformers.LlamaConfig(**to_hf_config(plain))).inv_freq)


def test_tied_load_accepts_checkpoint_without_lm_head() -> None:
    cfg = llama_config("debug", dim=64, n_heads=4, n_kv_heads=2, n_layers=1, tie_embeddings=True)
    src = _initialised(cfg)
    state = {k: v for k, v in src.state_dict().items() if k != "lm_head.weight"}  # as HF's tied safetensors
    dst = Llama(cfg)
    dst.load_state_dict(state, strict=True)
    assert dst.lm_head.weight is dst.model.embed_tokens.weight
    assert torch.equal(dst.lm_head.weight, src.model.embed_tokens.weight)


def test_meta_init_is_deterministic_finite_and_scaled() -> None:
    cfg = SIZES["debug"]
    a, b, c = _initialised(cfg, seed=0), _initialised(cfg, seed=0), _initialised(cfg, seed=1)
    for (name, pa), pb, pc in zip(
        a.state_dict().items(), b.state_dict().values(), c.state_dict().values(), strict=True
    ):
        assert torch.isfinite(pa).all(), name
        assert torch.equal(pa, pb), name
        assert "norm" in name or not torch.equal(pa, pc), name
    std = {name: p.std().item() for name, p in a.named_parameters()}
    assert abs(std["model.embed_tokens.weight"] - 1.0) < 0.02
    assert abs(std["lm_head.weight"] - 0.986 * cfg.dim**-0.5) < 0.002  # 0.986: std of a normal cut at 3 std
    assert abs(std["model.layers.0.self_attn.q_proj.weight"] - 0.986 * cfg.init_std) < 0.001
    assert abs(std["model.layers.3.mlp.down_proj.weight"] - 0.986 * cfg.init_std / 8**0.5) < 0.0005
    assert torch.equal(a.model.layers[0].input_layernorm.weight, torch.ones(cfg.dim))
    assert torch.equal(a.model.layers[5].self_attn.inv_freq, rope_inv_freq(cfg))


def test_each_weight_depends_only_on_seed_and_name() -> None:
    """A pipeline rank that pruned the other stages on the meta device draws the same weights as one process,
    and init leaves the caller's RNG as it was."""
    cfg = replace(SIZES["debug"], tie_embeddings=False)  # pipelines refuse ties across stages
    whole = _initialised(cfg, seed=7)
    with torch.device("meta"):
        pruned = Llama(cfg)
    for fqn in ("model.embed_tokens", "model.layers.0", "model.layers.1", "lm_head"):
        pruned.set_submodule(fqn, nn.Identity())
    before = torch.get_rng_state()
    materialize(pruned, "cpu", seed=7)
    assert torch.equal(torch.get_rng_state(), before)
    kept = dict(pruned.named_parameters())
    assert len(kept) == len(dict(whole.named_parameters())) - 2 - 2 * 9
    for name, p in kept.items():
        assert torch.equal(p, whole.get_parameter(name)), name
    assert torch.equal(pruned.model.layers[2].self_attn.inv_freq, rope_inv_freq(cfg))


def test_tied_init_reties_after_to_empty() -> None:
    model = _initialised(llama_config("debug", tie_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert abs(model.lm_head.weight.std().item() - 0.986 * 256**-0.5) < 0.002


@pytest.mark.parametrize("tied", [False, True])
def test_n_params_matches_config(tied: bool) -> None:
    cfg = llama_config("debug", tie_embeddings=tied)
    assert sum(p.numel() for p in Llama(cfg).parameters()) == cfg.n_params


def test_named_sizes() -> None:
    expected_billions = {"1B": 1.24, "3B": 3.21, "8B": 8.03, "70B": 70.55, "405B": 405.85}
    for size, billions in expected_billions.items():
        assert SIZES[size].n_params / 1e9 == pytest.approx(billions, abs=0.01), size
    assert SIZES["debug"] == ModelConfig()
    assert from_hf_config(HF_LLAMA_3_2_1B) == SIZES["1B"]
    for cfg in SIZES.values():
        assert from_hf_config(to_hf_config(cfg)) == cfg
    assert llama_config("8B", n_layers=2).n_layers == 2
    with pytest.raises(ValueError, match="model size '7B' is unknown; choose one of debug, 1B, 3B, 8B, 70B, 405B"):
        llama_config("7B")


def _shard(module: nn.Module, rank: int, col: tuple[str, ...], row: tuple[str, ...]) -> nn.Module:
    """Rank `rank` of 2 under Megatron TP: `col` projections keep half their outputs, `row` half their inputs."""
    local = copy.deepcopy(module)
    for name in col + row:
        w = getattr(module, name).weight
        half = w.chunk(2, dim=0 if name in col else 1)[rank]
        linear = nn.Linear(half.shape[1], half.shape[0], bias=False)
        linear.weight = nn.Parameter(half.clone())
        setattr(local, name, linear)
    return local


def test_local_shards_sum_to_full_module() -> None:
    """Half the heads / half the ffn per rank, summed (the rowwise all-reduce), equals the full module."""
    block = _initialised(TINY).model.layers[1]
    x = torch.randn(2, 12, TINY.dim)
    attn_cols, mlp_cols = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")
    with torch.no_grad():
        attn = sum(_shard(block.self_attn, r, attn_cols, ("o_proj",))(x) for r in range(2))
        mlp = sum(_shard(block.mlp, r, mlp_cols, ("down_proj",))(x) for r in range(2))
        torch.testing.assert_close(attn, block.self_attn(x), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(mlp, block.mlp(x), atol=1e-6, rtol=1e-5)
