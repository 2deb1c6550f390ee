"""The probe in one process (fake world, fake tensors): exact FLOPs, linear extrapolation over blocks, and an
estimate and roofline that hang together. Real ranks check it in tests/worlds/test_probe.py."""

import contextlib
import functools
import math
import os
import time

import msgspec
import pytest
import torch

from shardlab import Config, MeshSpec, ModelConfig, MoEConfig, PlanConfig, TrainConfig, make_mesh
from shardlab.estimate import estimate
from shardlab.estimate._fake import fake_world
from shardlab.estimate.devices import device
from shardlab.estimate.estimate_table import estimate_table
from shardlab.estimate.probe import Probe, _probe_layers, probe
from shardlab.estimate.roofline import axis_bandwidth
from shardlab.models.llama.provider import LlamaProvider
from shardlab.training.loop import plan_model

MOE = MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=64)


def cfg(mesh=MeshSpec(dp_shard=1), n_layers=5, moe=None, **plan) -> Config:
    model = ModelConfig(dim=128, n_layers=n_layers, n_heads=4, n_kv_heads=4, ffn_dim=256, vocab_size=512, moe=moe)
    return Config(mesh=mesh, model=model, plan=PlanConfig(**plan), train=TrainConfig(global_batch=4, seq_len=64))


@functools.cache
def probed(c: Config) -> Probe:
    """`probe(c)`, once per config for the tests of this file (several probe the one-process default)."""
    return probe(c)


@pytest.mark.parametrize("moe", [None, MOE], ids=["dense", "moe"])
def test_flops_are_six_n_t_plus_causal_attention_exactly(moe):
    """With MoE, N counts the router and top_k experts: the probe routes every token to k experts (balanced)."""
    c = cfg(moe=moe).resolve(1)
    m = c.model
    n_matmul = m.n_active_params - m.vocab_size * m.dim - (2 * m.n_layers + 1) * m.dim  # no lookup, no norms
    tokens = 4 * 64
    # attention per token and layer: forward 4 s d, backward 10 s d (flash recomputes the scores), causal: half
    want = 6 * n_matmul * tokens + 7 * m.n_layers * 64 * m.dim * tokens
    assert probed(c).flops == want


def test_tensor_parallel_halves_each_ranks_flops():
    one = probed(cfg().resolve(1)).flops
    assert probe(cfg(MeshSpec(dp_shard=1, tp=2)).resolve(2)).flops * 2 == one


@pytest.mark.parametrize(
    "mesh,plan",
    [
        (MeshSpec(dp_shard=2, tp=2), dict(sequence_parallel=True, loss_parallel=True)),
        (MeshSpec(dp_shard=4), dict(activation_checkpoint="selective", param_dtype="bfloat16")),
        (MeshSpec(dp_shard=2, tp=2, ep=2), dict(moe=MOE, sequence_parallel=True, loss_parallel=True)),
    ],
    ids=["fsdp_tp_sp", "fsdp_selective_bf16", "moe_ep2_tp2"],
)
def test_two_probes_extrapolate_to_the_whole_model_exactly(mesh, plan):
    """Probing 2k and 3k blocks gives what probing all 7 (or 8) blocks gives."""
    n = 8 if plan.get("activation_checkpoint") == "selective" else 7
    c = cfg(mesh, n_layers=n, **plan).resolve(4)
    p = probe(c)
    with fake_world(4):
        direct = _probe_layers(c, None, LlamaProvider(c.model), make_mesh(c.mesh, "cpu"), n, False)
    assert (p.flops, p.activation_bytes) == (direct.flops, direct.activation_bytes)
    assert {(x.axis, x.kind, x.phase, x.group_size): (x.count, x.bytes) for x in p.collectives} == {
        k[:4]: (v, direct.collective_bytes[k]) for k, v in direct.collectives.items()
    }


def test_checkpointing_trades_activations_for_recompute():
    none, full = (probed(cfg(activation_checkpoint=ac).resolve(1)) for ac in ("none", "full"))
    assert full.activation_bytes < none.activation_bytes / 2
    assert none.flops < full.flops < 1.5 * none.flops


@pytest.mark.parametrize("ac", ["full", "selective", "op"])
def test_the_recomputation_is_what_checkpointing_adds_to_the_compute(ac):
    """Under FSDP and TP with SP (DTensor's and autograd Functions' ops inside the recomputation too), two micro
    batches: the recomputation's seconds are exactly the compute checkpointing adds to the layout without."""
    c = cfg(MeshSpec(dp_shard=2, tp=2), sequence_parallel=True, activation_checkpoint=ac)
    c = msgspec.structs.replace(c, train=msgspec.structs.replace(c.train, micro_batch=1))
    times = {}
    for mode in ("none", ac):
        run = msgspec.structs.replace(c, plan=msgspec.structs.replace(c.plan, activation_checkpoint=mode)).resolve(4)
        times[mode] = estimate(run, plan_model(run)[1], dev=device("h100"), compare_checkpointing=False).time
    assert times["none"].recompute_s == 0 and times[ac].recompute_s > 0
    assert times[ac].compute_s - times["none"].compute_s == pytest.approx(times[ac].recompute_s, rel=1e-9)


def test_estimate_sums_up():
    c = cfg(MeshSpec(dp_shard=2, tp=2), sequence_parallel=True, loss_parallel=True).resolve(4)
    _, plan = plan_model(c)
    e = estimate(c, plan, dev=device("h100"))
    m, first = e.memory, e.first_grads
    assert e.peak == m.params + m.optim + e.fsdp_buffers + max(e.activations + first, m.grads + e.block_activations)
    assert e.other_checkpointing == "full" and e.activations_other < e.activations
    assert {x.axis for x in e.collectives} == {"dp_shard", "tp"}
    t = e.time
    assert t.step_s == pytest.approx(max(t.compute_s, t.fsdp_comm_s) + t.tp_comm_s + t.optimizer_s)
    assert t.tokens_per_s_per_device == pytest.approx(4 * 64 / 4 / t.step_s)


@pytest.mark.parametrize("replicas", [1, 2])
def test_fsdp_over_cp_alone_gathers_as_fsdp_beside_cps_own_collectives(replicas):
    """With dp_shard 1, FSDP shards over cp's ranks (the dp_shard x cp view is cp's group): its gathers and
    reductions are FSDP's, overlapped with compute, and CP's K and V gathers are cp's, as with dp_shard 2."""
    seen = {}
    for shard, cp in ((1, 4), (2, 2)):
        c = cfg(MeshSpec(dp_replicate=replicas, dp_shard=shard, cp=cp), n_layers=2).resolve(4 * replicas)
        e = estimate(c, plan_model(c)[1], dev=device("h100"))
        seen[shard] = {(x.axis, x.kind, x.phase, x.count) for x in e.collectives if x.axis != "dp_replicate"}
        cp_own = [x for x in e.collectives if x.axis == "cp"]
        assert {x.kind for x in cp_own} == {"all_gather", "reduce_scatter"} and e.time.fsdp_comm_s > 0
        assert e.time.tp_comm_s < e.time.fsdp_comm_s, (shard, cp)  # CP's K and V, exposed: not FSDP's weights
    assert seen[1] == seen[2]


def test_groups_within_a_node_use_nvlink():
    mesh = MeshSpec(dp_shard=64, tp=8).resolve(512)
    h100 = device("h100")
    assert axis_bandwidth(mesh, "tp", h100) == 450e9
    assert axis_bandwidth(mesh, "dp_shard", h100) == 50e9
    small = msgspec.structs.replace(mesh, dp_shard=2, tp=4)
    assert axis_bandwidth(small, "dp_shard", h100) == 450e9
    experts = MeshSpec(dp_shard=64, tp=2, ep=4).resolve(128)  # ep: the fast part of dp_shard, 2 ranks apart
    assert axis_bandwidth(experts, "ep", h100) == 450e9
    assert axis_bandwidth(experts, "dp_shard_mod_ep", h100) == 50e9


def test_moe_estimate_prices_the_all_to_all_and_the_expert_shards():
    c = cfg(MeshSpec(dp_shard=4, ep=2), moe=MOE).resolve(4)
    _, plan = plan_model(c)
    e = estimate(c, plan, dev=device("h100"))
    by_axis = {(x.axis, x.kind, x.phase): x for x in e.collectives}
    tokens = 4 // 4 * 64  # this rank's micro batch
    slot_bytes = tokens * MOE.top_k * c.model.dim * 4
    counts_bytes = MOE.n_experts * 8  # the counts go first, int64
    per_layer = 2 * slot_bytes  # to the experts and back
    assert by_axis["ep", "all_to_all", "forward"].bytes == c.model.n_layers * (per_layer + counts_bytes)
    assert by_axis["ep", "all_to_all", "backward"].bytes == c.model.n_layers * per_layer
    experts = 3 * MOE.n_experts * MOE.expert_ffn_dim * c.model.dim * 4 // 2  # what FSDP gathers: the ep rank's
    assert by_axis["dp_shard_mod_ep", "all_gather", "forward"].bytes == c.model.n_layers * experts


def test_pipelines_balanced_by_flops_are_estimated():
    """The probe plans the model as configured, so it needs the FLOPs too (a small model is probed whole)."""
    c = cfg(MeshSpec(pp=2, dp_shard=1), n_layers=4, pp_balance="flops").resolve(2)
    _, plan = plan_model(c)
    e = estimate(c, plan)
    assert e.micro_batches == plan.pipeline.microbatches == 2
    assert {x.axis for x in e.collectives} == {"pp"}


def test_a_forward_that_runs_without_gradients_peaks_beside_the_first_ones_alone():
    """The step sets gradients to None after each update: one micro batch without checkpointing or a pipeline
    peaks at the backward's start (every activation, the gradients of what lies outside the blocks) or its end
    (every gradient, one block's activations), not with all of both. A second micro batch runs its forward beside
    the first one's gradients, a checkpointed block rebuilds more than it kept, and a pipeline runs forwards while
    other micro batches' gradients are held: there every gradient is beside every activation."""
    fsdp_tp = MeshSpec(dp_shard=2, tp=2)

    def estimated(mesh: MeshSpec = fsdp_tp, micro_batch: int | None = None, **plan) -> tuple:
        c = cfg(mesh, n_layers=2, **plan)
        c = msgspec.structs.replace(c, train=msgspec.structs.replace(c.train, micro_batch=micro_batch)).resolve(4)
        planned = plan_model(c)[1]
        return c, planned, estimate(c, planned, dev=device("h100"), compare_checkpointing=False)

    c, plan, e = estimated()
    outside = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    assert e.first_grads == sum(p.bytes_per_rank for p in plan.params if p.fqn in outside) > 0
    assert 0 < e.block_activations < e.activations
    m = e.memory
    assert m.total + e.fsdp_buffers < e.peak < m.total + e.activations + e.fsdp_buffers
    assert e.peak == m.params + m.optim + e.fsdp_buffers + max(
        e.activations + e.first_grads, m.grads + e.block_activations
    )
    others = [dict(activation_checkpoint="full"), dict(micro_batch=1), dict(mesh=MeshSpec(pp=2, dp_shard=2))]
    for other in others:
        c, _, e = estimated(**other)
        assert e.first_grads is None and e.peak == e.memory.total + e.activations + e.fsdp_buffers, other
        assert c.micro_batches == (1 if "activation_checkpoint" in other else 2)


def test_without_resharding_every_fsdp_unit_stays_gathered():
    """ZeRO-2 keeps each unit's unsharded parameters from its forward to its backward: all of them at once."""
    from shardlab.estimate import fsdp_buffer_bytes

    plans = [plan_model(cfg(MeshSpec(dp_shard=4), reshard_after_forward=r).resolve(4))[1] for r in (True, False)]
    units = {}
    for p in plans[0].params:
        units[p.fsdp_unit] = units.get(p.fsdp_unit, 0) + p.local_shape[0] * 4 * math.prod(p.local_shape[1:]) * 4
    largest = sorted(units.values(), reverse=True)
    assert fsdp_buffer_bytes(plans[0]) == sum(largest[:2]) + largest[0]
    assert fsdp_buffer_bytes(plans[1]) == sum(largest) + largest[0]


@pytest.mark.parametrize("last_kept", [True, False])
def test_the_output_layer_stays_gathered_for_its_backward(last_kept):
    """The last FSDP unit (final norm and output layer) ends the forward, and its backward follows at once: kept
    gathered in between, the backward gathers every unit but that one again."""
    from shardlab.models.llama.rules import llama_rules

    c = cfg(MeshSpec(dp_shard=2), n_layers=2).resolve(2)
    rules = msgspec.structs.replace(llama_rules(c.model, c.plan), fsdp_last_kept=last_kept)
    _, plan = plan_model(c)
    assert plan.fsdp.last_kept and plan.fsdp.units[-1] == ("model.norm", "lm_head")
    gathers = {x.phase: x for x in probe(c, rules).collectives if x.kind == "all_gather" and x.axis == "dp_shard"}
    head = (c.model.dim + c.model.vocab_size * c.model.dim) * 4
    assert gathers["forward"].count == len(plan.fsdp.units)
    assert gathers["backward"].count == len(plan.fsdp.units) - last_kept
    assert gathers["forward"].bytes - gathers["backward"].bytes == (head if last_kept else 0)


def test_waiting_for_a_collective_moves_no_bytes():
    """A functional collective's wait returns its result: the probe counts it as an op (it is dispatched), not as
    traffic, where it used to count the gathered tensor read and written once more."""
    import torch
    import torch.distributed as dist
    from torch.distributed._functional_collectives import all_gather_single

    from shardlab.estimate._fake import fake_tensors
    from shardlab.estimate.recorder import Recorder

    with fake_world(2), fake_tensors():
        shard, recorder = torch.zeros(1024), Recorder({})
        with recorder:
            gathered = all_gather_single(shard, 0, dist.group.WORLD) + 1  # the add waits
    assert gathered.shape == (2048,)
    assert sum(recorder.collectives.values()) == 1
    assert dict(recorder.ops) == {(0, 0, "memory"): 1, (0, 2 * 2048 * 4, "memory"): 1}  # the wait, the add


@pytest.mark.parametrize("reuse_logits", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_losss_middle_chunks_run_once_and_are_counted_as_every_chunk(reuse_logits, dtype, monkeypatch):
    """Under `chunks_counted_by` (the probe's, on fake tensors) the chunked loss runs its first, one middle and its
    last chunk, and the recorder counts every op of every chunk: the same ops, FLOPs and sequence as all of them run
    (6 chunks of 7 rows, the last of 5, forward and backward), in a tenth of the dispatches at a 128k vocabulary."""
    from shardlab.estimate._fake import fake_tensors
    from shardlab.estimate.recorder import Recorder
    from shardlab.training import loss as loss_module
    from shardlab.training.loss import chunks_counted_by, summed_loss

    monkeypatch.setattr(loss_module, "CHUNK_ELEMENTS", 7 * 50)
    counted = []
    for repeats in (False, True):
        with fake_tensors():
            hidden, weight = torch.zeros(2, 20, 16, dtype=dtype), torch.zeros(16, 50, dtype=dtype, requires_grad=True)
            labels = torch.zeros(2, 20, dtype=torch.long)
            recorder = Recorder({})
            with recorder, chunks_counted_by(recorder) if repeats else contextlib.nullcontext():
                summed_loss(hidden @ weight, labels, reuse_logits=reuse_logits).backward()
        counted.append((dict(recorder.ops), recorder.flops, recorder.sequence))
    assert counted[0] == counted[1] and sum(n for (_, moved, _), n in counted[0][0].items() if moved) > 6 * 10


def test_calls_run_side_by_side_in_forked_children_as_they_would_in_order():
    """A probe's model sizes run in forked children (`run_forked`): the results come back in order, more calls than
    cores too, and an error in a child is raised here with its type and message. Calls that run calls side by side
    themselves share the cores: one call per core, each runs its own in its process."""
    from shardlab.estimate._forked import cores, run_forked

    assert run_forked([lambda i=i: [i] * i for i in range(4)]) == [[], [1], [2, 2], [3, 3, 3]]
    assert run_forked([lambda i=i: i for i in range(2 * cores() + 1)]) == list(range(2 * cores() + 1))
    inner = lambda: run_forked([os.getpid, os.getpid])  # noqa: E731
    assert [len(set(pids)) for pids in run_forked([inner] * cores())] == [1] * cores()
    with pytest.raises(ZeroDivisionError, match="division by zero"):
        run_forked([lambda: 1, lambda: 1 / 0])
    if cores() > 1:  # a child that dies without answering (in order, os._exit would end the test process)
        with pytest.raises(RuntimeError, match="died before it answered"):
            run_forked([lambda: 1, lambda: os._exit(3)])
    c = cfg(MeshSpec(dp_shard=2)).resolve(2)
    assert probe(c) == probe(c)  # one size in this process, the other in a child, twice


def test_a_forked_child_finalizes_nothing_it_inherits(monkeypatch, tmp_path):
    """This process's uncollected garbage is not collected in a forked child: a finalizer of a library whose threads
    did not follow the fork crashed children there (a probe after trainings in the same process died of SIGSEGV in
    a garbage collection). Here a cycle with a finalizer, left for the collector, is finalized once, here."""
    import gc

    from shardlab.estimate import _forked

    monkeypatch.setattr(_forked, "cores", lambda: 2)  # one call here, one in a child
    finalized = tmp_path / "finalized"

    class Cycle:
        def __del__(self) -> None:
            with open(finalized, "a") as f:
                f.write(f"{os.getpid()}\n")

    gc.disable()  # no collection before the fork
    try:
        cycle = Cycle()
        cycle.me = cycle
        del cycle
        _forked.run_forked([lambda: 0, gc.collect])  # the child collects all it can
    finally:
        gc.enable()
    assert not finalized.exists()
    gc.collect()
    assert finalized.read_text() == f"{os.getpid()}\n"


def test_the_estimate_reshards_as_the_plan_chose():
    """Unset, reshard_after_forward is the plan's choice (on over two shards): the estimate prices that choice."""
    base = cfg(MeshSpec(dp_shard=2), n_layers=2)
    estimates = {}
    for r in (None, True, False):
        c = msgspec.structs.replace(base, plan=msgspec.structs.replace(base.plan, reshard_after_forward=r)).resolve(2)
        e = estimate(c, plan_model(c)[1])
        estimates[r] = sum(x.bytes for x in e.collectives if x.kind == "all_gather")
    assert estimates[None] == estimates[True] > estimates[False]


def _counting_forks(monkeypatch) -> list[int]:
    """os.fork, counted: the list grows by one per fork."""
    forks, fork = [], os.fork
    monkeypatch.setattr(os, "fork", lambda: forks.append(1) or fork())
    return forks


_AFTER_DEEP_BACKWARD = """
import os, pickle, sys, torch
from shardlab.estimate import _autograd_fork
from shardlab.estimate._forked import _answer, _fork
from shardlab.estimate.probe import measure

class Deep(torch.autograd.Function):  # a backward that runs one of its own, `depth` deep
    @staticmethod
    def forward(ctx, depth):
        ctx.depth = int(depth.item())
        return depth * 1

    @staticmethod
    def backward(ctx, grad):
        if ctx.depth > 0:
            with torch.enable_grad():
                Deep.apply(torch.tensor(ctx.depth - 1.0, requires_grad=True)).backward()
        return grad

Deep.apply(torch.tensor(100.0, requires_grad=True)).backward()
refusal = _answer(*_fork(_autograd_fork.backward_here))
told_before = _autograd_fork.fork_breaks_autograd()
forks, fork = [], os.fork
os.fork = lambda: forks.append(1) or fork()
runs = measure(pickle.load(open(sys.argv[1], "rb"))).runs
told_after = _autograd_fork.fork_breaks_autograd()
pickle.dump((refusal[0], str(refusal[1]), told_before, len(forks), runs, told_after), open(sys.argv[1], "wb"))
"""


def test_where_autograd_refuses_forked_children_the_probe_runs_here_with_the_same_results(monkeypatch, tmp_path):
    """The condition itself, on CPU: past 60 levels of reentrant backward torch's engine starts a pool thread (no
    name tells it), and from then on a forked child refuses any backward, as after CUDA autograd. The child that
    refuses answers with the engine's error (not a call's reading of it), its share runs here, and the process
    forks no more: the probe's runs are the forked ones. In a fresh process: the condition lasts as long as it."""
    import pickle
    import subprocess
    import sys

    from shardlab.estimate._forked import cores
    from shardlab.estimate.probe import measure

    c = cfg(MeshSpec(dp_shard=2)).resolve(2)
    forks = _counting_forks(monkeypatch)
    side_by_side = measure(c).runs
    assert len(forks) == (cores() > 1)
    path = tmp_path / "io.pickle"
    path.write_bytes(pickle.dumps(c))
    subprocess.run([sys.executable, "-c", _AFTER_DEEP_BACKWARD, str(path)], check=True, timeout=600)
    answered, refusal, told_before, forked, runs, told_after = pickle.loads(path.read_bytes())
    assert not answered and "Autograd-and-Fork" in refusal  # the condition is torch's own
    if not torch.cuda.is_available():  # else the engine started its (named) device threads too
        assert not told_before and forked == (cores() > 1)  # one child tried, refused, its share run here
    assert runs == side_by_side and told_after


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="threads listed through /proc (Linux)")
def test_after_cuda_autograd_the_probe_runs_here_without_forking_with_the_same_results(monkeypatch):
    """CUDA autograd simulated on CPU: a thread named as torch's engine names its device threads ("pt_autograd_0"),
    or CUDA initialised, and the probe's sizes run in order here, no fork tried, with the results they have forked
    (tests/test_gpu.py's estimate after GPU training is the real case)."""
    import ctypes
    import threading

    from shardlab.estimate import _autograd_fork
    from shardlab.estimate._forked import cores
    from shardlab.estimate.probe import measure

    c = cfg(MeshSpec(dp_shard=2)).resolve(2)
    forks = _counting_forks(monkeypatch)
    side_by_side = measure(c).runs
    assert len(forks) == (cores() > 1)
    named, stop = threading.Event(), threading.Event()

    def device_thread():
        ctypes.CDLL(None).prctl(15, b"pt_autograd_0", 0, 0, 0)  # PR_SET_NAME: this thread's name in /proc
        named.set()
        stop.wait()

    thread = threading.Thread(target=device_thread, daemon=True)
    thread.start()
    try:
        assert named.wait(10) and _autograd_fork.fork_breaks_autograd()
        forks.clear()
        assert measure(c).runs == side_by_side and not forks
    finally:
        stop.set()
        thread.join()
    deadline = time.monotonic() + 10
    while _autograd_fork.fork_breaks_autograd() and time.monotonic() < deadline:
        time.sleep(0.01)  # a joined thread's name leaves /proc a moment after join() returns (the OS thread exits)
    assert not _autograd_fork.fork_breaks_autograd()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert _autograd_fork.fork_breaks_autograd()


def test_cpu_offload_counts_parameters_gradients_and_optimizer_state_on_the_host():
    """plan.cpu_offload: the same bytes of parameters, gradients and AdamW state, held by the host, not the device
    (what a search fits into a device's memory leaves them out)."""
    from shardlab.estimate import estimate_memory

    c = cfg(MeshSpec(dp_shard=2)).resolve(2)
    on_device = estimate_memory(plan_model(c)[1])
    offloaded = estimate_memory(plan_model(msgspec.structs.replace(c, plan=PlanConfig(cpu_offload=True)))[1])
    state = on_device.params + on_device.grads + on_device.optim
    assert (on_device.total, on_device.host) == (state, 0) and state > 0
    assert (offloaded.params, offloaded.grads, offloaded.optim) == (on_device.params, on_device.grads, on_device.optim)
    assert (offloaded.total, offloaded.host) == (0, state)
    c = msgspec.structs.replace(c, plan=PlanConfig(cpu_offload=True))
    e = estimate(c, plan_model(c)[1])
    assert e.memory == offloaded and e.peak == e.activations + e.fsdp_buffers
    assert f"  {'the three above: host memory':<34}{state / 2**30:10.3f} GiB  (not in peak)" in estimate_table(e, c)
