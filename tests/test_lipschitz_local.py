"""Local Lipschitz estimates against the exact Jacobian (torch.func.jacrev + matrix 2-norm)."""
import pytest
import torch
from torch.func import jacrev

from stability.classifier import ImageClassifier
from stability.lipschitz import empirical_lower_bound, jacobian_norm, jacobian_norm_one_pass
from stability.lipschitz.local import local_method
from stability.models import attention_sites, explicit_attention

BACKBONES = {"vit": (8, dict(embed_dim=16, depth=1, num_heads=2)),
             "swin": (16, dict(embed_dim=16, depths=(1, 1), num_heads=(2, 2))),
             "cswin": (16, dict(embed_dim=16, depths=(1, 1), num_heads=(2, 4), stripe_widths=(2, 2)))}


def tiny(backbone, stabilizer="none"):
    size, options = BACKBONES[backbone]
    torch.manual_seed(0)
    module = ImageClassifier(backbone=backbone, image_size=size, backbone_options=options, stabilizer=stabilizer)
    return module.network.eval().double(), size


def exact_norms(network, images):
    with explicit_attention(network.backbone):  # jacrev cannot go through the fused Swin kernel's mask
        return torch.stack([torch.linalg.matrix_norm(
            jacrev(lambda z: network(z[None])[0])(x).reshape(network(x[None]).shape[1], -1), ord=2) for x in images])


@pytest.mark.parametrize("backbone", ["vit", "swin", "cswin"])
def test_power_iteration_and_exact_agree_with_jacrev(backbone):
    network, size = tiny(backbone)
    images = torch.rand(3, 1, size, size, dtype=torch.float64)
    exact = exact_norms(network, images)
    torch.testing.assert_close(jacobian_norm(network, images, method="exact"), exact, rtol=1e-8, atol=1e-12)
    power = jacobian_norm(network, images, iterations=30)
    assert (power <= exact * (1 + 1e-9)).all()  # power iteration approaches from below
    torch.testing.assert_close(power, exact, rtol=1e-3, atol=0)  # stated tolerance: 0.1% after 30 iterations
    assert all(s.module.fused_attn for s in attention_sites(network))  # fused path restored


@pytest.mark.parametrize("backbone", ["vit", "swin", "cswin"])
def test_the_one_pass_exact_norm_is_the_exact_norm_also_padded_to_a_fixed_batch(backbone):
    from stability.robustness.fixed_batch import FixedBatch

    network, size = tiny(backbone)
    images = torch.rand(3, 1, size, size, dtype=torch.float64)
    exact = jacobian_norm(network, images, method="exact")
    torch.testing.assert_close(jacobian_norm_one_pass(network, images, 10), exact, rtol=1e-10, atol=0)
    padded = FixedBatch(network, 32)  # 30 rows and 2 zero images: one shape whatever the number of points
    torch.testing.assert_close(jacobian_norm_one_pass(padded, images, 10), exact, rtol=1e-10, atol=0)
    torch.testing.assert_close(jacobian_norm_one_pass(padded, images[:2], 10), exact[:2], rtol=1e-10, atol=0)
    split = FixedBatch(network, 8)  # 30 rows in four calls, a point's copies across two of them
    torch.testing.assert_close(jacobian_norm_one_pass(split, images, 10), exact, rtol=1e-10, atol=0)
    with pytest.raises(ValueError, match=r"the network gives \(10,\) outputs a point; num_logits=9"):
        jacobian_norm_one_pass(network, images, 9)


def test_excluding_the_patch_embedding_differentiates_from_its_output():
    network, size = tiny("vit")
    images = torch.rand(2, 1, size, size, dtype=torch.float64)
    embed = network.backbone.patch_embed
    with explicit_attention(network.backbone):
        tokens = embed((images - network.mean) / network.std)
        expected = []
        for i in range(2):
            def from_tokens(t, i=i):
                handle = embed.register_forward_hook(lambda m, a, o: t[None])
                try:
                    return network(images[i:i + 1])[0]
                finally:
                    handle.remove()
            jac = jacrev(from_tokens)(tokens[i])
            expected.append(torch.linalg.matrix_norm(jac.reshape(10, -1), ord=2))
    expected = torch.stack(expected)
    torch.testing.assert_close(jacobian_norm(network, images, method="exact", exclude_patch_embed=True), expected)
    torch.testing.assert_close(jacobian_norm(network, images, iterations=30, exclude_patch_embed=True), expected,
                               rtol=1e-3, atol=0)


@pytest.mark.parametrize("backbone", ["vit", "cswin"])
def test_empirical_lower_bound_never_exceeds_the_local_estimate(backbone):
    network, size = tiny(backbone, stabilizer="lipsformer")
    images = torch.rand(4, 1, size, size, dtype=torch.float64)
    upper = jacobian_norm(network, images, method="exact")
    lower = empirical_lower_bound(network, images, radius=1e-3, steps=10)
    assert (lower > 0).all()
    assert (lower <= upper * 1.01).all()  # a tiny ball: the ratio is ≈ a directional derivative ≤ ‖J‖
    assert (lower >= 0.5 * upper).all()  # and gradient ascent finds most of it


def test_bad_method():
    network, size = tiny("vit")
    with pytest.raises(ValueError, match="method must be 'power', 'exact' or 'auto', got 'svd'"):
        jacobian_norm(network, torch.rand(1, 1, size, size, dtype=torch.float64), method="svd")


def test_auto_takes_the_exact_norm_up_to_two_logits_per_power_iteration_and_power_iteration_beyond():
    assert [local_method("auto", k, 10) for k in (1, 10, 20, 21, 100)] == ["exact"] * 3 + ["power"] * 2
    assert local_method("power", 10, 10) == "power" and local_method("exact", 1000, 1) == "exact"
    network, size = tiny("vit")  # 10 logits
    images = torch.rand(3, 1, size, size, dtype=torch.float64)
    exact = jacobian_norm(network, images, method="exact")
    assert torch.equal(jacobian_norm(network, images, iterations=5, method="auto"), exact)  # 10 <= 2 * 5
    power = jacobian_norm(network, images, iterations=4, seed=3)
    assert not torch.allclose(power, exact, rtol=1e-10, atol=0)  # four iterations have not converged: distinguishable
    assert torch.equal(jacobian_norm(network, images, iterations=4, method="auto", seed=3), power)  # 10 > 2 * 4
