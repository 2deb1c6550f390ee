"""HF safetensors in and out of a sharded model (4 gloo ranks, fp32): each rank reads only its blocks of a
transformers checkpoint into FSDP 2 x TP 2 (strided shards), FSDP 4 and FSDP 2 x CP 2 (FSDP over the flattened
dp_shard x cp) models, and a Mixtral's per-expert tensors into expert-parallel ones (ep 2 of FSDP 4; ep 2 x TP 2)
and into FSDP 4 shards of 6 experts (the last shard holds none),
whose logits then equal transformers'; and `to_hf` from those models writes checkpoints
transformers loads with the same logits. The vocabulary (130) is not divisible by 4, so FSDP pads dim 0 of the
embedding and the head: rows 0:33, 33:65, 65:98, 98:130 under FSDP 2 x TP 2 and 0:33, 33:66, 66:99, 99:130
under FSDP 4 and FSDP 2 x CP 2."""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from shardlab.config import Config, DataConfig, LogConfig, MeshSpec, TrainConfig
from shardlab.hf import load_hf_weights, read_hf_config, to_hf
from shardlab.sharding.context import cp_positions
from shardlab.training.loop import build_model

from ._harness import run_world

transformers = pytest.importorskip("transformers")

TOKENS = torch.randint(0, 130, (2, 16), generator=torch.Generator().manual_seed(1))
LAYOUTS = {
    "fsdp2_tp2": ("untied", MeshSpec(dp_shard=2, tp=2)),
    "fsdp2_tp2_tied": ("tied", MeshSpec(dp_shard=2, tp=2)),
    "fsdp4": ("untied", MeshSpec(dp_shard=4)),
    "fsdp2_cp2": ("untied", MeshSpec(dp_shard=2, cp=2)),  # FSDP over the flattened dp_shard x cp
    "mixtral_fsdp4_ep2": ("mixtral", MeshSpec(dp_shard=4, ep=2)),  # experts: 2 per ep rank, FSDP over the rest
    "mixtral_fsdp2_tp2_ep2": ("mixtral", MeshSpec(dp_shard=2, tp=2, ep=2)),  # and TP inside each expert
    "mixtral6_fsdp4": ("mixtral6", MeshSpec(dp_shard=4)),  # 6 experts over 4 shards: 2, 2, 2 and none
}


def hf_model(tied: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=130, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rope_theta=500_000.0, max_position_embeddings=131_072, tie_word_embeddings=tied,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # HF initialises norms to 1: random ones show a norm loaded into the wrong rows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def hf_mixtral(experts: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=130, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=experts, num_experts_per_tok=2,
    )  # fmt: skip
    return transformers.MixtralForCausalLM(config).eval()


def hf_logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def tiny(hf_dir: Path, mesh: MeshSpec) -> Config:
    """tests/worlds/layouts.py's tiny run, with the model of a HF directory (no training happens here)."""
    return Config(
        mesh=mesh,
        model=read_hf_config(hf_dir),
        train=TrainConfig(steps=1, seq_len=16, global_batch=4, run_dir="/tmp/shardlab-tests/{name}"),
        log=LogConfig(wandb="disabled", progress=False, every=1000),
        data=DataConfig(source="synthetic"),
    )


def load_and_export(name: str, hf_dir: Path, out_dir: Path, want: dict[str, torch.Tensor]) -> dict:
    """Every rank: build the sharded model, load the HF checkpoint, compare logits, export with to_hf."""
    kind, mesh = LAYOUTS[name]
    model, plan, device_mesh = build_model(tiny(hf_dir / kind, mesh), device="cpu")
    embed = model.model.embed_tokens.weight
    assert isinstance(embed, DTensor), type(embed)
    load_hf_weights(model, hf_dir / kind)
    at = slice(None)
    with torch.no_grad():
        if plan.context is not None:  # each cp rank runs its chunks of the sequence
            at = cp_positions(TOKENS.shape[1], mesh.cp, device_mesh["cp"].get_local_rank())
            got = model(TOKENS[:, at], positions=at)
        else:
            got = model(TOKENS)
    got = got.full_tensor() if isinstance(got, DTensor) else got
    to_hf(model, out_dir / name)
    return {
        "diff": (got - want[kind][:, at]).abs().max().item(),
        "placements": str(embed.placements),
        "local_rows": embed.to_local().shape[0],
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
    }


def fsdp2_tp2(rank, world_size, **kw):
    return load_and_export("fsdp2_tp2", **kw)


def fsdp2_tp2_tied(rank, world_size, **kw):
    return load_and_export("fsdp2_tp2_tied", **kw)


def fsdp4(rank, world_size, **kw):
    return load_and_export("fsdp4", **kw)


def fsdp2_cp2(rank, world_size, **kw):
    return load_and_export("fsdp2_cp2", **kw)


def mixtral_fsdp4_ep2(rank, world_size, **kw):
    return load_and_export("mixtral_fsdp4_ep2", **kw)


def mixtral_fsdp2_tp2_ep2(rank, world_size, **kw):
    return load_and_export("mixtral_fsdp2_tp2_ep2", **kw)


def mixtral6_fsdp4(rank, world_size, **kw):
    out = load_and_export("mixtral6_fsdp4", **kw)
    dist.barrier()  # the last check: every rank's export is written before the tests read them
    return out


CHECKS = [fsdp2_tp2, fsdp2_tp2_tied, fsdp4, fsdp2_cp2, mixtral_fsdp4_ep2, mixtral_fsdp2_tp2_ep2, mixtral6_fsdp4]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    hf_dir, out_dir = tmp_path_factory.mktemp("hf"), tmp_path_factory.mktemp("out")
    want = {}
    for kind in ("untied", "tied", "mixtral", "mixtral6"):
        model = (
            hf_mixtral(6 if kind == "mixtral6" else 4) if kind.startswith("mixtral") else hf_model(tied=kind == "tied")
        )
        model.save_pretrained(hf_dir / kind, max_shard_size="100KB")  # sharded: an index and several files
        want[kind] = hf_logits(model)
    result = run_world(4, CHECKS, timeout_s=300, hf_dir=hf_dir, out_dir=out_dir, want=want)
    return result, out_dir, want


@pytest.mark.world
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sharded_load_matches_transformers(world, name):
    result, _, _ = world
    rows = [result.value(name, r)["local_rows"] for r in range(4)]
    for r in range(4):
        assert result.value(name, r)["diff"] <= 1e-5, (r, result.value(name, r))
    assert result.value(name)["tied"] is (LAYOUTS[name][0] == "tied")
    if "tp2" in name:
        assert "_StridedShard" in result.value(name)["placements"]
        assert rows == [33, 33, 32, 32]  # ranks (dp_shard, tp): (0,0) 0:33, (0,1) 65:98, (1,0) 33:65, (1,1) 98:130
    else:
        assert rows == [33, 33, 33, 31]


@pytest.mark.world
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_export_from_sharded_model_loads_in_transformers(world, name):
    result, out_dir, want = world
    result.raise_for(name)
    kind = LAYOUTS[name][0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out_dir / name).eval()
    assert hf.config.tie_word_embeddings is (kind == "tied")
    assert (hf_logits(hf) - want[kind]).abs().max().item() <= 1e-5
    assert sorted(p.name for p in out_dir.iterdir()) == sorted(LAYOUTS), "a temporary directory is left behind"
