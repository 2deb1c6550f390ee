"""The memory estimate equals what the worst rank really holds (4 gloo ranks): parameters, gradients and
AdamW state, byte for byte on rank 0, never exceeded on the others; with a vocab that FSDP must pad."""

import contextlib

import msgspec
import pytest
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from shardlab.config import MeshSpec
from shardlab.data.loader import make_loader
from shardlab.estimate import estimate_memory
from shardlab.training.loop import build_model
from shardlab.training.step import init_state

from .layouts import tiny


def nbytes(tensors) -> int:
    """Memory really held: each distinct storage once (FSDP's sharded grads are views of one flat buffer)."""
    storages = {}
    for t in tensors:
        storage = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def measured(rank, world_size, mesh: MeshSpec, vocab: int) -> dict:
    cfg = tiny(mesh)
    cfg = msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, vocab_size=vocab))
    model, plan, _ = build_model(cfg)
    state = init_state(model, cfg.optim)
    batch = next(make_loader(cfg.data, seq_len=64, global_batch=8, vocab_size=vocab, dp_rank=0, dp_size=1))
    with loss_parallel() if plan.loss_parallel else contextlib.nullcontext():
        logits = model(batch.inputs[: 8 // plan.mesh.size("dp")])
        F.cross_entropy(logits.flatten(0, 1), batch.labels[: 8 // plan.mesh.size("dp")].flatten()).backward()
    got = {"params": nbytes(model.parameters()), "grads": nbytes(p.grad for p in model.parameters())}
    state.optim.step()
    got["optim"] = nbytes(t for s in state.optim.state.values() for t in s.values())
    want = estimate_memory(plan)
    return {"got": got, "want": {"params": want.params, "grads": want.grads, "optim": want.optim}}


def fsdp_tp(rank, world_size):
    return measured(rank, world_size, MeshSpec(dp_shard=2, tp=2), vocab=514)  # 257 rows per tp shard: padded


def hsdp(rank, world_size):
    return measured(rank, world_size, MeshSpec(dp_replicate=2, dp_shard=2), vocab=514)


CHECKS = [fsdp_tp, hsdp]


@pytest.fixture(scope="module")
def world4(shared_world4):
    return shared_world4


@pytest.mark.world
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_estimate_is_the_worst_rank_exactly(world4, check):
    out = [world4.value(check, rank=r) for r in range(4)]
    assert out[0]["got"] == out[0]["want"], out[0]
    for r in range(1, 4):
        for key, value in out[r]["got"].items():
            assert value <= out[r]["want"][key], (r, key, out[r])
