"""The attack's unit of work and its clock: ``input_gradient`` equals the cross-entropy's gradient by
``torch.func.grad`` (at the input and at the weights) and leaves every ``.grad`` alone, also on tensors made under
inference mode; ``wall_clock.seconds`` counts the whole step."""
import time

import pytest
import torch
from torch import nn

from stability.robustness.attacks import gradients_allowed, input_gradient
from stability.wall_clock import seconds


def network() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 5)).double()


def reference(net: nn.Module, images: torch.Tensor, labels: torch.Tensor):
    params = dict(net.named_parameters())

    def loss(x, p):
        return nn.functional.cross_entropy(torch.func.functional_call(net, p, (x,)), labels)

    return torch.func.grad(loss, argnums=(0, 1))(images, params)


def test_the_input_gradient_is_the_cross_entropys_gradient_and_touches_no_grad():
    net = network()
    gen = torch.Generator().manual_seed(1)
    images = torch.randn(6, 3, 2, 2, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 5, (6,), generator=gen)
    expected_x, expected_p = reference(net, images, labels)
    weights = [net[1].weight, net[3].bias]
    with torch.inference_mode():  # as Lightning's test loop hands them over
        frozen_images, frozen_labels = images.clone(), labels.clone()
    with gradients_allowed():
        grad_x, grad_w, grad_b = input_gradient(net, frozen_images, frozen_labels, weights)
    torch.testing.assert_close(grad_x, expected_x, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad_w, expected_p["1.weight"], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad_b, expected_p["3.bias"], rtol=1e-12, atol=1e-14)
    assert all(p.grad is None for p in net.parameters())
    # a planted error fails the same comparison: the gradient of the loss summed, not averaged
    wrong_x = torch.func.grad(lambda x: nn.functional.cross_entropy(net(x), labels, reduction="sum"))(images)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(grad_x, wrong_x, rtol=1e-12, atol=1e-14)


def test_the_clock_counts_the_whole_step():
    calls = []
    elapsed = seconds(lambda: (time.sleep(0.02), calls.append(1)), "cpu")
    assert calls == [1] and elapsed >= 0.02


def test_the_clock_waits_for_a_gpu_before_and_after_the_step(monkeypatch):
    """On CUDA the host waits for the device's queue on both sides of the step (kernels are asynchronous); on the
    CPU there is nothing to wait for."""
    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(("sync", str(device))))
    seconds(lambda: events.append("step"), "cuda:0")
    assert events == [("sync", "cuda:0"), "step", ("sync", "cuda:0")]
    events.clear()
    seconds(lambda: events.append("step"), "cpu")
    assert events == ["step"]
