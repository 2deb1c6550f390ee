"""MeshSpec -> torch's DeviceMesh: the mesh with every shardlab axis and its flattened views (`make_mesh`), the
expert mesh over the same ranks (`make_expert_mesh`), and back (`mesh_spec_of`). The one module that calls
DeviceMesh's private methods (`_flatten`, `_unflatten`, `_concatenate`, the root mesh's `_flatten_mapping`), as
shardlab.sharding._strided is for `_StridedShard`.

torch keeps flattened views on the root mesh (its own `_flatten_mapping`) but no unflattened mesh, and `_unflatten`
makes new process groups at each call: the expert mesh is made once, by `apply`, and handed to whoever needs it
(`shardlab.parallel.apply.Parallelized.experts`); nothing is written onto torch's DeviceMesh.
"""

from __future__ import annotations

from torch.distributed.tensor import DTensor, Replicate

from shardlab._errors import ShardlabError
from shardlab.sharding.mesh import AXES, EXPERT_AXES, FLAT_VIEWS, ExpertMeshSpec, MeshSpec
from shardlab.sharding.spec import Mesh, P, spec_from_placements


def mesh_spec_of(mesh, ep: int = 1) -> MeshSpec | ExpertMeshSpec:
    """The MeshSpec of a DeviceMesh from `make_mesh` or a slice of it (absent axes have size 1); the ExpertMeshSpec
    of a mesh over expert axes (an expert weight's). ep: the expert parallelism the whole mesh is used with, which a
    DeviceMesh does not record (the plan's `mesh.ep`); a slice has no ep of its own."""
    names = tuple(mesh.mesh_dim_names or ())
    sizes = {n: mesh.size(i) for i, n in enumerate(names)}
    if {"ep", "dp_shard_mod_ep"} & set(names):
        unknown = [n for n in names if n not in EXPERT_AXES]
        if unknown:
            raise ShardlabError(f"mesh dims {unknown} are not expert mesh axes ({', '.join(EXPERT_AXES)})")
        return ExpertMeshSpec(**{a: sizes.get(a, 1) for a in EXPERT_AXES})
    unknown = [n for n in names if n not in AXES]
    if unknown:
        raise ShardlabError(
            f"mesh dims {unknown} are not shardlab axes ({', '.join(AXES)}); use a mesh from make_mesh or a slice of it"
        )
    return MeshSpec(**{a: sizes.get(a, 1) for a in AXES}, ep=ep if names == AXES else 1)


def make_mesh(spec: MeshSpec, device_type: str = "cpu"):
    """Build the torch DeviceMesh with every axis of `spec` plus the flattened views.

    Needs an initialised process group whose world size equals the mesh size.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise ShardlabError(
            "make_mesh: no process group; start under torchrun (or call torch.distributed.init_process_group)"
        )
    world = dist.get_world_size()
    spec = spec.resolve(world)
    mesh = init_device_mesh(device_type, spec.axis_sizes, mesh_dim_names=AXES)
    for name, axes in FLAT_VIEWS.items():
        mesh[axes]._flatten(name)
    return mesh


def make_expert_mesh(mesh, ep: int):
    """The expert mesh over the ranks of `mesh` (from `make_mesh`) for expert parallelism `ep` > 1: its `batch`
    view (dp_replicate x dp_shard x cp) cut into (dp_replicate, dp_shard_mod_ep, ep), as `MeshSpec.experts` says.
    It makes process groups: call it once per layout and pass the result on (`expert_mesh` slices it)."""
    e = mesh_spec_of(mesh, ep).experts
    return flat_view(mesh, "batch")._unflatten(
        0, (e.dp_replicate, e.dp_shard_mod_ep, e.ep), ("dp_replicate", "dp_shard_mod_ep", "ep")
    )


def expert_mesh(experts, mesh, axes: tuple[str, ...]):
    """The DeviceMesh over expert mesh axes `axes` (from EXPERT_AXES), from `experts` (`make_expert_mesh(mesh, ep)`)
    and `mesh` for the axes the two share (tp, pp): ("ep",) or ("ep", "tp") holds the expert weights,
    ("dp_shard_mod_ep",) or ("dp_replicate", "dp_shard_mod_ep") is FSDP's mesh for them. Makes no process group."""
    from torch.distributed.device_mesh import DeviceMesh

    parts = [experts[a] if a in experts.mesh_dim_names else mesh[a] for a in axes]
    if len(parts) == 1:
        return parts[0]
    if all(a in experts.mesh_dim_names for a in axes):
        return experts[axes]
    return DeviceMesh._concatenate(parts)  # ep x tp: slices of two meshes over the same root


def flat_view(mesh, name: str):
    """The 1-D DeviceMesh of a flattened view (`dp`, `dp_shard_cp`, `batch`) made by `make_mesh`.

    torch keeps flattened meshes on the root mesh; slicing them from the root by name is deprecated.
    """
    if name not in FLAT_VIEWS:
        raise ShardlabError(f"unknown flattened view {name!r}; valid views are {', '.join(FLAT_VIEWS)}")
    return mesh._get_root_mesh()._flatten_mapping[name]


def placed_spec(x: DTensor) -> tuple[P, Mesh, tuple[str, ...]]:
    """A DTensor's PartitionSpec, the MeshSpec of its mesh, and its mesh's dims as that MeshSpec's axes.

    FSDP's flattened dp_shard x cp view chunks a dim in one go, as a single axis would: it reads as a dp_shard of
    that size. Axes of size 1 hold everything whatever their placement (FSDP leaves a _StridedShard there)."""
    mesh = x.device_mesh
    names = tuple(mesh.mesh_dim_names or ())
    if "dp_shard_cp" in names:
        names = tuple("dp_shard" if n == "dp_shard_cp" else n for n in names)
        spec_mesh: Mesh = MeshSpec(**{a: 1 for a in AXES} | {n: mesh.size(i) for i, n in enumerate(names)})
    else:
        spec_mesh = mesh_spec_of(mesh)
    by_axis = dict(zip(names, x.placements))
    full = [by_axis.get(a, Replicate()) if spec_mesh.size(a) > 1 else Replicate() for a in spec_mesh.axis_names]
    return spec_from_placements(full, spec_mesh, x.ndim), spec_mesh, names
