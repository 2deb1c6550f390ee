"""visualize_spec: the picture jax.debug.visualize_array_sharding draws, from pure data."""

from shardlab import MeshSpec, P, visualize_spec
from shardlab.sharding.mesh import ExpertMeshSpec

MESH = MeshSpec(dp_shard=2, tp=2)


def test_two_dims_draw_a_grid():
    assert visualize_spec((8, 8), P("tp", "dp_shard"), MESH).splitlines()[1:] == [
        "┌────────┬────────┐",
        "│ rank 0 │ rank 2 │",
        "├────────┼────────┤",
        "│ rank 1 │ rank 3 │",
        "└────────┴────────┘",
    ]


def test_replicas_share_a_cell_and_a_split_last_dim_is_a_row():
    assert visualize_spec((8, 8), P(None, "tp"), MESH).splitlines()[2] == "│ ranks 0,2 │ ranks 1,3 │"
    assert visualize_spec((8,), P("tp"), MESH).splitlines()[2] == "│ ranks 0,2 │ ranks 1,3 │"


def test_strided_order_reads_top_to_bottom():
    rows = [r for r in visualize_spec((8, 8), P(("tp", "dp_shard"), None), MESH).splitlines() if r.startswith("│")]
    assert rows == ["│ rank 0 │", "│ rank 2 │", "│ rank 1 │", "│ rank 3 │"]


def test_three_sharded_dims_are_listed():
    mesh = MeshSpec(dp_replicate=2, dp_shard=2, tp=2)
    text = visualize_spec((2, 2, 2), P("dp_replicate", "dp_shard", "tp"), mesh)
    assert "[0:1, 0:1, 0:1]  rank 0" in text
    assert "[1:2, 1:2, 1:2]  rank 7" in text


def test_replicated_tensor_is_one_cell():
    assert "ranks 0,1,2,3" in visualize_spec((4, 4), P(), MESH)


def test_expert_weights_draw_on_the_expert_mesh():
    """ep is the fast half of dp_shard: ep rank e is ranks e, e + ep, ...; FSDP splits each ep rank's experts."""
    mesh = ExpertMeshSpec(pp=1, dp_replicate=1, dp_shard_mod_ep=2, ep=2, tp=1)
    text = visualize_spec((4, 64, 64), P(("ep", "dp_shard_mod_ep"), None, None), mesh)
    assert (
        text.splitlines()[0]
        == "(4, 64, 64) P(('ep', 'dp_shard_mod_ep'), None, None) on expert mesh dp_shard_mod_ep=2 x ep=2 (4 ranks)"
    )
    assert [r for r in text.splitlines() if r.startswith("│")] == [
        "│ rank 0 │",
        "│ rank 2 │",
        "│ rank 1 │",
        "│ rank 3 │",
    ]
