"""The block power iteration compiled (``--model.compile``): one graph, the eager step's bases, σ's and vectors."""
import copy

import pytest
import torch

from stability.nn.spectral import SubspaceIteration


def test_a_compiled_subspace_step_is_the_eager_one_step_by_step_in_one_graph(counted_compile):
    """float64 matrices of two shapes, moved between steps: the compiled step (traced by Dynamo and AOT autograd,
    fullgraph) writes the eager bases back and returns the eager σ, u, v at every step, compiling once."""
    generator = torch.Generator().manual_seed(0)
    shapes = [(12, 16), (12, 16), (16, 8)]
    homes = [torch.nn.Module() for _ in shapes]
    eager = SubspaceIteration([(m, "p") for m in homes], shapes, block=4)
    twin_homes = copy.deepcopy(homes)
    compiled = SubspaceIteration([(m, "p") for m in twin_homes], shapes, block=4)
    for module in homes + twin_homes:
        module.double()
    compiled.compile()
    matrices = [torch.randn(*shape, generator=generator, dtype=torch.float64) for shape in shapes]
    for _ in range(3):
        used = matrices
        ours, theirs = eager.step(matrices, 2), compiled.step(matrices, 2)
        for a, b in zip(ours, theirs):
            assert a.indices == b.indices
            for x, y in ((a.weight, b.weight), (a.sigma, b.sigma), (a.u, b.u), (a.v, b.v)):
                torch.testing.assert_close(y, x, rtol=1e-12, atol=1e-14)
        for i in range(len(shapes)):
            torch.testing.assert_close(compiled.basis(i), eager.basis(i), rtol=1e-12, atol=1e-14)
        matrices = [m + 0.1 * torch.randn(m.shape, generator=generator, dtype=torch.float64) for m in matrices]
    assert counted_compile.frame_count == 1
    exact = torch.linalg.matrix_norm(torch.stack(used[:2]), ord=2)
    assert (ours[0].sigma <= exact * (1 + 1e-12)).all()  # a Ritz value: a lower bound


def test_the_projections_power_iteration_trains_compiled_to_the_eager_weights(counted_compile):
    """``--model.compile true`` compiles the power iteration of spectral_norm's projection (and Muon's, and the
    certified losses' bound): three training steps, each projected, give the eager run's weights."""
    from stability.classifier import ImageClassifier

    modules = []
    for compile in (False, True):
        torch.manual_seed(0)
        modules.append(ImageClassifier(image_size=8, backbone_options=dict(embed_dim=16, depth=1, num_heads=2),
                                       stabilizer="spectral_norm", compile=compile).train())
    eager, compiled = modules
    assert compiled.stabilizers[0]._power.compiled and not eager.stabilizers[0]._power.compiled
    images, labels = torch.rand(8, 1, 8, 8), torch.randint(0, 10, (8,))
    optimizers = [module.build_optimizer() for module in modules]
    for _ in range(3):
        for module, optimizer in zip(modules, optimizers):
            optimizer.zero_grad()
            _, terms = module.losses(images, labels)
            sum(terms.values()).backward()
            optimizer.step()
            module.after_optimizer_step(0)
    for a, b in zip(eager.network.parameters(), compiled.network.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert compiled.stabilizers[0]._power._compiled_step is not None  # the projection did take the compiled step
    assert eager.stabilizers[0]._power._compiled_step is None


@pytest.mark.gpu
def test_inductor_compiles_the_subspace_step_on_the_gpu_to_the_eager_one():
    """The default backend's kernels on CUDA (Cholesky and the triangular solve inside the graph, the new bases
    written back after it), IEEE float32: three steps give the eager bases, σ, u and v to float32 rounding."""
    generator = torch.Generator().manual_seed(0)
    shapes = [(48, 64), (48, 64), (64, 32)]
    homes = [torch.nn.Module() for _ in shapes]
    eager = SubspaceIteration([(m, "p") for m in homes], shapes)
    twin_homes = copy.deepcopy(homes)
    compiled = SubspaceIteration([(m, "p") for m in twin_homes], shapes)
    for module in homes + twin_homes:
        module.cuda()
    torch._dynamo.reset()
    compiled.compile()
    matrices = [torch.randn(*shape, generator=generator).cuda() for shape in shapes]
    for _ in range(3):
        for a, b in zip(eager.step(matrices, 1), compiled.step(matrices, 1)):
            for x, y in ((a.sigma, b.sigma), (a.u, b.u), (a.v, b.v)):
                torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-5)
        for i in range(len(shapes)):
            torch.testing.assert_close(compiled.basis(i), eager.basis(i), rtol=1e-4, atol=1e-5)
        matrices = [m + 0.1 * torch.randn(m.shape, generator=generator).cuda() for m in matrices]
    assert compiled._compiled_step is not None
    torch._dynamo.reset()
