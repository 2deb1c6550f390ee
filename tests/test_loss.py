"""The chunked cross-entropy (`shardlab.training.loss`) against F.cross_entropy: values, logits' and parameters'
gradients, ignored labels, bf16 logits, a model's micro batch (eager and compiled), evaluation without gradients,
and the logits freed before the backward."""

import copy
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from shardlab.config import Config, DataConfig, MeshSpec, ModelConfig, PlanConfig, TrainConfig
from shardlab.data.loader import IGNORE_INDEX
from shardlab.parallel._compile import is_compiled
from shardlab.training import loss as loss_module
from shardlab.training.loop import build_model
from shardlab.training.loss import summed_loss
from shardlab.training.step import forward_backward


@pytest.fixture
def small_chunks(monkeypatch):
    """7 rows of a 50-token vocabulary per chunk: the rows below split into several chunks, the last one short."""
    monkeypatch.setattr(loss_module, "CHUNK_ELEMENTS", 7 * 50 + 3)


def reference(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """What shardlab's loss was before chunking: fp32 logits of the whole micro batch."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)


def logits_and_labels(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(3, 11, 50, generator=g)).to(dtype)
    labels = torch.randint(0, 50, (3, 11), generator=g)
    labels[0, :4] = IGNORE_INDEX  # ignored tokens, a whole chunk of them among them
    labels[1, 2:9] = IGNORE_INDEX
    labels[2, -1] = IGNORE_INDEX
    return logits, labels


def loss_and_grad(fn, logits: torch.Tensor, labels: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.clone().requires_grad_(True)
    loss = fn(x, labels)
    (loss * scale).backward()
    return loss.detach(), x.grad


def test_loss_and_gradient_are_cross_entropys_in_fp32(small_chunks):
    logits, labels = logits_and_labels(torch.float32)
    loss, grad = loss_and_grad(summed_loss, logits, labels, scale=0.37)
    want_loss, want_grad = loss_and_grad(reference, logits, labels, scale=0.37)
    assert loss.dtype == torch.float32 and loss.shape == ()
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-7)
    assert grad[labels == IGNORE_INDEX].eq(0).all()  # ignored tokens get no gradient


def test_bf16_logits_get_bf16_gradients_of_the_fp32_loss(small_chunks):
    logits, labels = logits_and_labels(torch.bfloat16)
    loss, grad = loss_and_grad(summed_loss, logits, labels, scale=0.37)
    want_loss, want_grad = loss_and_grad(reference, logits, labels, scale=0.37)
    assert loss.dtype == torch.float32 and grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)  # the loss is fp32 over the same bf16 values
    torch.testing.assert_close(grad, want_grad)  # bf16's tolerance: the fp32 gradient rounded twice, not once
    exact = torch.func.grad(lambda x: reference(x, labels) * 0.37)(logits.float())
    torch.testing.assert_close(grad.float(), exact, rtol=2 * 2**-8, atol=1e-6)


def test_every_token_ignored_gives_zero_loss_and_gradient():
    logits, labels = logits_and_labels(torch.float32)
    loss, grad = loss_and_grad(summed_loss, logits, torch.full_like(labels, IGNORE_INDEX), scale=1.0)
    assert loss.item() == 0.0 and grad.eq(0).all()


@pytest.mark.parametrize("softcap", [False, True], ids=["linear head", "soft-capped head"])
def test_parameter_gradients_are_cross_entropys(small_chunks, softcap):
    """Through a head (and a Gemma-style logit soft cap, whose tanh keeps its own output): the parameters get the
    gradients F.cross_entropy gives them."""
    torch.manual_seed(0)
    head = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 50))
    ref = copy.deepcopy(head)
    hidden = torch.randn(3, 11, 16)
    _, labels = logits_and_labels(torch.float32)

    def logits_of(m):
        y = m(hidden)
        return torch.tanh(y / 2.0) * 2.0 if softcap else y

    loss = summed_loss(logits_of(head), labels)
    (loss * 0.1).backward()
    want = reference(logits_of(ref), labels)
    (want * 0.1).backward()
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=0)
    for (name, p), q in zip(head.named_parameters(), ref.parameters()):
        assert p.grad is not None and p.grad.abs().sum() > 0, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_the_backward_runs_once():
    x = torch.randn(2, 3, 5, requires_grad=True)
    loss = summed_loss(x, torch.zeros(2, 3, dtype=torch.long))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


class OpNames(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_evaluation_computes_no_gradient():
    """Without gradients the loss is the same number and no gradient is computed (no scatter of the one-hot)."""
    logits, labels = logits_and_labels(torch.float32)
    with torch.no_grad(), OpNames() as ops:
        loss = summed_loss(logits.clone().requires_grad_(True), labels)
    assert loss.grad_fn is None and "scatter_add_" not in ops.names
    torch.testing.assert_close(loss, reference(logits, labels), rtol=1e-6, atol=0)
    with OpNames() as ops:
        summed_loss(logits.clone().requires_grad_(True), labels)
    assert "scatter_add_" in ops.names  # the op the check above looks for is the gradient's


def test_the_loss_does_not_keep_the_logits():
    """Only the gradient is kept: the logits are freed once the caller drops them, before the backward."""
    head = torch.nn.Linear(16, 50)
    logits = head(torch.randn(3, 11, 16))
    alive = weakref.ref(logits)
    loss = summed_loss(logits, logits_and_labels(torch.float32)[1])
    del logits
    gc.collect()
    assert alive() is None
    loss.backward()
    assert head.weight.grad is not None


def tiny(compile: bool = False) -> Config:
    return Config(
        mesh=MeshSpec(dp_shard=1),
        model=ModelConfig(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=300),
        train=TrainConfig(steps=3, global_batch=4, seq_len=16),
        data=DataConfig(source="synthetic"),
        plan=PlanConfig(compile=compile),
    )


def check_model_gradients(compile: bool, monkeypatch) -> None:
    """One micro batch of shardlab's Llama on one rank through `forward_backward` (the step's), in chunks of 5
    rows, against the same model's F.cross_entropy: the loss and every parameter's gradient."""
    monkeypatch.setattr(loss_module, "CHUNK_ELEMENTS", 5 * 300)
    model, plan, _ = build_model(tiny(compile))
    assert all(is_compiled(block) == compile for block in model.model.layers)
    g = torch.Generator().manual_seed(1)
    inputs, labels = torch.randint(0, 300, (4, 16), generator=g), torch.randint(0, 300, (4, 16), generator=g)
    labels[:, :3] = IGNORE_INDEX
    scale = torch.tensor(1 / 52)
    loss = forward_backward(model, inputs, labels, scale, plan.loss_parallel)
    got = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    want = reference(model(inputs), labels)
    (want * scale).backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=0)
    for name, p in model.named_parameters():
        assert got[name].abs().sum() > 0, name
        torch.testing.assert_close(got[name], p.grad, rtol=1e-5, atol=1e-8, msg=name)


def test_a_model_micro_batch_gets_cross_entropys_gradients(monkeypatch):
    check_model_gradients(False, monkeypatch)


@pytest.mark.slow
@pytest.mark.world  # a cold torch.compile (inductor on CPU): the full suite's tier
def test_a_compiled_model_micro_batch_gets_cross_entropys_gradients(monkeypatch):
    """plan.compile (inductor on CPU: tens of seconds to compile on 2 cores)."""
    check_model_gradients(True, monkeypatch)


def test_the_step_lets_the_backward_write_the_gradient_into_the_logits(small_chunks):
    """reuse_logits: a linear head's logits take their own gradient in the backward (no second buffer), and the
    head's parameters get F.cross_entropy's gradients; where the producer's backward reads its output (tanh) or the
    logits are a leaf, they are left as they were."""
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(3, 11, 16, generator=g), torch.randn(50, 16, generator=g)
    _, labels = logits_and_labels(torch.float32)

    def run(head, loss_fn, **kwargs):
        w = weight.clone().requires_grad_(True)
        logits = head(hidden, w)
        seen = logits.detach()  # the same memory
        before = seen.clone()
        (loss_fn(logits, labels, **kwargs) * 0.37).backward()
        return w.grad, seen, before

    linear = lambda h, w: h @ w.T  # noqa: E731
    grad, seen, before = run(linear, summed_loss, reuse_logits=True)
    want, _, _ = run(linear, reference)
    torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6)
    x = before.clone().requires_grad_(True)
    (reference(x, labels) * 0.37).backward()
    torch.testing.assert_close(seen, x.grad, rtol=1e-5, atol=1e-7)  # the logits now hold their gradient
    assert not torch.equal(seen, before)

    capped = lambda h, w: torch.tanh(h @ w.T)  # noqa: E731  # tanh's backward reads its output
    grad, seen, before = run(capped, summed_loss, reuse_logits=True)
    want, _, _ = run(capped, reference)
    torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(seen, before)
    leaf = before.clone().requires_grad_(True)
    summed_loss(leaf, labels, reuse_logits=True).backward()
    assert torch.equal(leaf.detach(), before)
