"""Config: the whole run as immutable data, from a recipe file plus tyro overrides.

Every struct is frozen and validated when built; `Config.resolve(world_size)` fills the mesh and
runs the checks that need the world size. Derived numbers are properties, never stored fields.
"""

from __future__ import annotations

import importlib.util
from typing import Annotated, Literal

import msgspec

from shardlab._base import Frozen, Positive, revalidate
from shardlab._errors import ShardlabError
from shardlab._glob import glob_regex
from shardlab.config.model import ModelConfig as ModelConfig  # the run's model, re-exported with its parts
from shardlab.config.model import MoEConfig as MoEConfig
from shardlab.config.model import RopeScaling as RopeScaling
from shardlab.config.model import check_tp_divisors as check_tp_divisors
from shardlab.sharding.mesh import MeshSpec
from shardlab.sharding.plan_config import PlanConfig as PlanConfig

NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class OptimConfig(Frozen):
    """AdamW with linear warmup then cosine (or linear) decay, and global-norm gradient clipping."""

    lr: float = 8e-4
    """Peak learning rate, reached after warmup_steps."""
    min_lr_ratio: float = 0.0
    """Final learning rate as a fraction of lr."""
    warmup_steps: NonNegative = 2
    """Steps of linear warmup from lr / (warmup_steps + 1)."""
    decay: Literal["cosine", "linear"] = "cosine"
    """Shape of the decay from lr to lr * min_lr_ratio over the remaining steps."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam beta1, beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to every parameter but those `no_decay` names."""
    max_norm: float | None = 1.0
    """Clip gradients to this global L2 norm; None disables clipping."""
    no_decay: tuple[str, ...] = ()
    """Parameter globs (the rules' globs: `*` within a name part, `**` across parts) without weight decay, e.g.
    `'**.bias' '**norm.weight' '**.embed_tokens.weight'`; empty: decay everywhere, as torchtitan."""
    lr_scales: tuple[tuple[str, float], ...] = ()
    """(glob, factor) pairs: the first glob a parameter matches scales its learning rate by that factor."""

    def check(self) -> None:
        if self.lr <= 0:
            raise ShardlabError(f"optim.lr={self.lr}: must be > 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ShardlabError(f"optim.min_lr_ratio={self.min_lr_ratio}: must be within [0, 1]")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ShardlabError(f"optim.betas={self.betas}: each must be within [0, 1)")
        if self.eps <= 0:
            raise ShardlabError(f"optim.eps={self.eps}: must be > 0")
        if self.weight_decay < 0:
            raise ShardlabError(f"optim.weight_decay={self.weight_decay}: must be >= 0")
        if self.max_norm is not None and self.max_norm <= 0:
            raise ShardlabError(f"optim.max_norm={self.max_norm}: must be > 0, or None to disable clipping")
        for glob, factor in self.lr_scales:
            if factor < 0:
                raise ShardlabError(f"optim.lr_scales: {glob!r} has factor {factor}; factors must be >= 0")
        for field, globs in (("no_decay", self.no_decay), ("lr_scales", tuple(g for g, _ in self.lr_scales))):
            for glob in globs:
                try:
                    glob_regex(glob)
                except ValueError as e:
                    raise ShardlabError(f"optim.{field}: {e}") from None


class DataConfig(Frozen):
    """Where tokens come from. The default needs no download: the source text of Python's standard library."""

    source: Literal["stdlib", "synthetic", "files"] = "stdlib"
    """stdlib: the source files of this Python's standard library, byte-level tokens; synthetic: random
    tokens; files: `paths` (.txt, .jsonl, or pre-tokenized .bin)."""
    paths: tuple[str, ...] = ()
    """Files for source=files: .txt / .jsonl (text), .bin (pre-tokenized), or datasets read through Hugging Face
    `datasets` and tokenized once into cache_dir: .parquet / .arrow files and directories of .parquet, .arrow or
    .jsonl files (and, for format='chat', a single .jsonl file too: rendering a conversation costs far more than
    tokenizing text)."""
    jsonl_field: str = "text"
    """Field holding the text in each JSONL line or dataset row."""
    cache_dir: str | None = None
    """Where datasets (.parquet, .arrow, directories) are tokenized once and kept; None: data-cache in the run
    directory."""
    bin_dtype: Literal["uint16", "uint32"] = "uint16"
    """Token dtype of .bin files."""
    tokenizer: str | None = None
    """A local tokenizer for text (a transformers tokenizer directory or a tokenizer.json; never downloaded). None:
    the transformers model directory's own tokenizer when it has one (model.hf_path), else byte-level tokens."""
    seed: int = 1234
    """Seed of the data order (and of synthetic tokens)."""
    format: Literal["text", "chat"] = "text"
    """text: documents of text (or tokens); chat: JSONL lines or dataset rows whose `messages` ([{role, content}])
    the tokenizer's chat template renders, the loss on the assistant's tokens only (supervised fine-tuning); each
    row holds whole conversations, padded at its end."""
    truncate: bool = False
    """A chat conversation longer than train.seq_len tokens: cut to its first seq_len (True), or an error naming it
    before launch (False)."""
    document_masks: bool = False
    """Packed rows keep their documents apart: attention never crosses a document boundary, positions restart at
    each document, and a document's last token is not trained to predict the next one's first (shardlab.data.packing).
    False: rows are plain windows of the token stream."""

    def check(self) -> None:
        if self.format == "chat" and self.source != "files":
            raise ShardlabError(
                f"data.format='chat' reads chat files, not data.source={self.source!r}; set --data.source files"
            )
        if self.document_masks and self.source == "synthetic":
            raise ShardlabError(
                "data.document_masks is set but data.source='synthetic' has no documents; drop --data.document-masks"
            )
        if self.source == "files" and not self.paths:
            raise ShardlabError("data.paths is empty but data.source='files'; pass --data.paths FILE [FILE ...]")
        if self.source != "files" and self.paths:
            raise ShardlabError(f"data.paths is set but data.source={self.source!r}; set --data.source files")
        if self.tokenizer is not None and self.source == "synthetic":
            raise ShardlabError(
                "data.tokenizer is set but data.source='synthetic' draws random ids; drop --data.tokenizer"
            )
        if self.tokenizer is not None and self.paths and all(p.endswith(".bin") for p in self.paths):
            raise ShardlabError(
                "data.tokenizer is set but every file in data.paths is pre-tokenized .bin; drop --data.tokenizer"
            )


class TrainConfig(Frozen):
    """The optimization run: steps, batch (the same maths whatever the layout), seed, where to write."""

    steps: Positive = 20
    """Optimizer steps."""
    global_batch: Positive = 8
    """Sequences per optimizer step, summed over all data-parallel ranks and accumulation steps."""
    micro_batch: Positive | None = None
    """Sequences per data-parallel rank per forward; None = global_batch / dp (no accumulation)."""
    seq_len: Positive = 256
    """Tokens per sequence."""
    seed: int = 42
    """Seed of the initialisation (the data order has its own, data.seed)."""
    init: Literal["full", "sharded"] = "full"
    """full: every rank builds the whole model from the seed, then shards it (every layout starts from the same
    weights); sharded: apply the plan on the meta device, then initialise only each rank's shards (memory of one
    shard, for models that do not fit one device; values then depend on the layout)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: CUDA when available (NCCL), else CPU (gloo)."""
    run_dir: str = "runs/{name}"
    """Output directory (config.json, plan.json, metrics.jsonl); {name} is replaced by Config.name."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """A step whose loss or gradient norm is not finite: stop (an error naming the step, before the update, so no
    checkpoint holds the broken state) or skip (no update; counted as `skipped_steps` in the metrics)."""
    keep_freed_memory: bool = True
    """On CPU: the process's malloc keeps the memory tensors free and reuses it, instead of returning it to the
    system and page-faulting it in again for the next tensor (`shardlab.training._malloc`; glibc only). Resident memory then
    stays at its high-water mark. No effect on CUDA, whose caching allocator already does this."""

    def grad_accum(self, dp: int) -> int:
        """Accumulation steps for a data-parallel size `dp` (validated by Config.resolve)."""
        per_rank = self.global_batch // dp
        return per_rank // (self.micro_batch or per_rank)


class LogConfig(Frozen):
    """Progress bar, log lines, metrics.jsonl and wandb."""

    every: Positive = 1
    """Log (and write metrics.jsonl) every this many steps."""
    progress: bool = True
    """Show a rich progress bar on rank 0."""
    wandb: Literal["offline", "online", "disabled"] = "offline"
    """wandb mode: offline never touches the network; online only when asked."""
    wandb_project: str = "shardlab"
    """wandb project name."""
    peak_tflops: float | None = None
    """Per-device peak TFLOP/s for the MFU estimate; None looks known GPUs up (bf16 dense), no MFU on CPU."""
    profile_step: Positive | None = None
    """Trace this step with torch.profiler: every rank writes run_dir/profile/rank<r>.json (Chrome trace format:
    chrome://tracing or Perfetto) and rank 0 prints its ten most expensive ops; None: no profiling."""


class EvalConfig(Frozen):
    """A held-out loss while training: every `every` steps, `steps` global batches that training never sees."""

    every: NonNegative = 0
    """Evaluate after every N-th step (and after the last); 0 turns evaluation off."""
    steps: Positive = 10
    """Global batches per evaluation (the same ones each time, so evaluations compare)."""
    paths: tuple[str, ...] = ()
    """Held-out files (.txt, .jsonl, .bin, read as data.paths are); empty: the last 1% of the training documents
    (at least one; a single document gives its last 1% of tokens), which training then leaves out."""


class CheckpointConfig(Frozen):
    """Checkpoints of the whole TrainState in run_dir/checkpoints (DCP: reshardable to any mesh)."""

    every: Positive | None = None
    """Save every this many steps (and after the last step); None saves only when SIGTERM stops the run."""
    keep: Positive | None = 3
    """Keep the newest this many committed checkpoints; None keeps all."""
    resume: str = "auto"
    """auto: the newest committed checkpoint in the run directory, if any; none: start fresh; or a step directory.
    A restart (--max-restarts) resumes auto once the run directory holds a checkpoint."""
    async_save: bool = False
    """Write checkpoints in the background while training continues (committed before the next save)."""
    init_from_hf: str | None = None
    """Start from the weights of a Hugging Face Llama directory (safetensors) when there is nothing to resume."""

    def check(self) -> None:
        if self.async_save and self.every is None:
            raise ShardlabError("checkpoint.async_save is set but checkpoint.every is not; set --checkpoint.every N")
        if not self.resume:
            raise ShardlabError("checkpoint.resume is empty; use auto, none, or a step directory")


CPU_OFFLOAD_ON_CPU = (
    "plan.cpu_offload on the CPU: FSDP's offload keeps a GPU run's parameters, gradients and optimizer state in host "
    "memory, where a CPU run holds them already; set plan.cpu_offload=False, or train on CUDA (train.device='cuda')"
)
"""The refusal of plan.cpu_offload where the run's device is the CPU (Config.check where train.device says so,
`shardlab.training.loop.check_init` where "auto" finds no GPU)."""


class Config(Frozen):
    """A complete run: mesh, model, plan options, optimizer, data, training, logging."""

    name: str = "shardlab"
    """Run name (used in run_dir and by wandb)."""
    mesh: MeshSpec = MeshSpec()
    """Named mesh axes; -1 on one axis fills the rest of the world."""
    model: ModelConfig = ModelConfig()
    """Llama architecture."""
    plan: PlanConfig = PlanConfig()
    """Layout options applied on top of the model's rules."""
    optim: OptimConfig = OptimConfig()
    """Optimizer and learning-rate schedule."""
    data: DataConfig = DataConfig()
    """Training data."""
    train: TrainConfig = TrainConfig()
    """Steps, batch, seed, output directory."""
    log: LogConfig = LogConfig()
    """Logging."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """Checkpointing."""
    eval: EvalConfig = EvalConfig()
    """Held-out evaluation."""

    def check(self) -> None:
        m, tp = self.model, self.mesh.tp
        if m.hf_path is None:  # a transformers model is checked when its directory is read (provider_for)
            check_tp_divisors(m.tp_divisors(), tp)
        if tp > 1 and self.plan.sequence_parallel and self.train.seq_len % tp:
            raise ShardlabError(
                f"train.seq_len={self.train.seq_len} is not divisible by mesh.tp={tp}; sequence parallel shards the "
                "sequence over tp: change seq_len, or set plan.sequence_parallel=False"
            )
        ep, experts = self.mesh.ep, m.moe.n_experts if m.moe is not None else 0
        if ep > 1 and m.hf_path is None and (not experts or experts % ep):  # a transformers model's: its provider
            raise ShardlabError(
                f"mesh.ep={ep} needs model.moe with n_experts divisible by it (each ep rank holds n_experts / ep of "
                f"them), not {experts}; set model.moe, or pick an ep that divides n_experts"
            )
        if m.moe is not None and self.data.format == "chat":
            raise ShardlabError(
                "data.format='chat' with model.moe: the padding that ends chat rows would be routed, counted in the "
                "routers' balancing statistics and take expert capacity; fine-tune a dense model, or a transformers "
                "MoE model (model.hf_path)"
            )
        if m.moe is not None and self.plan.compile:
            raise ShardlabError(
                "plan.compile with model.moe: the experts' token counts change with every batch, so torch.compile "
                "recompiles the expert loop until its recompile limit (minutes on CPU) and then runs it eagerly; set "
                "plan.compile=False"
            )
        if self.plan.compile and self.plan.activation_checkpoint == "op" and (self.mesh.tp > 1 or self.mesh.cp > 1):
            raise ShardlabError(
                "plan.compile with plan.activation_checkpoint='op' under mesh.tp or mesh.cp: with collectives inside "
                "the compiled block, torch 2.13 computes wrong gradients (the loss was 0.9 off after 4 steps on TP 2); "
                "use activation_checkpoint='full' or 'selective' with compile, or plan.compile=False"
            )
        if m.moe is not None and self.mesh.pp > 1 and self.plan.pp_balance == "flops":
            raise ShardlabError(
                "plan.pp_balance='flops' with model.moe: FLOPs are counted on the meta device, where tokens cannot be "
                "routed; use pp_balance='blocks' or 'params', or plan.pp_split"
            )
        cp = self.mesh.cp
        if cp > 1:
            if self.train.seq_len % (2 * cp):
                raise ShardlabError(
                    f"train.seq_len={self.train.seq_len} is not divisible by 2 x mesh.cp = {2 * cp}: context parallelism "
                    "gives each cp rank two chunks of the sequence; change seq_len or cp"
                )
            if tp > 1 and self.plan.sequence_parallel and (self.train.seq_len // cp) % tp:
                raise ShardlabError(
                    f"train.seq_len / mesh.cp = {self.train.seq_len // cp} tokens per cp rank are not divisible by "
                    f"mesh.tp={tp} for sequence parallelism; change seq_len, or set plan.sequence_parallel=False"
                )
        if self.mesh.is_resolved:
            self._check_batch(self.mesh.size("dp"))
        if self.log.profile_step is not None and self.log.profile_step > self.train.steps:
            raise ShardlabError(
                f"log.profile_step={self.log.profile_step} is after the run's last step (train.steps="
                f"{self.train.steps}); pick a step in 1..{self.train.steps}, past the first (warm-up) one"
            )
        if self.plan.fp8 != "none" and importlib.util.find_spec("torchao") is None:
            raise ShardlabError(
                f"plan.fp8={self.plan.fp8!r} needs torchao: pip install 'shardlab[fp8]', or set plan.fp8='none'"
            )
        if self.plan.cpu_offload and self.train.device == "cpu":
            raise ShardlabError(CPU_OFFLOAD_ON_CPU)
        if self.plan.cpu_offload and self.train.init == "sharded":
            raise ShardlabError(
                "plan.cpu_offload with train.init='sharded' is not supported yet (the shards are drawn on the GPU, "
                "and FSDP's offload wants them on the host before its first step); use train.init='full'"
            )
        if self.train.init == "sharded" and m.tie_embeddings:
            raise ShardlabError(
                "train.init='sharded' with model.tie_embeddings=True is not supported yet (the tie must be made before "
                "FSDP wraps the weights); use train.init='full'"
            )

    def _check_batch(self, dp: int) -> None:
        t = self.train
        if t.global_batch % dp:
            raise ShardlabError(
                f"train.global_batch={t.global_batch} is not divisible by the data-parallel size dp_replicate x dp_shard = {dp}; "
                "pick a global_batch that is a multiple of it"
            )
        per_rank = t.global_batch // dp
        if self.mesh.pp > 1:
            if t.micro_batch is not None:
                raise ShardlabError(
                    f"train.micro_batch with mesh.pp={self.mesh.pp}: the pipeline splits each batch into "
                    "plan.pp_microbatches; leave train.micro_batch unset"
                )
            m = self.micro_batches
            if per_rank % m:
                raise ShardlabError(
                    f"plan.pp_microbatches={m} does not divide the {per_rank} sequences each data-parallel rank gets per "
                    f"step (global_batch {t.global_batch} / dp {dp}); pick pp_microbatches dividing {per_rank}"
                )
        if t.micro_batch is not None and per_rank % t.micro_batch:
            raise ShardlabError(
                f"train.micro_batch={t.micro_batch} does not divide the {per_rank} sequences each data-parallel rank gets "
                f"per step (global_batch {t.global_batch} / dp {dp}); pick a micro_batch dividing {per_rank}"
            )

    @property
    def micro_batches(self) -> int:
        """Micro batches per step on every rank: the pipeline's (plan.pp_microbatches, default one per stage), else
        train.grad_accum. The loader makes micro batch i the same sequences in every layout with this count."""
        if self.mesh.pp > 1:
            return self.plan.pp_microbatches or self.mesh.pp * self.plan.pp_stages_per_rank
        if not self.mesh.is_resolved:
            raise ShardlabError("Config.micro_batches: the mesh has a -1 axis; call cfg.resolve(world_size) first")
        return self.train.grad_accum(self.mesh.size("dp"))

    def resolve(self, world_size: int) -> Config:
        """Fill the mesh for `world_size` and run the checks that need it."""
        cfg = msgspec.structs.replace(self, mesh=self.mesh.resolve(world_size))
        cfg._check_batch(cfg.mesh.size("dp"))
        return cfg

    def validated(self) -> Config:
        """Re-check `msgspec.Meta` constraints (tyro builds structs without them)."""
        return revalidate(self)

    @property
    def run_dir(self) -> str:
        return self.train.run_dir.replace("{name}", self.name)
