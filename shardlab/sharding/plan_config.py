"""PlanConfig: how the rules become a layout (sequence and loss parallel, FSDP, checkpointing, compile, the
pipeline's schedule and split), as data the planner reads; `Config.plan` holds one."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from tyro.conf import DisallowNone

from shardlab._base import Frozen, Positive
from shardlab.sharding.fp8 import Fp8Recipe
from shardlab.sharding.mesh import MeshSpec
from shardlab.sharding.pipeline import ZERO_BUBBLE, Balance, Schedule, check_schedule

Dtype = Literal["float32", "bfloat16"]  # no float16: it needs a gradient scaler shardlab does not have


class PlanConfig(Frozen):
    """How the rules become a layout: sequence/loss parallel, FSDP options, checkpointing, compile."""

    sequence_parallel: bool = True
    """Shard norms and the residual stream over tp along the sequence (needs seq_len % tp == 0)."""
    loss_parallel: bool = True
    """Keep the logits sharded over the vocabulary and compute the loss without gathering them."""
    reshard_after_forward: DisallowNone[bool | None] = None
    """FSDP: free gathered parameters after forward (ZeRO-3), or keep them until backward (ZeRO-2, False). Default
    (None): free them where FSDP shards over more than one rank; over one there is nothing to free, only the
    backward's gathers to repeat (and a zero-bubble pipeline schedule needs them kept)."""
    param_dtype: Dtype = "float32"
    """FSDP mixed precision: dtype of the gathered parameters, so of the compute."""
    reduce_dtype: Dtype = "float32"
    """FSDP mixed precision: dtype of gradient reduction."""
    cpu_offload: bool = False
    """FSDP: keep sharded parameters, grads and optimizer state in host memory, the optimizer step on the CPU (CUDA
    runs only: FSDP2's CPUOffloadPolicy; not with train.init='sharded')."""
    fp8: Fp8Recipe = "none"
    """Float8 matmuls through torchao (the `fp8` extra) in the blocks' linear layers whose dims are multiples of 16:
    tensorwise (with FSDP: float8 weights all-gathered), rowwise, or rowwise_with_gw_hp (the weight gradient in
    high precision). Needs a CUDA device of compute capability 8.9 or more, or the CPU (for tests)."""
    activation_checkpoint: Literal["none", "full", "selective", "op"] = "none"
    """Recompute activations in backward: none; every block (full); every `ac_every`-th block (selective); or in every
    block only the cheap ops, keeping the outputs of matmuls (every other one), attention and collectives (op:
    torchtitan's op-level selective checkpointing, `shardlab.parallel._activation_checkpoint.SAVED_OPS`)."""
    ac_every: Positive = 2
    """With selective checkpointing, checkpoint one block in this many."""
    compile: bool = False
    """torch.compile each transformer block (inductor; static shapes; not with model.moe: see Config.check)."""
    allow_unused_rules: bool = False
    """Accept rules that match no parameter (otherwise an error names them)."""
    allow_uncovered: bool = False
    """Replicate parameters that no rule covers (otherwise an error names them)."""
    allow_unused_axes: bool = False
    """Accept a model-parallel axis (tp) of size > 1 that no rule uses (otherwise every tp rank repeats the same work)."""
    pp_schedule: Schedule = "1f1b"
    """Pipeline schedule (mesh.pp > 1): gpipe, 1f1b; looped: interleaved_1f1b, looped_bfs, interleaved_zero_bubble;
    V-shaped: zbv_zero_bubble, dualpipev."""
    pp_stages_per_rank: Positive = 1
    """Pipeline stages each pp rank runs: 1 for gpipe/1f1b, >= 2 for looped schedules, 2 for V-shaped ones."""
    pp_microbatches: Annotated[int, msgspec.Meta(ge=1)] | None = None
    """Micro batches each data-parallel rank's batch is split into for the pipeline (default: the number of stages)."""
    pp_balance: Balance = "blocks"
    """Stage split: an even count of blocks, or the least work on the busiest stage: "flops" (training FLOPs per token
    of each block, the embeddings and the head, counted by torch on the meta device) or "params"."""
    pp_split: tuple[int, ...] = ()
    """Explicit split: the first block of every stage after the first (overrides pp_balance)."""

    def resharding(self, mesh: MeshSpec) -> tuple[bool, str]:
        """Whether FSDP frees its gathered parameters after forward on `mesh` (resolved), and why."""
        if self.reshard_after_forward is not None:
            return self.reshard_after_forward, "as set"
        if mesh.pp > 1 and self.pp_schedule in ZERO_BUBBLE:
            return False, f"{self.pp_schedule} computes weight gradients after the forward"
        if mesh.dp_shard * mesh.cp == 1:
            return False, "one shard: nothing to free"
        return True, "default"

    def check(self) -> None:
        check_schedule(self.pp_schedule, self.pp_stages_per_rank)
