"""Specformer: persistent power iteration against exact σ₁, gradient against autograd through SVD."""
import pytest
import torch

from stability.classifier import ImageClassifier
from stability.models import attention_sites, build_backbone
from stability.nn.spectral import power_iteration, sigma_from_vectors
from stability.stabilizers.specformer import Specformer, head_blocks

VIT = dict(embed_dim=16, depth=2, num_heads=2)


def test_power_iteration_converges_to_the_exact_spectral_norm():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(5, 8, 16, generator=gen, dtype=torch.float64)
    u = torch.nn.functional.normalize(torch.randn(5, 8, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.nn.functional.normalize(torch.randn(5, 16, generator=gen, dtype=torch.float64), dim=-1)
    u, v = power_iteration(w, u, v, iterations=200)
    torch.testing.assert_close(sigma_from_vectors(w, u, v), torch.linalg.matrix_norm(w, ord=2))


@pytest.mark.parametrize("blocks", ["rows", "columns"])
def test_head_blocks_are_the_documented_slices(blocks):
    net = build_backbone("vit", img_size=8, in_chans=1, num_classes=3, **VIT)
    site = attention_sites(net)[0]
    w = head_blocks(site.qkv.weight, "k", 2, blocks)
    if blocks == "rows":
        assert torch.equal(w[1], site.head_weight("k", 1))
    else:
        k_weight = site.qkv.weight[16:32]
        assert torch.equal(w[1], k_weight[:, 8:16])


def test_penalty_gradient_matches_autograd_through_exact_sigma():
    net = build_backbone("vit", img_size=8, in_chans=1, num_classes=3, **VIT).double()
    spec = Specformer(lam_q=0.3, lam_k=0.2, lam_v=0.1, iterations=1)
    spec.prepare(net)
    net.double()
    for _ in range(300):  # persistent vectors converge over "training steps"
        with torch.no_grad():
            spec.sigmas(net, update=True)
    net.zero_grad()
    spec.penalty(net, update=False).backward()
    ours = [s.qkv.weight.grad.clone() for s in attention_sites(net)]
    net.zero_grad()
    exact = 0.0
    for site in attention_sites(net):
        for part, lam in zip("qkv", (0.3, 0.2, 0.1)):
            blocks = head_blocks(site.qkv.weight, part, 2, "rows")
            exact = exact + lam * torch.linalg.matrix_norm(blocks, ord=2).pow(2).sum()
    exact.backward()
    for got, site in zip(ours, attention_sites(net)):
        torch.testing.assert_close(got, site.qkv.weight.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(spec.penalty(net, update=False), exact.detach())


def test_vectors_live_in_the_state_dict_and_reload():
    module = ImageClassifier(backbone_options=VIT, stabilizer="specformer")
    keys = [k for k in module.state_dict() if "specformer_u_q" in k]
    assert len(keys) == 2
    module.stabilizers[0].sigmas(module.network, update=True)
    again = ImageClassifier(backbone_options=VIT, stabilizer="specformer")
    again.load_state_dict(module.state_dict())
    torch.testing.assert_close(again.state_dict()[keys[0]], module.state_dict()[keys[0]])


def test_bad_options():
    with pytest.raises(ValueError, match="lam_k must be >= 0"):
        Specformer(lam_k=-1)
    with pytest.raises(ValueError, match="blocks must be 'rows' or 'columns'"):
        Specformer(blocks="diag")


def test_the_compiled_penalty_is_the_eager_one_step_by_step_in_one_graph(counted_compile):
    """``--model.compile``: the power iteration, the σ's and the weighted sum as one graph (fullgraph: no break),
    compiled once, giving the eager penalty, its gradient and the same persistent vectors at every step (float64;
    traced by Dynamo and AOT autograd with a counting backend)."""
    import copy

    nets = [build_backbone("vit", img_size=8, in_chans=1, num_classes=3, **VIT).double()]
    nets.append(copy.deepcopy(nets[0]))
    specs = [Specformer(lam_q=0.3, lam_k=0.0, lam_v=0.1, iterations=2) for _ in nets]
    for spec, net in zip(specs, nets):
        spec.prepare(net)
        net.double()
    specs[1].compile_terms()
    optimizers = [torch.optim.SGD(net.parameters(), lr=0.5) for net in nets]
    for _ in range(3):  # the weights and vectors move: every step compares the same state
        values = []
        for spec, net, optimizer in zip(specs, nets, optimizers):
            optimizer.zero_grad()
            value = spec.penalty(net)
            value.backward()
            values.append(value.detach())
            optimizer.step()
        torch.testing.assert_close(values[1], values[0], rtol=1e-12, atol=0)
        for eager, compiled in zip(*(list(net.parameters()) + list(net.buffers()) for net in nets)):
            torch.testing.assert_close(compiled, eager, rtol=1e-12, atol=1e-15)
    assert counted_compile.frame_count == 1
