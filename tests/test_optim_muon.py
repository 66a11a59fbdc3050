"""ShapeBatchedMuon (stability/optim_muon.py) against torch.optim.Muon itself: the same weights after several steps
(square, tall and wide matrices, two parameter groups with their own rates and decay, Nesterov or not, both learning
rate adjustments, a matrix without a gradient), the same state; a planted error in the batched iteration fails the same
comparison; and the launches of a step no longer grow with the number of matrices of a shape."""
import pytest
import torch

from stability import optim_muon
from stability.optim_muon import ShapeBatchedMuon, newton_schulz_stack
from stability.testing.gpu_model import count

SHAPES = [(16, 16)] * 4 + [(48, 16), (16, 48), (48, 16), (16, 48)]


def parameters(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen) * 0.1) for shape in SHAPES]


def groups(params, lr: float):
    return [{"params": params[:3], "lr": lr}, {"params": params[3:], "lr": lr / 3, "weight_decay": 0.1}]


def run(optimizer_class, steps: int = 4, **options) -> tuple[list[torch.Tensor], dict]:
    params = parameters()
    optimizer = optimizer_class(groups(params, 0.05), lr=0.05, momentum=0.9, weight_decay=0.0, **options)
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 + step)
        for i, p in enumerate(params):
            p.grad = None if i == 1 and step == 2 else torch.randn(p.shape, generator=gen)  # one step skips a matrix
        optimizer.step()
    return [p.detach().clone() for p in params], optimizer.state_dict()


def differences(options: dict) -> float:
    ours, our_state = run(ShapeBatchedMuon, **options)
    theirs, their_state = run(torch.optim.Muon, **options)
    state = max(float((a["momentum_buffer"] - b["momentum_buffer"]).abs().max())
                for a, b in zip(our_state["state"].values(), their_state["state"].values()))
    return max(max(float((a - b).abs().max()) for a, b in zip(ours, theirs)), state)


# bf16 rounding of one update (lr · 2⁻⁸ at most); the updates themselves are ≈ lr = 0.05 in size
TOLERANCE = 0.05 * 2 ** -8


@pytest.mark.parametrize("options", [{"adjust_lr_fn": "original"}, {"adjust_lr_fn": "match_rms_adamw"},
                                     {"adjust_lr_fn": "original", "nesterov": False}])
def test_the_weights_and_state_are_torchs_muon(options):
    assert differences(options) <= TOLERANCE


@pytest.mark.parametrize("planted", ["cubic", "outputs in the wrong order", "not normalised"])
def test_a_planted_error_in_the_batched_iteration_fails(planted, monkeypatch):
    def wrong(stack, coefficients, steps, eps):
        if planted == "cubic":
            return newton_schulz_stack(stack, (1.5, -0.5, 0.0), steps, eps)
        if planted == "outputs in the wrong order":
            return newton_schulz_stack(stack, coefficients, steps, eps).flip(0)
        norms = torch.linalg.vector_norm(stack.float(), dim=(-2, -1), keepdim=True)
        return newton_schulz_stack(stack, coefficients, steps, eps) * norms  # the update scaled by ‖X‖_F

    monkeypatch.setattr(optim_muon, "orthogonalise", wrong)
    assert differences({"adjust_lr_fn": "original"}) > 10 * TOLERANCE


def test_an_adjustment_it_lacks_is_refused_by_name():
    with pytest.raises(ValueError, match="spectral"):
        optim_muon.adjusted_lr(1.0, "spectral", (2, 3))


def launches(optimizer_class, matrices: int, shapes: list[tuple[int, int]] | None = None) -> int:
    params = [torch.nn.Parameter(torch.randn(*shape)) for shape in shapes or [(16, 16)] * matrices]
    optimizer = optimizer_class(params, lr=0.01, momentum=0.9, weight_decay=0.0, adjust_lr_fn="original")

    def step():
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer.step()

    step()
    return count(step).launches


def test_a_steps_launches_do_not_grow_with_the_matrices_of_a_shape():
    """torch's Muon launches ≈ 20 kernels a matrix; the batched one a fixed number per shape (and a few per
    matrix for the gradients set here and the unstacking views, which launch nothing)."""
    theirs = launches(torch.optim.Muon, 12) - launches(torch.optim.Muon, 4)
    ours = launches(ShapeBatchedMuon, 12) - launches(ShapeBatchedMuon, 4)
    assert theirs >= 8 * 15 and ours <= 8 * 2, (theirs, ours)


def test_a_tall_matrix_shares_the_batch_of_its_transposed_shape():
    """fc1 (4D × D) and fc2 (D × 4D): one batch on the wide side, as two wide matrices are (one launch more: the
    tall update's copy back to its layout), where two batches would launch twice the iteration."""
    pair = launches(ShapeBatchedMuon, 2, [(16, 48), (16, 48)])
    assert pair <= launches(ShapeBatchedMuon, 2, [(16, 48), (48, 16)]) <= pair + 1
    assert 2 * launches(ShapeBatchedMuon, 1, [(48, 16)]) > pair + 15


def test_the_updates_reach_the_weights_in_their_dtype_and_layout(monkeypatch):
    """CUDA's fused _foreach_add_ needs one dtype and one layout across its lists (else it adds matrix by matrix):
    the orthogonalised updates, tall matrices' included, come in the weights' dtype, contiguous."""
    seen = []
    original = torch._foreach_add_

    def recording(params, updates, **kwargs):
        seen.extend((p.dtype, u.dtype, u.is_contiguous(), p.shape == u.shape) for p, u in zip(params, updates))
        return original(params, updates, **kwargs)

    monkeypatch.setattr(torch, "_foreach_add_", recording)
    run(ShapeBatchedMuon, steps=2, adjust_lr_fn="original")
    assert len(seen) == 2 * len(SHAPES) and all(p == u and contiguous and same for p, u, contiguous, same in seen)


def test_decay_of_bf16_weights_is_torchs():
    """A foreach multiply would round 1 − lr·λ to bf16 (0.998 → 0.996: twice the decay); torch's mul_ does not."""
    def decayed(optimizer_class):
        p = torch.nn.Parameter(torch.randn(32, 32, generator=torch.Generator().manual_seed(0)).bfloat16())
        optimizer = optimizer_class([p], lr=0.02, weight_decay=0.1, momentum=0.9, adjust_lr_fn="original")
        p.grad = torch.zeros_like(p)
        optimizer.step()
        return p.detach().float()

    assert torch.equal(decayed(ShapeBatchedMuon), decayed(torch.optim.Muon))
