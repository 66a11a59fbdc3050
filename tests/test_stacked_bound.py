"""The certified losses' bound composed for all blocks at once (stability/lipschitz/stacked_bound.py) is the pixel
bound composed block by block (transformer_bounds.pixel_bound, the certificate's composition), in value and gradient:
float64 to 1e-10, on every attention the bound knows (dot product with and without biases, L2 and unit L2, token
mixing), on the ViT and the hybrid, with class-token, average and all-token pooling, one head or several, different
residual weights per block, and heads so unequal that the per-head side of every min wins; compiled too; a planted
error fails."""
import pytest
import torch

from stability.classifier import ImageClassifier
from stability.lipschitz import stacked_bound
from stability.lipschitz.stacked_bound import stacked_pixel_bound
from stability.lipschitz.transformer_bounds import bound_matrices, pixel_bound
from stability.testing.gpu_model import count

VIT = dict(embed_dim=16, depth=3, num_heads=2)


def network_of(attention: str = "dot", biases: bool = False, pooling: str = "backbone", depth: int = 3,
               residuals: list[float] | None = None, heads: int = 2, backbone: str = "vit",
               unequal_heads: bool = False, zero_values: bool = False) -> torch.nn.Module:
    """A Lipschitz-transformer ViT (or the hybrid) in float64, its weights random (the bound then moves with every one
    of them). ``unequal_heads``: head 1's W_Q, W_K, W_V rows × 0.02 and its W_O columns × 5, so that Σ_h ‖W_O^h‖·x_h
    is below ‖W_O‖·‖x‖ and wins every min. ``zero_values``: the first block's W_V and b_V zero (a zero-initialised
    matrix): its value sizes are 0, where a square root's gradient would be infinite."""
    torch.manual_seed(0)
    average = pooling == "avg"
    options = {"num_heads": heads} if backbone == "hybrid" else \
        {**VIT, "depth": depth, "num_heads": heads, **({"global_pool": "avg"} if average else {})}
    module = ImageClassifier(backbone=backbone, backbone_options=options, image_size=8,
                             stabilizer="lipschitz_transformer,muon",
                             stabilizer_options={"lipschitz_transformer": {
                                 "attention": attention, "biases": biases, "zero_init": False,
                                 "pooling": "backbone" if average else pooling}})
    assert (module.network.backbone.global_pool == "avg") == average
    network = module.network.double()
    with torch.no_grad():
        for p in network.parameters():
            p.copy_(torch.randn_like(p) * (0.5 if p.ndim == 2 else 0.3))
        if unequal_heads:
            for wrapper in network.backbone.blocks:
                attn = wrapper.block.attn
                width = attn.head_dim
                for part in (attn.qkv.q, attn.qkv.k, attn.qkv.v):
                    part.weight[width:2 * width] *= 0.02
                attn.proj.weight[:, width:2 * width] *= 5
        if zero_values:
            values = network.backbone.blocks[0].block.attn.qkv.v
            values.weight.zero_()
            if values.bias is not None:
                values.bias.zero_()
    for wrapper, a in zip(network.backbone.blocks, residuals or []):
        wrapper.a = a
    return network


def estimates(network: torch.nn.Module, per_block_heads: bool) -> dict[str, torch.Tensor]:
    """σ̂ of every matrix of the bound (exact, float64, leaves), per-head values or, as the training bound gives them,
    one vector a block and part (``"<i>.q[heads]"``)."""
    sigmas = {name: torch.linalg.matrix_norm(m.detach().reshape(m.shape[0], -1), ord=2)
              for name, m in bound_matrices(network).items()}
    if per_block_heads:
        for key in [k for k in sigmas if k.split(".")[-1][1:].isdigit()]:
            block, matrix = key.split(".")
            vector = f"{block}.{matrix[0]}[heads]"
            if vector not in sigmas:
                heads = sum(1 for k in sigmas if k.startswith(f"{block}.{matrix[0]}") and k.split(".")[1][1:].isdigit())
                sigmas[vector] = torch.stack([sigmas[f"{block}.{matrix[0]}{h}"] for h in range(heads)])
        sigmas = {k: v for k, v in sigmas.items() if not k.split(".")[-1][1:].isdigit()}
    return {k: v.clone().requires_grad_(True) for k, v in sigmas.items()}


def composed(compose, network, sigmas) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(total, features) and the gradients of a fixed combination of both into the σ̂ and the network's parameters."""
    for s in sigmas.values():
        s.grad = None
    network.zero_grad()
    total, features = compose(network, sigmas)
    (total + 0.7 * features).backward()
    grads = [s.grad for s in sigmas.values()] + [p.grad for p in network.parameters()]
    return torch.stack([total, features]).detach(), grads


def largest_difference(network, sigmas, compose=stacked_pixel_bound) -> tuple[float, float]:
    """The largest relative differences, in the bound and in its gradients, from the block-by-block composition."""
    values, grads = composed(compose, network, sigmas)
    expected, expected_grads = composed(lambda n, s: pixel_bound(n, differentiable=True, sigmas=s), network, sigmas)
    # (the last block's output size, which no bound reads, is computed here for all blocks at once: its biases get a
    # zero gradient where the block-by-block composition gives none)
    pairs = [(torch.zeros_like(e) if g is None else g, torch.zeros_like(g) if e is None else e)
             for g, e in zip(grads, expected_grads) if g is not None or e is not None]
    assert any(float(e.abs().max()) > 0 for _, e in pairs)
    value_error = float(((values - expected).abs() / expected.abs()).max())
    grad_error = max(float((g - e).abs().max() / e.abs().max().clamp_min(1e-300)) for g, e in pairs)
    return value_error, grad_error


CASES = {
    "dot": dict(),
    "dot, biases": dict(biases=True),
    "dot, average pooling, residual weights per block": dict(pooling="avg", residuals=[0.3, 0.7, 1.0]),
    "dot, biases, residual weights per block": dict(biases=True, residuals=[0.5, 0.9, 0.2]),
    "l2": dict(attention="l2"),
    "l2_unit, average pooling": dict(attention="l2_unit", pooling="avg"),
    "dot, unequal heads": dict(unequal_heads=True),
    "dot, biases, unequal heads": dict(biases=True, unequal_heads=True),
    "dot, one head": dict(heads=1),
    "dot, biases, a zero W_V and b_V": dict(biases=True, zero_values=True),
    "dot, biases, one head": dict(biases=True, heads=1),
    "l2_unit, one head": dict(attention="l2_unit", heads=1),
    "hybrid, l2_unit, all tokens to the head": dict(backbone="hybrid", attention="l2_unit", pooling="flatten"),
    "hybrid, dot, biases": dict(backbone="hybrid", biases=True),
    "mixing": dict(attention="mixing", residuals=[0.4, 0.6, 0.8]),
    "l2_unit, all tokens to the head": dict(attention="l2_unit", pooling="flatten"),
    "dot, one block": dict(depth=1),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("per_block_heads", [False, True], ids=["per-head values", "head vectors"])
def test_the_stacked_composition_is_the_block_by_block_one_in_value_and_gradient(case, per_block_heads):
    network = network_of(**CASES[case])
    value_error, grad_error = largest_difference(network, estimates(network, per_block_heads))
    assert value_error <= 1e-10 and grad_error <= 1e-10, (value_error, grad_error)


RESIDUALS = [0.5, 0.9, 0.2]


@pytest.mark.parametrize("biases", [False, True], ids=["linear sizes", "biased sizes"])
@pytest.mark.parametrize("plant", ["a block's residual weight", "the MLP's activation constant", "the size map",
                                   "the dot bound's column sum", "the heads' W_O in reverse block order"])
def test_a_planted_error_fails(plant, biases, monkeypatch):
    """Each planted error moves the bound or its gradient by far more than the tolerance above (with unequal heads,
    so that the per-head side of every min is the one that counts)."""
    network = network_of(biases=biases, residuals=RESIDUALS, unequal_heads=True)
    sigmas = estimates(network, True)
    if plant == "a block's residual weight":
        original = stacked_bound._per_block
        monkeypatch.setattr(stacked_bound, "_per_block", lambda values, like: original(
            [*values[:-1], values[-1] * 1.01] if values == RESIDUALS else values, like))
    elif plant == "the MLP's activation constant":
        monkeypatch.setattr(stacked_bound, "activation_lipschitz", lambda act: 1.01)
    elif plant == "the size map":
        if biases:
            original_call = stacked_bound._BiasedSize.__call__
            monkeypatch.setattr(stacked_bound._BiasedSize, "__call__", lambda self, r: original_call(self, r) * 1.01)
        else:
            original_map = stacked_bound._DotAttention.size_map
            monkeypatch.setattr(stacked_bound._DotAttention, "size_map",
                                lambda self, a: tuple(1.01 * x for x in original_map(self, a)))
    elif plant == "the dot bound's column sum":
        monkeypatch.setattr(stacked_bound, "column_sum_bound", lambda n, width: n / (1 + (n - 1) * torch.exp(-width))
                            * 1.001)
    else:
        original_init = stacked_bound._DotAttention.__init__

        def reversed_w_o(self, *args):
            original_init(self, *args)
            self.w_o = self.w_o.flip(0)

        monkeypatch.setattr(stacked_bound._DotAttention, "__init__", reversed_w_o)
    assert max(largest_difference(network, sigmas)) > 1e-6


@pytest.mark.parametrize("case", ["dot, one head", "dot, biases, one head", "l2_unit, one head", "dot"])
def test_the_stacked_composition_compiled_is_the_block_by_block_one(case):
    """Traced by torch.compile through AOTAutograd (fake tensors: with one head, torch 2.11's gave a norm over the heads
    a shape of its own, and the graph broadcast the blocks against themselves: the dot cases failed to trace, the L2
    case ran with a wrong value), the stacked bound is still pixel_bound's."""
    torch._dynamo.reset()
    network = network_of(**CASES[case])
    compiled = torch.compile(stacked_pixel_bound, fullgraph=True, dynamic=False, backend="aot_eager")
    value_error, grad_error = largest_difference(network, estimates(network, True), compiled)
    assert value_error <= 1e-10 and grad_error <= 1e-10, (value_error, grad_error)


def test_blocks_of_different_kinds_are_composed_block_by_block():
    network = network_of(attention="l2")
    network.backbone.blocks[1].block.attn.unit = True  # one block unit L2 attention, the others not
    sigmas = estimates(network, True)
    assert max(largest_difference(network, sigmas)) <= 1e-10


def test_the_stacked_composition_launches_far_fewer_kernels_and_a_block_costs_a_few():
    """Twelve blocks of ViT: the block-by-block composition launches about 160 kernels a block, forward and backward
    (2,003 in all); the stacked one 5 a block (its linear size maps: one multiply-add a block, forward and backward)
    and about 225 besides (285 in all)."""
    def launches(compose, depth: int) -> float:
        network = network_of(depth=depth).float()
        sigmas = {k: v.detach().float().requires_grad_(True) for k, v in estimates(network, True).items()}

        def step():
            total, features = compose(network, sigmas)
            (total + features).backward()
        return count(step).launches

    block_by_block = lambda n, s: pixel_bound(n, differentiable=True, sigmas=s)  # noqa: E731
    slow = [launches(block_by_block, depth) for depth in (2, 12)]
    fast = [launches(stacked_pixel_bound, depth) for depth in (2, 12)]
    per_block_slow, per_block_fast = (slow[1] - slow[0]) / 10, (fast[1] - fast[0]) / 10
    assert per_block_slow >= 100 and per_block_fast <= 8, (per_block_slow, per_block_fast)
    assert fast[1] <= slow[1] / 5, (fast, slow)
