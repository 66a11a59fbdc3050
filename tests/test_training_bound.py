"""The certified losses' per-step bound (stability/lipschitz/training_bound.py): the heads' σ̂ taken from each block's
weights at once equal the per-matrix σ̂ = uᵀWv, in value and gradient, on the Lipschitz-transformer ViT (fused-qkv
rows) and on the hybrid (unit L2 attention, whose W_K is its W_Q)."""
import pytest
import torch

from stability.classifier import ImageClassifier
from stability.lipschitz.transformer_bounds import bound_matrices, pixel_bound


def lipschitz_vit() -> ImageClassifier:
    return ImageClassifier(backbone_options=dict(embed_dim=16, depth=2, num_heads=2), image_size=8,
                           stabilizer=["lipschitz_transformer", "muon", "gloro"],
                           stabilizer_options={"lipschitz_transformer": {"zero_init": False}})


def lipschitz_vit_one_head() -> ImageClassifier:
    """One head: d = D, so each head's W_Q, W_K, W_V and W_O share one power-iteration group with the whole W_O."""
    return ImageClassifier(backbone_options=dict(embed_dim=16, depth=2, num_heads=1), image_size=8,
                           stabilizer=["lipschitz_transformer", "muon", "gloro"],
                           stabilizer_options={"lipschitz_transformer": {"zero_init": False}})


def hybrid() -> ImageClassifier:
    return ImageClassifier(backbone="hybrid", image_size=8, backbone_options={"num_heads": 2},
                           stabilizer=["lipschitz_transformer", "muon", "gloro"],
                           stabilizer_options={"lipschitz_transformer": {"attention": "l2_unit", "pooling": "flatten",
                                                                         "zero_init": False}})


def per_matrix_sigmas(bound, network) -> dict[str, torch.Tensor]:
    """The reference: σ̂ = uᵀWv of every matrix of the bound on its own (a slice of the weight per head)."""
    matrices = bound_matrices(network)
    weights = [matrices[name] for name in bound._names]
    sigmas = {}
    for group in bound._power.step(weights, bound.iterations):
        stacked = torch.stack([weights[i] for i in group.indices]).to(group.weight.dtype)
        values = torch.einsum("gm,gmn,gn->g", group.u, stacked, group.v)
        sigmas.update({bound._names[i]: value for i, value in zip(group.indices, values.unbind(0))})
    return sigmas


@pytest.mark.parametrize("build", [lipschitz_vit, lipschitz_vit_one_head, hybrid], ids=["vit", "vit-1-head", "hybrid"])
def test_the_heads_taken_at_once_equal_each_head_alone_in_value_and_gradient(build):
    torch.manual_seed(0)
    module = build()
    network, bound = module.network, module.stabilizers[-1].training_bound
    assert bound._head_blocks == [0, 1]  # every block takes its heads at once
    with torch.no_grad():  # rows scaled apart: every head's σ differs (orthogonal initialisations make them all 1)
        for weight in (p for p in network.parameters() if p.ndim == 2):
            weight.mul_(1 + torch.rand(weight.shape[0], 1))
    bases = {name: b.clone() for name, b in network.named_buffers() if name.endswith("_basis")}
    fast = bound.estimated_sigmas(network)
    for name, b in network.named_buffers():  # the same power-iteration step for the reference
        if name in bases:
            b.copy_(bases[name])
    slow = per_matrix_sigmas(bound, network)
    heads = network.backbone.blocks[0].block.attn.num_heads
    def per_name(sigmas: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every matrix's σ̂ under its own name (a block's head vectors split)."""
        flat = {}
        for name in slow:
            block, _, matrix = name.partition(".")
            vector = sigmas.get(f"{block}.{matrix[:1]}[heads]") if matrix[1:].isdigit() else None
            flat[name] = vector[int(matrix[1:])] if vector is not None else sigmas[name]
        return flat

    for name, value in slow.items():
        assert float(per_name(fast)[name].detach()) == pytest.approx(float(value.detach()), rel=1e-5, abs=1e-7), name
    for part in "qkvo":  # distinct heads: a head order mixed up would show
        per_head = torch.stack([slow[f"{i}.{part}{h}"] for i in (0, 1) for h in range(heads)]).detach()
        assert float(per_head.max() / per_head.min()) > 1.001, part  # and distinct blocks: a block order too
    coefficients = torch.Generator().manual_seed(3)

    def gradients(sigmas: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        module.zero_grad()
        total, _ = pixel_bound(network, differentiable=True, sigmas=sigmas)
        flat = per_name(sigmas)
        (total + sum(torch.rand((), generator=coefficients) * flat[name] for name in sorted(flat))).backward()
        return {n: p.grad.clone() for n, p in network.named_parameters() if p.grad is not None}

    state = coefficients.get_state()
    fast_grads = gradients(fast)
    coefficients.set_state(state)
    slow_grads = gradients({**slow, **{k: v for k, v in fast.items() if k == "stem"}})
    assert fast_grads.keys() == slow_grads.keys()
    for name in fast_grads:
        torch.testing.assert_close(fast_grads[name], slow_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def compiled_against_eager(build, compose=None) -> tuple[float, float]:
    """The largest relative differences, in the bound (total and features) and in the weights' gradients, between
    the composition compiled (``--model.compile``) and eager, on the same σ̂ estimates."""
    from stability.lipschitz.training_bound import composed_bound

    torch.manual_seed(0)
    module = build()
    network, bound = module.network, module.stabilizers[-1].training_bound
    sigmas = {k: v.detach().requires_grad_(True) for k, v in bound.estimated_sigmas(network).items()}
    bound.compile()
    if compose is not None:  # a planted error, compiled the same way
        bound._compiled_composition = torch.compile(compose, fullgraph=True, dynamic=False)
    results = []
    for function in (bound.composition(), composed_bound):
        for s in sigmas.values():
            s.grad = None
        module.zero_grad()
        total, features = function(network, sigmas)
        (total + features).backward()
        grads = [s.grad for s in sigmas.values()] + [p.grad for p in network.parameters() if p.grad is not None]
        results.append((torch.stack([total, features]).detach(), grads))
    (values, grads), (expected, expected_grads) = results
    assert len(grads) == len(expected_grads) and float(expected[0]) > 0
    assert [g is None for g in grads] == [e is None for e in expected_grads]  # the same inputs reached
    grads, expected_grads = [g for g in grads if g is not None], [e for e in expected_grads if e is not None]
    value_error = float(((values - expected).abs() / expected.abs()).max())
    grad_error = max(float((g - e).abs().max() / e.abs().max().clamp_min(1e-30)) for g, e in zip(grads, expected_grads))
    return value_error, grad_error


@pytest.mark.parametrize("build", [lipschitz_vit, hybrid], ids=["vit", "hybrid"])
def test_the_compiled_composition_equals_the_eager_one_in_value_and_gradient(build):
    """``--model.compile`` compiles the bound's composition in one graph (fullgraph: a graph break would raise), with
    the eager bound's value and gradients to float32 rounding; a planted error of 1e-4 in one σ̂ fails it."""
    value_error, grad_error = compiled_against_eager(build)
    assert value_error <= 1e-6 and grad_error <= 1e-5, (value_error, grad_error)
    from stability.lipschitz.training_bound import composed_bound

    def planted(network, sigmas):
        return composed_bound(network, {**sigmas, "head": sigmas["head"] * (1 + 1e-4)})

    assert compiled_against_eager(build, planted)[0] > 1e-6


def test_a_compiled_model_compiles_its_certified_loss_bound_and_an_eager_one_does_not_and_both_pickle():
    import copy
    import pickle

    from stability.lipschitz.training_bound import composed_bound

    options = dict(backbone_options=dict(embed_dim=16, depth=1, num_heads=2), image_size=8,
                   stabilizer=["lipschitz_transformer", "muon", "gloro"])
    assert ImageClassifier(**options).stabilizers[-1].training_bound.composition() is composed_bound
    compiled = ImageClassifier(**options, compile=True)
    bound = compiled.stabilizers[-1].training_bound
    assert bound.composition() is not composed_bound  # (compiled at its first call)
    for restored in (pickle.loads(pickle.dumps(compiled)), copy.deepcopy(compiled)):  # ddp_spawn, torch.save
        again = restored.stabilizers[-1].training_bound
        assert again.compiled and again.composition() is not composed_bound
