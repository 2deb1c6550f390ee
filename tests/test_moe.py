"""The MoE block: routing against a per-token reference, capacity, scores and bias, the balancing
loss, the bias update, the plan and the step's metrics. Runs against one process are in tests/worlds/test_moe.py."""

from __future__ import annotations

import json
import math
from collections.abc import Callable

import msgspec
import pytest
import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from shardlab import Config, MeshSpec, ModelConfig, MoEConfig, TrainConfig, make_mesh
from shardlab.config import DataConfig, LogConfig, PlanConfig
from shardlab.estimate._fake import fake_world
from shardlab.models.llama.model import Llama, materialize
from shardlab.models.llama.moe import MoE, RouterStats, balanced_routing, router_stats
from shardlab.models.llama.rules import llama_rules
from shardlab.parallel.apply import apply
from shardlab.sharding.mesh import EXPERT_AXES
from shardlab.sharding.plan import Plan, make_plan
from shardlab.sharding.rules import Activation, Rule
from shardlab.training.loop import plan_model, train
from shardlab.training.routers import Routers, balance, update_bias

DIM = 32


def block(**moe) -> MoE:
    moe = dict(n_experts=4, top_k=2, expert_ffn_dim=24) | moe
    cfg = ModelConfig(dim=DIM, n_layers=1, n_heads=4, n_kv_heads=4, ffn_dim=48, vocab_size=64, moe=MoEConfig(**moe))
    with torch.device("meta"):
        model = Llama(cfg)
    return materialize(model, "cpu", seed=3).model.layers[0].mlp


def routed(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, RouterStats]:
    """moe(x) and the routing its forward recorded."""
    seen: list[RouterStats] = []
    with router_stats(lambda layer, stats: seen.append(stats)):
        y = moe(x)
    (stats,) = seen
    return y, stats


def reference(
    moe: MoE, x: torch.Tensor, drop: set[tuple[int, int]] = frozenset(), pick: Callable | None = None
) -> torch.Tensor:
    """Token by token: its top-k experts (or `pick(t)`'s) SwiGLU outputs weighted by the renormalised scores."""
    e = moe.experts
    out = torch.zeros_like(x)
    logits = x @ moe.router.weight.T
    scores = logits.softmax(-1) if moe.cfg.score == "softmax" else logits.sigmoid()
    for t in range(x.shape[0]):
        chosen = scores[t].topk(moe.cfg.top_k).indices if pick is None else torch.tensor(pick(t))
        weights = scores[t][chosen] / scores[t][chosen].sum()
        for w, i in zip(weights, chosen.tolist(), strict=True):
            if (t, i) not in drop:
                h = F.silu(x[t] @ e.gate_proj[i].T) * (x[t] @ e.up_proj[i].T)
                out[t] += w * (h @ e.down_proj[i].T)
    if moe.shared_expert is not None:
        out += moe.shared_expert(x)
    return out


@pytest.mark.parametrize("options", [dict(), dict(score="sigmoid"), dict(shared_expert=True)], ids=str)
def test_routing_matches_a_per_token_reference(options):
    moe = block(**options)
    x = torch.randn(2, 5, DIM)
    with torch.no_grad():
        y, stats = routed(moe, x)
        torch.testing.assert_close(y, reference(moe, x.reshape(10, DIM)).view(2, 5, DIM), rtol=1e-5, atol=1e-6)
    assert stats.dropped == 0 and stats.counts.sum().item() == 10 * 2


def test_capacity_drops_the_latest_tokens_and_counts_them():
    moe = block(capacity_factor=0.5)  # ceil(0.5 x 12 x 2 / 4) = 3 slots per expert
    x = torch.randn(12, DIM)
    with torch.no_grad():
        got, stats = routed(moe, x[None])
        got = got[0]
        chosen = (x @ moe.router.weight.T).softmax(-1).topk(2).indices
    seen: dict[int, int] = {}
    drop = set()
    for t in range(12):
        for i in chosen[t].tolist():
            seen[i] = seen.get(i, 0) + 1
            if seen[i] > 3:
                drop.add((t, i))
    with torch.no_grad():
        torch.testing.assert_close(got, reference(moe, x, drop), rtol=1e-5, atol=1e-6)
    assert stats.dropped == len(drop) > 0


@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_balanced_routing_sends_slot_s_to_expert_s_mod_e(capacity_factor):
    """The estimator's routing: token t's slots go to experts 2t, 2t + 1 (mod 4), so each gets 6 of 24 slots;
    a capacity of 3 keeps each expert's first 3 tokens."""
    moe = block(capacity_factor=capacity_factor)
    x = torch.randn(12, DIM)
    seen: dict[int, int] = {}
    drop = set()
    for t in range(12):
        for i in (2 * t % 4, (2 * t + 1) % 4):
            seen[i] = seen.get(i, 0) + 1
            if capacity_factor is not None and seen[i] > 3:
                drop.add((t, i))
    with torch.no_grad(), balanced_routing():
        got, stats = routed(moe, x[None])
        torch.testing.assert_close(got[0], reference(moe, x, drop, lambda t: [2 * t % 4, (2 * t + 1) % 4]))
    assert stats.counts.tolist() == [6, 6, 6, 6] and stats.dropped == len(drop)


def test_a_forward_keeps_nothing_on_the_layer():
    """Routing statistics go to whoever records them; a forward outside `router_stats` (evaluation) records none."""
    moe = block()
    before = dict(vars(moe))
    with torch.no_grad():
        moe(torch.randn(1, 4, DIM))
    assert vars(moe) == before


def test_the_experts_backward_moves_bytes_in_proportion_to_the_experts():
    """Each expert's gradient is written once: a backward that wrote a gradient the size of all experts for each
    expert (indexing the stacked weights) would move 16 times the bytes at 4 times the experts, not 4."""

    class Written(TorchDispatchMode):
        elements = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.elements += sum(t.numel() for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
            return out

    def backward_writes(n_experts: int) -> int:
        experts = block(n_experts=n_experts).experts
        y = experts(torch.randn(3 * n_experts, DIM), [3] * n_experts)
        with Written() as written:
            y.sum().backward()
        return written.elements

    assert backward_writes(8) <= 4.5 * backward_writes(2)


def test_bias_steers_the_choice_but_not_the_weights():
    moe = block(score="sigmoid", balance="bias")
    moe.expert_bias[:] = torch.tensor([100.0, 0.0, 0.0, 0.0])
    with torch.no_grad():
        _, stats = routed(moe, torch.randn(1, 8, DIM))
    assert stats.counts[0].item() == 8  # every token picks expert 0 as one of its two
    load = stats.counts.float()
    update_bias([moe], stats.counts[None])
    want = torch.tensor([100.0, 0.0, 0.0, 0.0]) + 1e-3 * torch.sign(load.mean() - load)  # busy down, idle up
    torch.testing.assert_close(moe.expert_bias, want)
    assert moe.expert_bias[0].item() < 100.0


def test_balancing_loss_is_one_for_uniform_scores():
    moe = block()
    with torch.no_grad():
        moe.router.weight.zero_()
    _, stats = routed(moe, torch.randn(1, 6, DIM))
    b = balance([stats], moe.cfg, None)
    assert b.aux_loss.item() == pytest.approx(1.0)
    assert sorted(b.counts[0].tolist()) == [0, 0, 6, 6]  # ties: two experts take every token


def test_parameter_counts_and_plan():
    moe = MoEConfig(n_experts=8, top_k=2, expert_ffn_dim=64, shared_expert=True)
    cfg = Config(model=ModelConfig(moe=moe))
    model, plan = plan_model(cfg.resolve(1))
    assert cfg.model.n_params == sum(p.numel() for p in model.parameters())
    per_layer_inactive = 6 * 3 * cfg.model.dim * 64
    assert cfg.model.n_params - cfg.model.n_active_params == cfg.model.n_layers * per_layer_inactive
    assert plan.param("model.layers.0.mlp.experts.down_proj").shape == (8, 256, 64)


@pytest.mark.parametrize(
    ("mesh", "moe", "message"),
    [
        (MeshSpec(), dict(n_experts=2, top_k=3), r"^model\.moe\.top_k=3 exceeds model\.moe\.n_experts=2"),
        (
            MeshSpec(dp_shard=1, tp=4),
            dict(expert_ffn_dim=6),
            r"^model\.moe\.expert_ffn_dim=6 is not divisible by mesh\.tp=4",
        ),
        (
            MeshSpec(dp_shard=4, ep=4),
            dict(n_experts=6),
            r"^mesh\.ep=4 needs model\.moe with n_experts divisible by it .*not 6",
        ),
        (MeshSpec(), dict(capacity_factor=0.0), r"^model\.moe\.capacity_factor=0\.0: must be > 0"),
    ],
)
def test_bad_moe_configs_are_one_line(mesh, moe, message):
    with pytest.raises(ValueError, match=message):
        Config(mesh=mesh, model=ModelConfig(moe=MoEConfig(**moe)))


def test_pipelined_moe_configs_are_checked():
    bias = MoEConfig(balance="bias")
    with pytest.raises(ValueError, match=r"^plan\.pp_balance='flops' with model\.moe: FLOPs are counted on the meta"):
        Config(mesh=MeshSpec(dp_shard=1, pp=2), model=ModelConfig(moe=bias), plan=PlanConfig(pp_balance="flops"))
    for how in ("bias", "aux_loss", "none"):  # every balance runs in pipelines
        Config(mesh=MeshSpec(dp_shard=1, pp=2), model=ModelConfig(moe=MoEConfig(balance=how)))


def test_routers_of_a_stage_without_moe_layers_report_zeros():
    """A pipeline stage holding no MoE layer still joins the metrics' reductions over stages, with zeros."""
    routers = Routers([], None, 2, n_experts=4, device=torch.device("cpu"))
    assert routers.loss() is None
    routers.update_bias()
    assert routers.metrics(routers.summary().tolist()) == {
        "moe_aux_loss": 0.0, "moe_dropped": 0.0, "moe_max_load": 0.0, "moe_tokens_per_expert": [0, 0, 0, 0]
    }  # fmt: skip


def test_bad_expert_parallel_layouts_are_one_line():
    with pytest.raises(ValueError, match=r"^mesh\.ep=2 needs model\.moe with .*not 0; set model\.moe"):
        Config(mesh=MeshSpec(dp_shard=2, ep=2))
    with pytest.raises(ValueError, match=r"^mesh\.ep=4 does not divide dp_shard x cp = 2"):
        MeshSpec(dp_shard=2, cp=1, ep=4)
    with pytest.raises(ValueError, match=r"^mesh\.ep=3 does not divide dp_shard x cp = 4"):
        MeshSpec(ep=3).resolve(4)
    cfg = Config(mesh=MeshSpec(dp_shard=4, ep=2), model=ModelConfig(n_layers=2, moe=MoEConfig(n_experts=4)))
    model, _ = plan_model(cfg.resolve(4))
    rules = llama_rules(cfg.model)
    no_ep = msgspec.structs.replace(rules, logical=tuple((n, None if n == "experts" else a) for n, a in rules.logical))
    with pytest.raises(ValueError, match=r"^mesh\.ep=2 but no rule shards a parameter over ep"):
        make_plan(model, cfg.mesh.resolve(4), no_ep)
    router_on_ep = msgspec.structs.replace(
        rules, params=(Rule(pattern="**.router.weight", spec=("ep",)), *rules.params)
    )
    with pytest.raises(
        ValueError, match=r"^model\.layers\.0\.mlp\.router: holds ep-sharded weights but has no `dispatch`"
    ):
        make_plan(model, cfg.mesh.resolve(4), router_on_ep)


def test_expert_weights_are_planned_on_the_expert_mesh():
    """ep 2 of FSDP 4: each rank holds 2 of 4 experts, FSDP halves them again over dp_shard_mod_ep (the minor
    part of dim 0, as FSDP chunks the ep shard); the router stays on the main mesh, replicated over ep."""
    cfg = Config(mesh=MeshSpec(dp_shard=4, ep=2), model=ModelConfig(n_layers=2, moe=MoEConfig(n_experts=4)))
    _, plan = plan_model(cfg.resolve(4))
    gate = plan.param("model.layers.1.mlp.experts.gate_proj")
    assert gate.expert and gate.spec == (("ep", "dp_shard_mod_ep"), "tp", None)  # tp is 1 here
    assert dict(zip(EXPERT_AXES, gate.placements)) == {
        "pp": "R", "dp_replicate": "R", "dp_shard_mod_ep": "_S(0, 2)", "ep": "S(0)", "tp": "R"
    }  # fmt: skip
    assert gate.local_shape == (1, 256, 256) and gate.fsdp_unit == "model.layers.1.mlp.experts"
    router = plan.param("model.layers.1.mlp.router.weight")
    assert not router.expert and router.spec == ("dp_shard", None)
    assert plan.experts.modules == ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts")
    assert plan.experts.fsdp_axes == ("dp_shard_mod_ep",) and plan.experts.gradient_divide_factor == 4
    assert "Expert parallel over ep=2" in plan.table() and "ep:S(0)" in plan.table()
    assert Plan.from_json(plan.to_json()) == plan
    hsdp = Config(mesh=MeshSpec(dp_replicate=2, dp_shard=2, ep=2), model=cfg.model)
    _, plan = plan_model(hsdp.resolve(4))
    assert plan.experts.fsdp_axes == ("dp_replicate", "dp_shard_mod_ep")
    assert plan.param("model.layers.0.mlp.experts.up_proj").local_shape == (2, 256, 256)  # dp_shard_mod_ep is 1


def test_tensor_parallel_experts_are_planned_for_local_compute():
    """ep 2 x tp 2: expert weights split over ep (experts) and tp (hidden dim), no ParallelStyle of their own; the
    MoE layer gets and returns whole local tensors (sequence parallel's residual is gathered around it)."""
    model = ModelConfig(n_layers=2, moe=MoEConfig(n_experts=4, shared_expert=True))
    cfg = Config(mesh=MeshSpec(dp_shard=2, tp=2, ep=2), model=model)
    _, plan = plan_model(cfg.resolve(4))
    up, down = (plan.param(f"model.layers.0.mlp.experts.{w}") for w in ("up_proj", "down_proj"))
    assert up.spec == ("ep", "tp", None) and down.spec == ("ep", None, "tp")
    assert dict(zip(EXPERT_AXES, down.placements)) == {
        "pp": "R", "dp_replicate": "R", "dp_shard_mod_ep": "R", "ep": "S(0)", "tp": "S(2)"
    }  # fmt: skip
    assert plan.experts.tensor_parallel and plan.experts.ep == 2
    assert not any(m.fqn.endswith(".experts") for m in plan.modules)
    moe = plan.module("model.layers.0.mlp")
    assert moe.style == "prepare_input_output" and moe.inputs[0][1] == "tp" and moe.desired_output[1] == "tp"
    assert plan.module("model.layers.0.mlp.shared_expert.down_proj").style == "rowwise"
    _, tp_only = plan_model(msgspec.structs.replace(cfg, mesh=MeshSpec(dp_shard=2, tp=2)).resolve(4))
    assert not tp_only.param("model.layers.0.mlp.experts.up_proj").expert
    assert tp_only.experts.ep == 1 and tp_only.experts.fsdp_axes == ()  # FSDP shards them with their block


def _experts_with(spec_of: dict[str, tuple], mesh: MeshSpec):
    """make_plan of a 2-layer MoE with the experts' rules replaced by `spec_of` (weight name -> spec)."""
    cfg = Config(mesh=mesh, model=ModelConfig(n_layers=2, moe=MoEConfig(n_experts=4, expert_ffn_dim=64)))
    model, _ = plan_model(cfg.resolve(4))
    rules = llama_rules(cfg.model)
    first = tuple(Rule(pattern=f"**.experts.{n}", spec=spec) for n, spec in spec_of.items())
    return make_plan(model, cfg.mesh.resolve(4), msgspec.structs.replace(rules, params=(*first, *rules.params)))


@pytest.mark.parametrize(
    "spec_of",
    [
        {"gate_proj": (None, "ep", None), "up_proj": (None, "ep", None), "down_proj": (None, None, "ep")},
        {"gate_proj": (("ep", "tp"), None, None), "up_proj": ("ep", "tp"), "down_proj": ("ep", None, "tp")},
        {"gate_proj": ("ep", None, "tp"), "up_proj": ("ep", "tp"), "down_proj": ("ep", None, "tp")},
    ],
    ids=["ep_on_hidden_dim", "ep_and_tp_on_experts", "tp_on_embed_dim"],
)
def test_expert_layouts_dispatch_cannot_run_are_refused(spec_of):
    """The dispatch runs rank r's experts r L .. (r + 1) L - 1 and sums tp's partial hidden units: any other split
    would compute silently wrong results or fail inside torch."""
    with pytest.raises(
        ValueError,
        match=r"^model\.layers\.0\.mlp\.experts\.gate_proj: .* over ep alone and only its hidden dim \(1\) over tp",
    ):
        _experts_with(spec_of, MeshSpec(dp_shard=2, tp=2, ep=2))


def test_tp_inside_experts_without_ep_is_described_as_such():
    plan = _experts_with({}, MeshSpec(dp_shard=2, tp=2))
    assert plan.experts.ep == 1 and plan.experts.gradient_divide_factor is None
    assert "Tensor parallel inside experts over tp=2" in plan.table() and "all-to-all" not in plan.table()
    with pytest.raises(
        ValueError, match=r"^model\.layers\.0\.mlp\.experts\.down_proj: some expert weights are sharded over tp"
    ):
        _experts_with({"down_proj": ("ep", None, None)}, MeshSpec(dp_shard=2, tp=2))


def test_desired_output_needs_declared_layouts():
    cfg = Config(mesh=MeshSpec(dp_shard=2, tp=2), model=ModelConfig(n_layers=2, moe=MoEConfig(n_experts=4)))
    model, _ = plan_model(cfg.resolve(4))
    rules = llama_rules(cfg.model)
    bad = Activation(
        pattern="model.layers.*.mlp",
        inputs=(("batch", "residual_seq", "embed"),),
        desired_output=("batch", "residual_seq", "embed"),
    )
    acts = tuple(a for a in rules.activations if a.pattern != "model.layers.*.mlp") + (bad,)
    with pytest.raises(ValueError, match=r"^rules\.activations: model\.layers\.0\.mlp declares desired_output"):
        make_plan(model, cfg.mesh.resolve(4), msgspec.structs.replace(rules, activations=acts))


def test_a_step_reports_the_routers(tmp_path):
    model = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=512,
                        moe=MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=32, capacity_factor=1.0))  # fmt: skip
    cfg = Config(
        model=model, train=TrainConfig(steps=3, global_batch=4, seq_len=32, run_dir=str(tmp_path / "{name}")),
        log=LogConfig(wandb="disabled", progress=False), data=DataConfig(source="stdlib"),
    )  # fmt: skip
    history = train(cfg)
    assert all(math.isfinite(m["moe_aux_loss"]) and m["moe_max_load"] >= 1 for m in history)
    assert sum(history[0]["moe_tokens_per_expert"]) == 2 * 4 * 32 * 2  # layers x tokens x top_k
    line = json.loads((tmp_path / cfg.name / "metrics.jsonl").read_text().splitlines()[-1])
    assert len(line["moe_tokens_per_expert"]) == 4
    assert msgspec.json.decode((tmp_path / cfg.name / "config.json").read_bytes(), type=Config) == cfg.resolve(1)


def test_a_single_expert_per_token_still_trains_the_router():
    """top_k=1 weights the expert by its raw score: renormalising would make it 1 and cut the router's gradient."""
    moe = block(top_k=1, balance="none")
    moe(torch.randn(1, 6, DIM)).sum().backward()
    assert moe.router.weight.grad.abs().max().item() > 1e-4


def test_fsdp_splits_dim_1_of_experts_fewer_than_its_shards():
    """2 experts, ep 2: each ep rank's one expert over dp_shard_mod_ep = 2 would leave a shard of padding, so
    FSDP splits dim 1 (strided under TP's split of the same dim). The plan says what torch builds (8 fake ranks)."""
    moe = MoEConfig(n_experts=2, top_k=1, expert_ffn_dim=64)
    cfg = Config(
        mesh=MeshSpec(dp_shard=4, tp=2, ep=2), model=ModelConfig(dim=64, n_layers=1, vocab_size=512, moe=moe)
    ).resolve(8)
    model, plan = plan_model(cfg)
    gate = plan.param("model.layers.0.mlp.experts.gate_proj")
    assert (gate.spec, gate.fsdp_dim, gate.local_shape) == (("ep", ("tp", "dp_shard_mod_ep"), None), 1, (1, 16, 64))
    with fake_world(8, 0):
        apply(model, plan, make_mesh(cfg.mesh, "cpu"))
    for fqn, param in model.named_parameters():
        if ".experts." in fqn:
            want = plan.param(fqn)
            assert tuple(str(p) for p in param.placements) == want.placements[2:], fqn  # over dsme, ep, tp
            assert tuple(param.to_local().shape) == want.local_shape, fqn
