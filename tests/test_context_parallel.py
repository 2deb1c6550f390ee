"""Context parallelism as data: which positions each cp rank holds, the plan's record of it, and the
errors at plan time. Runs against one process are in tests/worlds/test_context_parallel.py."""

from __future__ import annotations

import msgspec
import pytest
import torch

from shardlab import Config, MeshSpec, ModelConfig, PlanConfig, TrainConfig
from shardlab.models.llama.model import Llama, causal_attention
from shardlab.models.llama.rules import llama_rules
from shardlab.sharding.context import cp_positions
from shardlab.sharding.plan import make_plan
from shardlab.training.loop import plan_model

MODEL = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256)


def test_each_rank_holds_a_head_and_a_tail_chunk():
    assert cp_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert cp_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    every = torch.cat([cp_positions(24, 3, r) for r in range(3)])
    assert sorted(every.tolist()) == list(range(24))


def test_causal_work_is_balanced():
    """Keys each rank's queries see under the causal mask: the same on every rank."""
    work = [sum(p + 1 for p in cp_positions(64, 4, r).tolist()) for r in range(4)]
    assert len(set(work)) == 1


def test_attention_with_positions_is_causal_attention():
    """The default attention ignores positions 0..s-1 only because they are in order: RoPE reads them."""
    q, k, v = torch.randn(2, 4, 8, 16), torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16)
    out = causal_attention(q, k, v, torch.arange(8))
    assert out.shape == q.shape
    model = Llama(MODEL)
    tokens = torch.randint(0, 256, (2, 8))
    torch.testing.assert_close(model(tokens), model(tokens, positions=torch.arange(8)), rtol=0, atol=0)


def test_plan_records_context_parallel_attention():
    cfg = Config(mesh=MeshSpec(dp_shard=2, cp=2), model=MODEL, train=TrainConfig(global_batch=8, seq_len=64))
    _, plan = plan_model(cfg.resolve(4))
    assert plan.context.attention == "all_gather_kv"
    assert plan.context.modules == ("model.layers.0.self_attn", "model.layers.1.self_attn")
    assert plan.fsdp.axes == ("dp_shard_cp",)
    assert plan.param("model.norm.weight").local_shape == (16,)  # FSDP shards over dp_shard x cp = 4
    assert "Context parallel over cp=2: all_gather_kv attention" in plan.table()


@pytest.mark.parametrize(
    ("mesh", "train", "message"),
    [
        (MeshSpec(cp=4), TrainConfig(seq_len=36), r"^train\.seq_len=36 is not divisible by 2 x mesh\.cp = 8"),
        (
            MeshSpec(cp=2, tp=4),
            TrainConfig(seq_len=36),
            r"^train\.seq_len / mesh\.cp = 18 tokens per cp rank are not divisible by mesh\.tp=4",
        ),
    ],
)
def test_bad_context_parallel_configs_are_one_line(mesh, train, message):
    with pytest.raises(ValueError, match=message):
        Config(mesh=mesh, model=msgspec.structs.replace(MODEL, n_kv_heads=4), train=train)


def test_rules_must_name_the_attention():
    with torch.device("meta"):
        model = Llama(MODEL)
    rules = msgspec.structs.replace(llama_rules(MODEL), attention=())
    with pytest.raises(ValueError, match=r"^mesh\.cp=2 needs rules\.attention to name the attention modules"):
        make_plan(model, MeshSpec(dp_shard=1, cp=2), rules, PlanConfig())
