"""The MoE model on data-parallel layouts against one process (issue 5): fp32, same seed and global batch,
10 steps; loss and gradient norm within tolerance. The balancing loss and the bias update use the router
statistics of the global batch, so they are the same in every layout: FSDP 2 (auxiliary loss; bias balancing;
sigmoid scores with a shared expert) on 2 ranks; HSDP 2 x 2 and CP 2 x FSDP 2 on 4. A capacity limit
applies to each rank's micro batch (which tokens overflow depends on the layout), so it is tested on one
process (tests/test_moe.py)."""

from pathlib import Path

import msgspec
import pytest

from shardlab.config import Config, MeshSpec, MoEConfig

from ._harness import run_world
from .layouts import assert_matches, ckpt, curves, layout_curves, tiny

MOE = {
    "aux": MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=64),
    "bias": MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=64, balance="bias", bias_rate=0.01),
    "sigmoid_shared": MoEConfig(n_experts=4, top_k=1, expert_ffn_dim=64, score="sigmoid", shared_expert=True),
}  # fmt: skip


def moe(name: str, mesh: MeshSpec = MeshSpec(dp_shard=1)) -> Config:
    cfg = tiny(mesh)
    return msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, moe=MOE[name]))


LAYOUTS_2 = {f"fsdp2-{name}": moe(name, MeshSpec(dp_shard=2)) for name in MOE}
LAYOUTS_4 = {
    "hsdp2x2-bias": moe("bias", MeshSpec(dp_replicate=2, dp_shard=2)),
    "cp2_fsdp2-aux": moe("aux", MeshSpec(dp_shard=2, cp=2)),
}
LAYOUTS = {2: LAYOUTS_2, 4: LAYOUTS_4}


def run(rank, world_size, tmp=None):
    return layout_curves(LAYOUTS[world_size])


def bias_resume(rank, world_size, tmp):
    """FSDP 2 with bias balancing stopped after step 5 (saving it), then resumed: the losses of all 10 steps.
    The expert biases are state (buffers) and come back from the checkpoint."""
    cfg = ckpt(LAYOUTS_2["fsdp2-bias"], Path(tmp) / "bias", every=5)
    return curves(cfg, until=5)["loss"] + curves(cfg)["loss"]


@pytest.fixture(scope="module")
def references():
    return {name: curves(moe(name)) for name in MOE}


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return run_world(2, [run, bias_resume], timeout_s=300, tmp=str(tmp_path_factory.mktemp("moe")))


@pytest.fixture(scope="module")
def world4():
    return run_world(4, [run], timeout_s=300)


@pytest.mark.world
@pytest.mark.parametrize(("ranks", "layout"), [(n, name) for n, layouts in LAYOUTS.items() for name in layouts])
def test_moe_matches_single_process(request, references, ranks, layout):
    want = references[layout.split("-", 1)[1]]
    assert want["loss"][-1] < want["loss"][0] - 0.5, "the reference loss should fall"
    assert_matches(request.getfixturevalue(f"world{ranks}").value(run)[layout], want, layout)


@pytest.mark.world
def test_bias_balanced_resume_is_bitwise(world2):
    assert world2.value(bias_resume) == world2.value(run)["fsdp2-bias"]["loss"]
