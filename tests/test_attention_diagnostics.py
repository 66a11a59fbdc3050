"""Attention diagnostics: g₁ against the exact softmax-Jacobian norm, Theorem 3 against jacrev."""
import pytest
import torch
from torch.func import jacrev

from stability.classifier import ImageClassifier
from stability.lipschitz.attention import attention_diagnostics, head_statistics, point_statistics, pool
from stability.models import attention_sites
from stability.nn.softmax_bounds import g_k, softmax_jacobian, softmax_jacobian_norm


def test_g1_bounds_the_sampled_exact_norms_row_by_row():
    p = torch.softmax(torch.randn(3, 2, 6, 6) * 4, dim=-1)  # 3 images, 2 heads, 6 rows each
    stats = head_statistics(p, batch=3, sample_rows=4)
    rows = p[:, :, :4]  # the first 4 rows of each image
    exact = torch.linalg.matrix_norm(softmax_jacobian(rows.double()), ord=2)  # (3, 2, 4)
    assert (g_k(rows.double(), 1) >= exact - 1e-12).all()
    torch.testing.assert_close(stats["softmax_jac_max"], exact.amax(-1).float())
    assert stats["g1_mean"].shape == (3, 2) and stats["g1_rows"].shape == (3, 2, 6)
    assert (stats["g1_sample_max"] >= stats["softmax_jac_max"] - 1e-6).all()


def test_the_eigenvalue_norm_equals_the_svd_norm_and_a_wrong_one_is_caught():
    """The diagnostics take ‖diag(p) − ppᵀ‖₂ as the largest eigenvalue (the matrix is PSD): equal to the SVD's to
    1e-12 relative on peaked and flat rows; the smallest eigenvalue in its place (a planted error) is far off."""
    gen = torch.Generator().manual_seed(0)
    for scale in (0.1, 3.0, 30.0):
        p = torch.softmax(scale * torch.randn(4, 3, 8, 17, generator=gen, dtype=torch.float64), dim=-1)
        reference = torch.linalg.matrix_norm(softmax_jacobian(p), ord=2)
        torch.testing.assert_close(softmax_jacobian_norm(p), reference, rtol=1e-12, atol=1e-15)
        planted = torch.linalg.eigvalsh(softmax_jacobian(p))[..., 0]
        assert not torch.allclose(planted, reference, rtol=1e-3)


def test_windows_of_an_image_pool_into_that_image():
    p = torch.softmax(torch.randn(2 * 4, 2, 5, 5), dim=-1)  # 2 images × 4 windows, 2 heads
    stats = head_statistics(p, batch=2, sample_rows=3)
    per_image = p.view(2, 4, 2, 5, 5)
    torch.testing.assert_close(stats["g1_max"][1], g_k(per_image[1], 1).amax(dim=(0, 2)))
    torch.testing.assert_close(stats["g1_mean"][0], g_k(per_image[0], 1).mean(dim=(0, 2)))


def test_pooled_diagnostics_do_not_depend_on_how_points_are_split():
    torch.manual_seed(0)
    module = ImageClassifier(backbone_options=dict(embed_dim=16, depth=1, num_heads=2, qkv_bias=False)).eval()
    images = torch.rand(6, 1, 8, 8)
    whole = point_statistics(module.network, images)
    parts = [point_statistics(module.network, images[i:i + 2]) for i in (0, 2, 4)]
    for layer, stats in whole.items():
        joined = pool({stat: torch.cat([part[layer][stat] for part in parts]) for stat in stats})
        for stat, value in pool(stats).items():
            torch.testing.assert_close(joined[stat], value, msg=stat)


@pytest.mark.parametrize("seed", range(3))
def test_theorem3_bounds_the_exact_head_jacobian(seed):
    torch.manual_seed(seed)
    module = ImageClassifier(backbone_options=dict(embed_dim=16, depth=1, num_heads=2, qkv_bias=False)).eval()
    with torch.no_grad():
        for site in attention_sites(module.network):
            site.qkv.weight.mul_(4.0)  # sharper attention, so the bound is not trivially loose
    image = torch.rand(1, 1, 8, 8)
    diagnostics = attention_diagnostics(module.network, image)
    site = attention_sites(module.network.backbone)[0]
    inputs = {}
    handle = site.module.register_forward_pre_hook(lambda m, args: inputs.setdefault("x", args[0].detach()))
    module.network(image)
    handle.remove()
    x = inputs["x"][0].double()  # (N, D)
    d = site.head_dim
    for h in range(site.num_heads):
        w_q, w_k, w_v = (site.head_weight(part, h).detach().double() for part in "qkv")

        def head(z, w_q=w_q, w_k=w_k, w_v=w_v):
            return torch.softmax((z @ w_q.T) @ (z @ w_k.T).T / d ** 0.5, dim=-1) @ (z @ w_v.T)

        exact = torch.linalg.matrix_norm(jacrev(head)(x).reshape(x.shape[0] * d, -1), ord=2)
        assert float(exact) <= float(diagnostics[site.name]["theorem3_max"][h]) * (1 + 1e-5)


def test_theorem3_is_absent_where_it_does_not_apply():
    module = ImageClassifier(backbone="cswin", image_size=16).eval()
    diagnostics = attention_diagnostics(module.network, torch.rand(2, 1, 16, 16))
    assert all("theorem3_max" not in stats for stats in diagnostics.values())
    assert all(stats["g1_mean"].shape == (attention_sites(module.network)[i].num_heads,)
               for i, stats in enumerate(diagnostics.values()))
