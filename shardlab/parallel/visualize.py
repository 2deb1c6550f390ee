"""visualize: which rank holds which block of a tensor, drawn as `jax.debug.visualize_array_sharding` does.

Works from a DTensor (its mesh and placements) or from pure data (shape, PartitionSpec, MeshSpec),
so a layout can be looked at before any process starts.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from torch.distributed.tensor import DTensor

from shardlab.parallel.device_mesh import placed_spec
from shardlab.sharding.spec import Mesh, P, block, expand


def visualize(x: DTensor) -> str:
    """Draw the blocks of a DTensor and the ranks that hold each (replicas share a cell)."""
    mesh = x.device_mesh
    spec, spec_mesh, names = placed_spec(x)  # an expert weight's mesh: the expert mesh
    axes = spec_mesh.axis_names
    ranks = {}
    for coord in itertools.product(*(range(n) for n in mesh.shape)):
        coordinate = {a: 0 for a in axes} | dict(zip(names, coord))
        ranks[tuple(coordinate[a] for a in axes)] = int(mesh.mesh[coord])
    return visualize_spec(tuple(x.shape), spec, spec_mesh, ranks=ranks)


def visualize_spec(
    shape: Sequence[int], spec: P, mesh: Mesh, *, ranks: dict[tuple[int, ...], int] | None = None
) -> str:
    """Pure form of `visualize`: the blocks `spec` gives a tensor of `shape` on `mesh`, and who holds each."""
    spec = expand(P(*spec, *([None] * (len(shape) - len(spec)))), mesh)
    holders: dict[tuple[slice, ...], list[int]] = {}
    for rank in range(mesh.world_size):
        coordinate = mesh.coordinate(rank)
        key = tuple(coordinate[a] for a in mesh.axis_names)
        blk = block(spec, mesh, shape, coordinate)
        holders.setdefault(tuple((s.start, s.stop) for s in blk), []).append(ranks[key] if ranks else rank)
    title = f"{tuple(shape)} {spec!r} on {mesh.describe()}"
    sharded = [d for d in range(len(shape)) if len({k[d] for k in holders}) > 1]
    if len(sharded) > 2:
        lines = [title] + [f"  [{', '.join(f'{a}:{b}' for a, b in k)}]  {_ranks(v)}" for k, v in holders.items()]
        return "\n".join(lines)
    rows_dim = sharded[0] if sharded else None
    cols_dim = sharded[1] if len(sharded) > 1 else None
    rows = sorted({k[rows_dim] for k in holders}) if rows_dim is not None else [None]
    cols = sorted({k[cols_dim] for k in holders}) if cols_dim is not None else [None]
    cell = {}
    for k, v in holders.items():
        cell[(k[rows_dim] if rows_dim is not None else None, k[cols_dim] if cols_dim is not None else None)] = _ranks(v)
    if rows_dim is not None and cols_dim is None and rows_dim == len(shape) - 1:  # a split last dim draws as a row
        rows, cols, cell = [None], rows, {(None, c): t for (c, _), t in cell.items()}
    width = max(len(t) for t in cell.values()) + 2
    sep = lambda left, mid, right: left + mid.join("─" * width for _ in cols) + right  # noqa: E731
    out = [title, sep("┌", "┬", "┐")]
    for i, r in enumerate(rows):
        out.append("│" + "│".join(cell[(r, c)].center(width) for c in cols) + "│")
        out.append(sep("├", "┼", "┤") if i < len(rows) - 1 else sep("└", "┴", "┘"))
    return "\n".join(out)


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, sorted(ranks)))
