"""The functional step on one process: schedule, clipping, accumulation and token averaging are exact."""

import copy
import math
import os
import sys

import msgspec
import pytest
import torch
import torch.nn.functional as F

from shardlab.config import Config, DataConfig, MeshSpec, ModelConfig, MoEConfig, OptimConfig, TrainConfig
from shardlab.data.loader import Batch
from shardlab.parallel._activation_checkpoint import is_checkpointed
from shardlab.parallel._compile import is_compiled
from shardlab.training.loop import build_model
from shardlab.training.step import NonFiniteError, clip_grad_norm, init_state, lr_schedule, make_step


@pytest.mark.parametrize(
    ("optim", "want"),
    [
        (OptimConfig(lr=1.0, warmup_steps=2), {0: 1 / 3, 1: 2 / 3, 2: 1.0, 6: 0.5, 10: 0.0}),
        (OptimConfig(lr=1.0, warmup_steps=2, decay="linear"), {2: 1.0, 6: 0.5, 8: 0.25, 10: 0.0, 12: 0.0}),
        (OptimConfig(lr=2.0, warmup_steps=0, min_lr_ratio=0.1), {0: 2.0, 10: 0.2}),
    ],
)
def test_lr_schedule(optim, want):
    lr_at = lr_schedule(optim, total_steps=10)
    for step, lr in want.items():
        assert lr_at(step) == pytest.approx(lr), step


def test_clip_grad_norm_matches_torch():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 3
    reference = copy.deepcopy(model)
    for a, b in zip(model.parameters(), reference.parameters()):
        b.grad = a.grad.clone()  # deepcopy does not copy .grad
    norm = clip_grad_norm(model, 1.0)
    want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    assert norm.item() == pytest.approx(want.item(), rel=1e-6)
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
    unclipped = [p.grad.clone() for p in model.parameters()]
    assert clip_grad_norm(model, 2.0).item() == pytest.approx(1.0, rel=1e-5)  # within max_norm: reported, unchanged
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), unclipped))


def tiny(micro_batch: int | None = None) -> Config:
    return Config(
        mesh=MeshSpec(dp_shard=1),
        model=ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=300),
        train=TrainConfig(steps=3, global_batch=4, micro_batch=micro_batch, seq_len=16),
        data=DataConfig(source="synthetic"),
    )


def batch(seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    return Batch(torch.randint(0, 300, (4, 16), generator=g), torch.randint(0, 300, (4, 16), generator=g))


def run(cfg: Config, batches: list[Batch]) -> tuple[list[dict], torch.nn.Module]:
    model, plan, mesh = build_model(cfg)
    step, state = make_step(cfg, plan, mesh), init_state(model, cfg.optim)
    out = []
    for b in batches:
        state, metrics = step(state, b)
        out.append(metrics)
    assert state.step == len(batches)
    return out, model


def test_gradient_accumulation_changes_nothing():
    batches = [batch(0), batch(1)]
    whole, m1 = run(tiny(), batches)
    micro, m2 = run(tiny(micro_batch=1), batches)
    for a, b in zip(whole, micro):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_loss_is_the_mean_over_counted_tokens():
    b = batch(2)
    labels = b.labels.clone()
    labels[:, :5] = -100  # ignored positions count neither in the loss nor in the token count
    cfg = tiny()
    model, plan, mesh = build_model(cfg)
    with torch.no_grad():
        want = F.cross_entropy(model(b.inputs).flatten(0, 1), labels.flatten(), ignore_index=-100).item()
    _, metrics = make_step(cfg, plan, mesh)(init_state(model, cfg.optim), Batch(b.inputs, labels))
    assert metrics["loss"] == pytest.approx(want, rel=1e-6)
    assert math.isfinite(metrics["grad_norm"]) and metrics["lr"] == pytest.approx(cfg.optim.lr / 3)


HOST_READS = ("item", "tolist", "__float__", "__int__", "__bool__")


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_a_step_reads_the_host_once(monkeypatch, moe):
    """Every host read stalls a GPU between kernels: the step's own code reads the device once (the loss, the
    gradient norm and the router metrics together: the update's veto needs the first two), whatever the micro
    batches and clipping. MoE layers also read each micro batch's tokens per expert, which sizes the experts'
    matmuls: one read per layer and micro batch, nothing else."""
    reads: list[str] = []
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def read(self, *args, _original=original, _name=name):
            caller = sys._getframe(1).f_code.co_filename
            if f"{os.sep}shardlab{os.sep}" in caller and f"{os.sep}tests{os.sep}" not in caller:
                reads.append(f"{_name} in {caller}:{sys._getframe(1).f_lineno}")
            return _original(self, *args)

        monkeypatch.setattr(torch.Tensor, name, read)
    cfg = tiny(micro_batch=2)
    if moe:
        cfg = msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, moe=MoEConfig(n_experts=4)))
    model, plan, mesh = build_model(cfg)
    step, state = make_step(cfg, plan, mesh), init_state(model, cfg.optim)
    for seed in range(2):
        reads.clear()
        state, metrics = step(state, batch(seed))
        routing = [r for r in reads if r.startswith("tolist in") and os.path.join("llama", "moe.py:") in r]
        assert len(reads) - len(routing) == 1, reads
        assert len(routing) == (cfg.model.n_layers * 2 if moe else 0), reads
    assert math.isfinite(metrics["loss"]) and isinstance(metrics["grad_norm"], float)


def test_same_state_and_batch_give_the_same_result():
    first, _ = run(tiny(), [batch(3)])
    second, _ = run(tiny(), [batch(3)])
    assert first == second


def test_step_rejects_rows_that_do_not_split_into_micro_batches():
    cfg = msgspec.structs.replace(tiny(micro_batch=2))
    model, plan, mesh = build_model(cfg)
    step = make_step(cfg, plan, mesh)
    with pytest.raises(ValueError, match="3 rows per rank do not split into 2 micro batches"):
        step(init_state(model, cfg.optim), Batch(batch().inputs[:3], batch().labels[:3]))


@pytest.mark.slow
@pytest.mark.world  # a cold torch.compile (inductor on CPU): the full suite's tier
def test_compiled_blocks_train_like_eager():
    """plan.compile wraps each block in torch.compile (inductor on CPU: ~30 s to compile on 2 cores)."""
    batches = [batch(4), batch(5)]
    eager, _ = run(tiny(), batches)
    cfg = tiny()
    compiled, model = run(msgspec.structs.replace(cfg, plan=msgspec.structs.replace(cfg.plan, compile=True)), batches)
    assert all(is_compiled(block) for block in model.model.layers)
    for a, b in zip(eager, compiled):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


@pytest.mark.parametrize(
    ("mode", "want"),
    [
        ("none", [False, False, False]),
        ("full", [True, True, True]),
        ("selective", [True, False, True]),
        ("op", [True, True, True]),
    ],
)
def test_single_process_applies_activation_checkpointing(mode, want):
    """No mesh is needed for checkpointing: a one-process run gets it too (selective: every ac_every-th block)."""
    cfg = msgspec.structs.replace(tiny(), model=msgspec.structs.replace(tiny().model, n_layers=3))
    cfg = msgspec.structs.replace(cfg, plan=msgspec.structs.replace(cfg.plan, activation_checkpoint=mode))
    model, _, mesh = build_model(cfg)
    assert mesh is None
    assert [is_checkpointed(block) for block in model.model.layers] == want


@pytest.mark.parametrize("mode", ["stop", "skip"])
def test_a_nonfinite_step_stops_or_is_skipped_before_the_update(mode):
    """An inf in the weights makes step 2's loss non-finite: 'stop' names the step, 'skip' leaves weights and
    optimizer state as they were and counts it; either way no update of the broken step reaches the weights."""
    cfg = tiny()
    cfg = msgspec.structs.replace(cfg, train=msgspec.structs.replace(cfg.train, on_nonfinite=mode))
    model, plan, mesh = build_model(cfg)
    step, state = make_step(cfg, plan, mesh), init_state(model, cfg.optim)
    state, first = step(state, batch(0))
    assert first.get("skipped_steps", 0) == 0 and math.isfinite(first["loss"])
    weight = model.get_parameter("model.norm.weight")
    saved = weight.detach().clone()
    with torch.no_grad():
        weight[0] = math.inf
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    adam = [s["step"].item() for s in state.optim.state.values()]
    if mode == "stop":
        with pytest.raises(NonFiniteError, match=r"step 2: loss nan, gradient norm nan; stopped before the update"):
            step(state, batch(1))
    else:
        state, metrics = step(state, batch(1))
        assert metrics["skipped_steps"] == 1 and state.skipped == 1 and state.step == 2
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), before[n], rtol=0, atol=0, equal_nan=True)
    assert [s["step"].item() for s in state.optim.state.values()] == adam
    assert all(p.grad is None for p in model.parameters())
    if mode == "skip":  # the run goes on once the weights are finite again
        with torch.no_grad():
            weight.copy_(saved)
        state, third = step(state, batch(2))
        assert math.isfinite(third["loss"]) and third["skipped_steps"] == 1


def test_the_count_of_skipped_steps_is_checkpointed(tmp_path):
    from shardlab.data.loader import make_loader
    from shardlab.training.checkpoint import load, save

    cfg = tiny()
    model, _, _ = build_model(cfg)
    loader = make_loader(cfg.data, seq_len=16, global_batch=4, vocab_size=300, dp_rank=0, dp_size=1)
    state = msgspec.structs.replace(init_state(model, cfg.optim), step=3, skipped=2)
    path = save(state, loader, cfg, tmp_path).commit()
    restored = load(init_state(build_model(cfg)[0], cfg.optim), loader, path, cfg)
    assert (restored.step, restored.skipped) == (3, 2)


def test_optimizer_groups_follow_the_globs():
    """no_decay globs get weight decay 0, lr_scales scale the scheduled learning rate (first match wins); a factor
    of 0 freezes a parameter, and the others still train."""
    from shardlab.config import OptimConfig
    from shardlab.training.step import group_names

    optim = OptimConfig(no_decay=("**norm.weight",), lr_scales=(("model.embed_tokens.weight", 0.0), ("**", 0.5)))
    cfg = msgspec.structs.replace(tiny(), optim=optim)
    model, plan, mesh = build_model(cfg)
    state = init_state(model, optim)
    group_of = {id(p): g for g in state.optim.param_groups for p in g["params"]}
    names = dict(model.named_parameters())
    assert group_of[id(names["model.norm.weight"])]["weight_decay"] == 0.0
    assert group_of[id(names["model.layers.0.self_attn.q_proj.weight"])]["weight_decay"] == optim.weight_decay
    assert group_of[id(names["model.embed_tokens.weight"])]["lr_scale"] == 0.0
    before = {n: p.detach().clone() for n, p in names.items()}
    state, _ = make_step(cfg, plan, mesh)(state, batch(0))
    assert torch.equal(names["model.embed_tokens.weight"], before["model.embed_tokens.weight"])
    assert not torch.equal(names["lm_head.weight"], before["lm_head.weight"])
    lrs = {g["lr_scale"]: g["lr"] for g in state.optim.param_groups}
    assert lrs[0.5] == pytest.approx(0.5 * optim.lr / 3) and lrs[0.0] == 0.0
    shown = group_names(list(names), optim)
    assert shown["model.norm.weight"] == "wd 0 lr x0.5" and shown["lm_head.weight"] == "wd 0.1 lr x0.5"
    assert group_names(list(names), OptimConfig()) is None


def test_bad_optimizer_globs_are_one_line():
    from shardlab.config import OptimConfig

    with pytest.raises(ValueError, match=r"optim.no_decay: rule pattern 'a..b' is not a dotted name glob"):
        OptimConfig(no_decay=("a..b",))
    with pytest.raises(ValueError, match=r"optim.lr_scales: '\*\*' has factor -1.0; factors must be >= 0"):
        OptimConfig(lr_scales=(("**", -1.0),))


def test_cpu_offload_is_refused_in_one_line_where_the_run_is_on_the_cpu():
    """plan.cpu_offload keeps a GPU run's state on the host: on the CPU (train.device='auto' finding no GPU, or a
    device given) the run is refused before anything is built; on CUDA it passes the check."""
    from shardlab.config import PlanConfig
    from shardlab.training.loop import check_init

    cfg = msgspec.structs.replace(tiny(), plan=PlanConfig(cpu_offload=True))
    message = (
        r"^plan\.cpu_offload on the CPU: .*; set plan\.cpu_offload=False, or train on CUDA \(train\.device='cuda'\)$"
    )
    with pytest.raises(ValueError, match=message):
        build_model(cfg, device="cpu")
    check_init(cfg, torch.device("cuda", 0))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=message):
            check_init(cfg)  # train.device='auto' resolves to the CPU here


def test_batches_go_where_the_model_computes_not_where_offloaded_shards_live(monkeypatch):
    """model_device: a parameter's local device; but a shard on the host of a GPU mesh (FSDP's CPU offload) computes
    on the mesh's current device, where FSDP gathers it, so the batches go there."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    from shardlab.estimate._fake import fake_world
    from shardlab.training.step import model_device

    with fake_world(1):
        mesh = DeviceMesh("cpu", [0])
        model = torch.nn.Linear(4, 4, bias=False)
        model.weight = torch.nn.Parameter(DTensor.from_local(torch.zeros(4, 4), mesh, [Shard(0)], run_check=False))
        assert model_device(model) == torch.device("cpu")
        # as FSDP's CPU offload leaves a CUDA run's shards: on the host, their mesh a CUDA one
        monkeypatch.setattr(DeviceMesh, "device_type", property(lambda self: "cuda"))
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
        assert model_device(model) == torch.device("cuda", 3)
    assert model_device(torch.nn.Linear(2, 2)) == torch.device("cpu")
