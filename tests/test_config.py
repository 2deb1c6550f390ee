"""Config: defaults build, every cross-field check names its field, JSON round trip, msgspec.Meta re-validation.

Run: pytest tests/test_config.py -q
"""

from __future__ import annotations

import re

import msgspec
import pytest
from msgspec.structs import replace

from shardlab.config import (
    CheckpointConfig,
    Config,
    DataConfig,
    LogConfig,
    ModelConfig,
    MoEConfig,
    OptimConfig,
    PlanConfig,
    TrainConfig,
)
from shardlab.sharding.mesh import MeshSpec

STRUCTS = [Config, ModelConfig, PlanConfig, OptimConfig, DataConfig, TrainConfig, LogConfig, CheckpointConfig, MeshSpec]


@pytest.mark.parametrize("cls", STRUCTS, ids=lambda c: c.__name__)
def test_defaults_build_and_round_trip_json(cls) -> None:
    value = cls()
    assert msgspec.json.decode(msgspec.json.encode(value), type=cls) == value


def test_default_config_resolves() -> None:
    cfg = Config().resolve(4)
    assert cfg.mesh.axis_sizes == (1, 1, 4, 1, 1)
    assert cfg.train.grad_accum(cfg.mesh.size("dp")) == 1
    assert cfg.run_dir == "runs/shardlab"


def test_non_default_config_round_trips_json() -> None:
    cfg = Config(
        name="rt",
        mesh=MeshSpec(dp_replicate=2, dp_shard=2, tp=2),
        model=ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256, rope_scaling=None),
        plan=PlanConfig(sequence_parallel=False, activation_checkpoint="selective", param_dtype="bfloat16"),
        optim=OptimConfig(betas=(0.8, 0.9), max_norm=None, decay="linear"),
        data=DataConfig(source="files", paths=("a.txt", "b.bin")),
        train=TrainConfig(global_batch=16, micro_batch=2, seq_len=64),
    )
    data = msgspec.json.encode(cfg)
    assert msgspec.json.decode(data, type=Config) == cfg
    assert msgspec.convert(msgspec.to_builtins(cfg), Config) == cfg


# -- cross-field errors ------------------------------------------------------------------------------

TINY = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256)

ERRORS = [
    # (builder, message regex); every message starts with the config path of the field at fault.
    (
        lambda: Config(mesh=MeshSpec(tp=3), model=ModelConfig(**{**TINY, "n_heads": 4, "dim": 64})),
        r"^model\.n_heads=4 is not divisible by mesh\.tp=3; pick a tp that divides it$",
    ),
    (
        lambda: Config(mesh=MeshSpec(tp=4), model=ModelConfig(**{**TINY, "n_heads": 8, "n_kv_heads": 2})),
        r"^model\.n_kv_heads=2 is not divisible by mesh\.tp=4; pick a tp that divides it$",
    ),
    (
        lambda: Config(mesh=MeshSpec(tp=2), model=ModelConfig(**{**TINY, "ffn_dim": 129})),
        r"^model\.ffn_dim=129 is not divisible by mesh\.tp=2; pick a tp that divides it$",
    ),
    (
        lambda: Config(mesh=MeshSpec(tp=2), model=ModelConfig(**{**TINY, "vocab_size": 255})),
        r"^model\.vocab_size=255 is not divisible by mesh\.tp=2; pick a tp that divides it$",
    ),
    (
        lambda: Config(mesh=MeshSpec(tp=2), model=ModelConfig(**TINY), train=TrainConfig(seq_len=33)),
        r"^train\.seq_len=33 is not divisible by mesh\.tp=2; sequence parallel shards the sequence over tp: "
        r"change seq_len, or set plan\.sequence_parallel=False$",
    ),
    (
        lambda: Config(mesh=MeshSpec(dp_shard=3), train=TrainConfig(global_batch=8)),
        r"^train\.global_batch=8 is not divisible by the data-parallel size dp_replicate x dp_shard = 3; "
        r"pick a global_batch that is a multiple of it$",
    ),
    (
        lambda: Config(train=TrainConfig(global_batch=8)).resolve(3),
        r"^train\.global_batch=8 is not divisible by the data-parallel size dp_replicate x dp_shard = 3",
    ),
    (
        lambda: Config(mesh=MeshSpec(dp_replicate=2, dp_shard=-1, tp=2), model=ModelConfig(**TINY)).resolve(12),
        r"^train\.global_batch=8 is not divisible by the data-parallel size dp_replicate x dp_shard = 6",
    ),
    (
        lambda: Config(train=TrainConfig(global_batch=8, micro_batch=3)).resolve(2),
        r"^train\.micro_batch=3 does not divide the 4 sequences each data-parallel rank gets per step "
        r"\(global_batch 8 / dp 2\); pick a micro_batch dividing 4$",
    ),
    (
        lambda: Config(mesh=MeshSpec(dp_shard=-1, tp=-1)),
        r"^mesh: mesh\.dp_shard and mesh\.tp are all -1",
    ),
    # tp filled by -1 is checked once known (structs.replace re-runs Config.__post_init__).
    (
        lambda: Config(mesh=MeshSpec(dp_shard=1, tp=-1)).resolve(3),
        r"^model\.n_heads=16 is not divisible by mesh\.tp=3",
    ),
    (
        lambda: Config(mesh=MeshSpec(dp_shard=3, tp=2), train=TrainConfig(global_batch=6)).resolve(8),
        r"^mesh: dp_shard=3 x tp=2 = 6 ranks but world_size is 8; ",
    ),
    (
        lambda: ModelConfig(dim=48, n_heads=16, n_kv_heads=16),
        r"^model: head_dim=3 is odd; RoPE needs an even head_dim$",
    ),
    (lambda: ModelConfig(dim=64, n_heads=6, n_kv_heads=6), r"^model\.dim=64 is not divisible by model\.n_heads=6; "),
    (
        lambda: ModelConfig(dim=64, n_heads=4, n_kv_heads=3),
        r"^model\.n_heads=4 is not divisible by model\.n_kv_heads=3; grouped-query attention needs n_kv_heads dividing n_heads$",
    ),
    (
        lambda: DataConfig(source="files"),
        r"^data\.paths is empty but data\.source='files'; pass --data\.paths FILE \[FILE \.\.\.\]$",
    ),
    (
        lambda: DataConfig(paths=("a.txt",)),
        r"^data\.paths is set but data\.source='stdlib'; set --data\.source files$",
    ),
    (
        lambda: DataConfig(source="synthetic", paths=("a.txt",)),
        r"^data\.paths is set but data\.source='synthetic'; ",
    ),
    (
        lambda: CheckpointConfig(async_save=True),
        r"^checkpoint\.async_save is set but checkpoint\.every is not; set --checkpoint\.every N$",
    ),
    (lambda: OptimConfig(lr=0.0), r"^optim\.lr=0\.0: must be > 0$"),
    (lambda: OptimConfig(lr=-1e-3), r"^optim\.lr=-0\.001: must be > 0$"),
    (lambda: OptimConfig(min_lr_ratio=-0.1), r"^optim\.min_lr_ratio=-0\.1: must be within \[0, 1\]$"),
    (lambda: OptimConfig(min_lr_ratio=1.5), r"^optim\.min_lr_ratio=1\.5: must be within \[0, 1\]$"),
    (lambda: OptimConfig(max_norm=0.0), r"^optim\.max_norm=0\.0: must be > 0, or None to disable clipping$"),
    (lambda: OptimConfig(betas=(0.9, 1.5)), r"^optim\.betas=\(0\.9, 1\.5\): each must be within \[0, 1\)$"),
    (lambda: OptimConfig(betas=(1.0, 0.95)), r"^optim\.betas=\(1\.0, 0\.95\): each must be within \[0, 1\)$"),
    (lambda: OptimConfig(betas=(-0.1, 0.95)), r"^optim\.betas=\(-0\.1, 0\.95\): each must be within \[0, 1\)$"),
    (lambda: OptimConfig(eps=0.0), r"^optim\.eps=0\.0: must be > 0$"),
    (lambda: OptimConfig(weight_decay=-0.1), r"^optim\.weight_decay=-0\.1: must be >= 0$"),
    (
        lambda: Config(
            model=ModelConfig(**TINY, moe=MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=64)),
            data=DataConfig(source="files", paths=("chats.jsonl",), format="chat"),
        ),
        r"^data\.format='chat' with model\.moe: the padding that ends chat rows would be routed",
    ),
    (
        lambda: Config(train=TrainConfig(steps=3), log=LogConfig(profile_step=4)),
        r"^log\.profile_step=4 is after the run's last step \(train\.steps=3\); pick a step in 1\.\.3",
    ),
    (
        lambda: Config(
            model=ModelConfig(**TINY, moe=MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=64)),
            plan=PlanConfig(compile=True),
        ),
        r"^plan\.compile with model\.moe: the experts' token counts change with every batch",
    ),
    (
        lambda: Config(mesh=MeshSpec(tp=2), plan=PlanConfig(compile=True, activation_checkpoint="op")),
        r"^plan\.compile with plan\.activation_checkpoint='op' under mesh\.tp or mesh\.cp: .* computes wrong gradients",
    ),
    (
        lambda: Config(plan=PlanConfig(cpu_offload=True), train=TrainConfig(device="cpu")),
        r"^plan\.cpu_offload on the CPU: .*; set plan\.cpu_offload=False, or train on CUDA \(train\.device='cuda'\)$",
    ),
    (
        lambda: Config(plan=PlanConfig(cpu_offload=True), train=TrainConfig(init="sharded")),
        r"^plan\.cpu_offload with train\.init='sharded' is not supported yet .*; use train\.init='full'$",
    ),
    # Nested structs are validated as they are decoded, with the JSON path appended by msgspec.
    (
        lambda: msgspec.json.decode(b'{"data": {"source": "files"}}', type=Config),
        r"^data\.paths is empty but data\.source='files'; .* - at `\$\.data`$",
    ),
    (
        lambda: msgspec.json.decode(b'{"mesh": {"tp": 3}}', type=Config),
        r"^model\.n_heads=16 is not divisible by mesh\.tp=3; pick a tp that divides it$",
    ),
]


@pytest.mark.parametrize(("build", "message"), ERRORS)
def test_errors(build, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()


ACCEPTED = [
    # The other side of each check: what must build.
    lambda: Config(
        mesh=MeshSpec(tp=2),
        model=ModelConfig(**TINY),
        plan=PlanConfig(sequence_parallel=False),
        train=TrainConfig(seq_len=33),
    ),
    lambda: Config(mesh=MeshSpec(tp=1), model=ModelConfig(**{**TINY, "vocab_size": 255})),  # tp=1 divides anything
    lambda: Config(mesh=MeshSpec(tp=4), model=ModelConfig(**{**TINY, "n_heads": 8, "n_kv_heads": 4})),
    lambda: Config(train=TrainConfig(global_batch=8)).resolve(8),
    lambda: Config(train=TrainConfig(global_batch=8, micro_batch=2)).resolve(2),
    lambda: Config(mesh=MeshSpec(dp_replicate=2, dp_shard=2, tp=2), model=ModelConfig(**TINY)).resolve(8),
    lambda: DataConfig(source="files", paths=("a.txt",)),
    lambda: OptimConfig(min_lr_ratio=0.0, max_norm=None),
    lambda: OptimConfig(min_lr_ratio=1.0),
    lambda: OptimConfig(betas=(0.0, 0.999), weight_decay=0.0),
    lambda: ModelConfig(dim=64, n_heads=4, n_kv_heads=1),
    lambda: Config(plan=PlanConfig(cpu_offload=True)),  # train.device='auto': on CUDA where there is one
    lambda: Config(plan=PlanConfig(cpu_offload=True), train=TrainConfig(device="cuda")),
]


@pytest.mark.parametrize("build", ACCEPTED)
def test_accepted(build) -> None:
    build()


# -- unknown fields, msgspec.Meta ---------------------------------------------------------------------

UNKNOWN = [
    (b'{"mesh": {"tq": 2}}', r"^Object contains unknown field `tq` - at `\$\.mesh`$"),
    (b'{"trian": {}}', r"^Object contains unknown field `trian`$"),
    (
        b'{"model": {"rope_scaling": {"factr": 2.0}}}',
        r"^Object contains unknown field `factr` - at `\$\.model\.rope_scaling`$",
    ),
]


@pytest.mark.parametrize(("data", "message"), UNKNOWN)
def test_unknown_field_rejected(data: bytes, message: str) -> None:
    with pytest.raises(msgspec.ValidationError, match=message):
        msgspec.json.decode(data, type=Config)
    assert issubclass(msgspec.ValidationError, ValueError)  # so callers can catch ValueError for any bad config


META = [
    # (field path, bad value, message): Meta constraints hold when decoding ...
    (("train", "steps"), 0, r"^Expected `int` >= 1 - at `\$\.train\.steps`$"),
    (("train", "micro_batch"), 0, r"^Expected `int` >= 1 - at `\$\.train\.micro_batch`$"),
    (("optim", "warmup_steps"), -1, r"^Expected `int` >= 0 - at `\$\.optim\.warmup_steps`$"),
    (("model", "n_layers"), 0, r"^Expected `int` >= 1 - at `\$\.model\.n_layers`$"),
    (("mesh", "ep"), 0, r"^Expected `int` >= 1 - at `\$\.mesh\.ep`$"),
    (("plan", "ac_every"), 0, r"^Expected `int` >= 1 - at `\$\.plan\.ac_every`$"),
    (("plan", "activation_checkpoint"), "ops", r"^Invalid enum value 'ops' - at `\$\.plan\.activation_checkpoint`$"),
]


@pytest.mark.parametrize(("path", "value", "message"), META)
def test_meta_enforced_when_decoding(path: tuple[str, str], value: int, message: str) -> None:
    data = msgspec.json.encode({path[0]: {path[1]: value}})
    with pytest.raises(msgspec.ValidationError, match=message):
        msgspec.json.decode(data, type=Config)


@pytest.mark.parametrize(("path", "value", "message"), [m for m in META if m[0] != ("mesh", "ep")])
def test_meta_skipped_by_constructor_and_replace_but_caught_by_validated(path, value, message) -> None:
    # msgspec runs Meta constraints only when decoding/converting; __init__ and structs.replace skip them
    # (they do run __post_init__). tyro builds structs by calling them, hence Config.validated().
    section = getattr(Config(), path[0])
    cfg = replace(Config(), **{path[0]: replace(section, **{path[1]: value})})
    assert getattr(getattr(cfg, path[0]), path[1]) == value
    field_first = re.escape(f"{path[0]}.{path[1]}={value!r}: ") + message[1:].split(" - at ")[0] + "$"
    with pytest.raises(ValueError, match=f"^{field_first}"):  # led by the field, as every check's own message is
        cfg.validated()


def test_validated_returns_an_equal_config() -> None:
    cfg = Config(mesh=MeshSpec(dp_shard=2, tp=2), model=ModelConfig(**TINY))
    assert cfg.validated() == cfg


def test_a_checks_own_message_loses_msgspecs_path_when_revalidated() -> None:
    """A nested struct's check names its field itself: `validated` (the CLI's door) drops msgspec's `- at` path."""
    from shardlab._base import deferred_checks

    with deferred_checks():  # as the CLI builds an override before validating it
        cfg = replace(Config(), optim=replace(OptimConfig(), lr=-1.0))
    with pytest.raises(ValueError, match=r"^optim\.lr=-1\.0: must be > 0$"):
        cfg.validated()


def test_replace_runs_post_init() -> None:
    # What the CLI relies on: cross-field checks run on structs.replace too, not only on decode.
    with pytest.raises(ValueError, match=r"^model\.vocab_size=255 is not divisible by mesh\.tp=2"):
        replace(
            Config(mesh=MeshSpec(tp=2), model=ModelConfig(**TINY)), model=ModelConfig(**{**TINY, "vocab_size": 255})
        )
    with pytest.raises(ValueError, match=r"^optim\.lr=0: must be > 0$"):
        replace(OptimConfig(), lr=0)


def test_structs_are_frozen() -> None:
    cfg = Config()
    with pytest.raises(AttributeError):
        cfg.name = "x"  # type: ignore[misc]


# -- derived numbers -----------------------------------------------------------------------------------

GRAD_ACCUM = [
    # (global_batch, micro_batch, dp, accumulation steps)
    (8, None, 1, 1),
    (8, None, 8, 1),
    (8, 2, 2, 2),
    (8, 1, 2, 4),
    (8, 4, 2, 1),
    (64, 2, 4, 8),
    (512, 1, 128, 4),
]


@pytest.mark.parametrize(("global_batch", "micro_batch", "dp", "accum"), GRAD_ACCUM)
def test_grad_accum(global_batch: int, micro_batch: int | None, dp: int, accum: int) -> None:
    train = TrainConfig(global_batch=global_batch, micro_batch=micro_batch)
    assert train.grad_accum(dp) == accum
    cfg = Config(train=train).resolve(dp)  # the same numbers pass Config's checks
    assert cfg.train.grad_accum(cfg.mesh.size("dp")) == accum


N_PARAMS = [
    # torchtitan's llama3 debugmodel and the tiny test model (counted by hand)
    (ModelConfig(), 2048 * 256 * 2 + 6 * (256 * 256 * 4 + 3 * 256 * 768 + 2 * 256) + 256),
    (ModelConfig(**TINY), 256 * 64 * 2 + 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64) + 64),
    (ModelConfig(**TINY, tie_embeddings=True), 256 * 64 + 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64) + 64),
]


@pytest.mark.parametrize(("model", "n"), N_PARAMS)
def test_n_params(model: ModelConfig, n: int) -> None:
    assert model.n_params == n
    assert model.head_dim == model.dim // model.n_heads


def test_run_dir_substitutes_name() -> None:
    assert Config(name="x", train=TrainConfig(run_dir="out/{name}/a")).run_dir == "out/x/a"


def test_error_messages_are_one_line() -> None:
    for build, _ in ERRORS:
        with pytest.raises(ValueError) as info:
            build()
        assert "\n" not in str(info.value), str(info.value)
        assert re.match(r"^[\w.$`: ]", str(info.value))
