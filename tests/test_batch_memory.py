"""Batches sized by memory (``--robustness.autoattack_batch_size memory``, ``--robustness.batch_size memory``,
``--lipschitz.batch_size memory``): the bytes a pass saves are counted right (against a count by hand), they and the
Lipschitz estimates' are affine in the batch (so two counts give every batch), the batch chosen is the largest whose
estimate fits the share of memory, and the monitors take the options end to end with the numbers of the same size set
by hand."""
import json
import os

import pytest
import torch

from stability.callbacks.lipschitz_monitor import COPIES, LipschitzMonitor
from stability.callbacks.robustness_monitor import RobustnessMonitor
from stability.classifier import ImageClassifier
from stability.cli import main
from stability.models import Network
from stability.models.lipconvnet import LipConvNet
from stability.robustness import batch_memory
from stability.robustness.attacks import AttackSettings, AttackSpec
from stability.robustness.batch_memory import TRANSIENT_FACTOR, memory_sized_batch, pass_bytes, saved_bytes, unit_bytes
from stability.testing.profiling import saved_for_backward


def mlp(d: int = 64, h: int = 32, c: int = 10) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(d, h), torch.nn.ReLU(), torch.nn.Linear(h, c))


@pytest.fixture
def tiny_vit() -> torch.nn.Module:
    torch.manual_seed(0)
    return ImageClassifier(backbone_options=dict(embed_dim=16, depth=1, num_heads=2)).network


def points(n: int, shape=(1, 8, 8), classes: int = 10):
    gen = torch.Generator().manual_seed(n)
    return torch.rand(n, *shape, generator=gen), torch.randint(classes, (n,), generator=gen)


def test_a_pass_saves_what_the_network_needs_for_its_backward_counted_by_hand():
    """Flatten → Linear(64, 32) → ReLU → Linear(32, 10) → cross-entropy, the input's and the weights' gradients
    allowed: per point the input (64 floats), the ReLU's output (32; the second layer's input is the same storage),
    the log-softmax (10) and the label (one int64); once, the two weight matrices and the loss's total weight (a
    float32 scalar)."""
    network = mlp()
    per_point, fixed = pass_bytes(network, *points(4))
    assert per_point == 4 * (64 + 32 + 10) + 8
    assert fixed == 4 * (64 * 32 + 32 * 10) + 4


@pytest.mark.parametrize("model", ["mlp", "vit", "lipconvnet"])
def test_the_count_is_affine_in_the_batch(model, tiny_vit):
    network = {"mlp": mlp, "vit": lambda: tiny_vit, "lipconvnet": lambda: LipConvNet(
        8, 1, 10, convs=((4, 3, 1), (4, 4, 2)), dense=(16,))}[model]()
    per_point, fixed = pass_bytes(network, *points(4))
    assert per_point > 0
    for n in (1, 3, 7):
        images, labels = points(n)
        assert saved_bytes(network, images, labels) == fixed + n * per_point, n


@pytest.mark.parametrize("model", ["vit", "lipconvnet"])
def test_the_lipschitz_measurements_counts_are_affine_in_the_batch(model, tiny_vit):
    """Each of the Lipschitz measurements' units of work (a local estimate keeps a differentiable vector–Jacobian
    product's graph beside the network's; an ascent step is a pass) saves bytes affine in the batch, and a local
    estimate more than an attack's pass a point. At one point the ViT's estimate saves 2% more than the line
    (another kernel path at batch 1): a batch that memory sizes is never one point but where one is all that fits."""
    network = {"vit": lambda: tiny_vit, "lipconvnet": lambda: Network(LipConvNet(
        8, 1, 10, convs=((4, 3, 1), (4, 4, 2)), dense=(16,)), [0.5], [0.5])}[model]()
    local, ascent_step = LipschitzMonitor()._units(network)
    for unit in (local, ascent_step):
        def count(x, _, unit=unit):
            return saved_for_backward(lambda: unit(x))

        per_point, fixed = unit_bytes(count, *points(4))
        assert per_point > 0
        for n in (3, 7, 16):
            assert count(*points(n)) == fixed + n * per_point, (unit.__name__, n)
        assert count(*points(1)) == pytest.approx(fixed + per_point, rel=0.03)
    assert unit_bytes(lambda x, _: saved_for_backward(lambda: local(x)), *points(4))[0] > \
        pass_bytes(network, *points(4))[0]


def test_the_batch_is_the_largest_whose_estimate_fits():
    network, (images, labels) = mlp(), points(4)
    per_image = images[0].numel() * images.element_size()

    def estimate(b: int) -> int:  # counted afresh at b points, not from the two counts the function makes
        x, y = images[torch.arange(b) % 4], labels[torch.arange(b) % 4]
        return TRANSIENT_FACTOR * saved_bytes(network, x, y) + (16 + 10) * b * per_image

    memory = 2 * estimate(37) + 1000  # half of it holds 37 points, not 38
    size = memory_sized_batch(network, images, labels, 10_000, 10, memory)
    assert size == 37 and estimate(size) <= memory / 2 < estimate(size + 1)
    assert memory_sized_batch(network, images, labels, 20, 10, memory) == 20  # never more than the points
    assert memory_sized_batch(network, images, labels, 20, 10, 100) == 1  # at least one
    with pytest.raises(ValueError, match="share must be in"):
        memory_sized_batch(network, images, labels, 20, 10, memory, share=0)


def test_the_device_memory_is_the_machines():
    assert batch_memory.device_memory("cpu") > 2 ** 28


def test_bad_autoattack_batch_sizes_are_refused():
    assert RobustnessMonitor(autoattack_batch_size="memory").autoattack_batch_size == "memory"
    for bad in (0, "maybe"):
        with pytest.raises(ValueError, match="autoattack_batch_size must be >= 1, 'memory'"):
            RobustnessMonitor(autoattack_batch_size=bad)


def test_bad_batch_sizes_are_refused():
    assert RobustnessMonitor(batch_size="memory").batch_size == "memory"
    assert RobustnessMonitor(batch_size="memory").autoattack_batch_size == "memory"  # AutoAttack follows
    for bad in (0, "maybe"):
        with pytest.raises(ValueError, match="batch_size must be >= 1 or 'memory'"):
            RobustnessMonitor(batch_size=bad)


def test_every_measurement_sized_by_memory_gives_the_numbers_of_the_same_size_set(tmp_path, tiny_vit_args, caplog):
    """``--robustness.batch_size memory``: clean, certified, FGSM and PGD take all 8 points at once, and the numbers
    are those of ``--robustness.batch_size 8``: the same points and seeds."""
    os.chdir(tmp_path)
    caplog.set_level("INFO")
    measure = ["--robustness.test_num_points", "8", "--robustness.test_attacks", "[fgsm, pgd]",
               "--robustness.pgd_steps", "2", "--lipschitz.every_n_epochs", "0", "--robustness.eps", "[0.03]"]
    main(["fit", *tiny_vit_args, "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "3",
          "--robustness.every_n_epochs", "1", "--robustness.num_points", "8", "--robustness.attacks", "[]",
          "--test_after_fit", "true", "--run_dir", "run", "--robustness.batch_size", "memory", *measure])
    results = tmp_path / "run" / "checkpoints" / "results.json"
    sized = json.loads(results.read_text())["robustness"]
    assert sized["batch_size"] == 8
    assert "the measurements and attacks take 8 points at once (--robustness.batch_size memory" in caplog.text
    main(["test", *tiny_vit_args, "--ckpt_path", str(results.parent / "last.ckpt"), "--robustness.batch_size", "8",
          *measure])
    set_by_hand = json.loads(results.read_text())["robustness"]
    assert set_by_hand["batch_size"] == 8
    assert set_by_hand["accuracy"] == sized["accuracy"] and set_by_hand["certified"] == sized["certified"]


def fake_trainer(world: int = 1, broadcast: list | None = None):
    from types import SimpleNamespace

    said = [] if broadcast is None else broadcast
    return SimpleNamespace(is_global_zero=True, num_devices=world, world_size=world, strategy=SimpleNamespace(
        broadcast=lambda value, src: said.append(value) or value))


def by_hand(counts: list[tuple[int, int]], copies: int, points: int, memory: int) -> int:
    """⌊(memory/2 − 2·max fixed) / (2·max per point + copies)⌋ in [1, points], from (per point, fixed) counts made
    in the test."""
    per_point, fixed = max(c[0] for c in counts), max(c[1] for c in counts)
    return max(1, min(points, int((memory / 2 - 2 * fixed) // (2 * per_point + copies))))


def two_counts(count) -> tuple[int, int]:
    """(per point, fixed) from counts at 2 and 4 points, as by hand."""
    c2, c4 = count(*repeat(2)), count(*repeat(4))
    per_point = (c4 - c2) // 2
    return per_point, c2 - 2 * per_point


def repeat(n: int):
    images, labels = points(4)
    index = torch.arange(n) % 4
    return images[index], labels[index]


def test_the_measurements_batch_is_the_formulas_strictly_inside_the_points(monkeypatch, tiny_vit):
    """With memory for a few points only, ``--robustness.batch_size memory`` gives the hand formula's batch over all
    the measured points (an attack's pass, or the certificate's float64 forward where larger), and AutoAttack, which
    follows it, the same formula over its own points; under DDP each process its share, sized by its share of the
    CPU's memory, decided once and broadcast."""
    import copy

    images, labels = points(64)
    dataset = torch.utils.data.TensorDataset(images, labels)
    exact = copy.deepcopy(tiny_vit).double()
    copies = (16 + 10) * images[0].numel() * 4
    passes = two_counts(lambda x, y: saved_bytes(tiny_vit, x, y))
    forward = two_counts(lambda x, y: batch_memory.float64_forward_bytes(exact, x, y))
    memory = 2 * (2 * max(passes[1], forward[1]) + 20 * (2 * max(passes[0], forward[0]) + copies)) + 1000
    monkeypatch.setattr(batch_memory, "device_memory", lambda device: memory)
    settings = AttackSettings(10, 3, None, "standard", 0)
    monitor = RobustnessMonitor(batch_size="memory")
    size = monitor._measured_batch(fake_trainer(), tiny_vit, exact, dataset, 64, settings, "cpu", "test")
    assert size == by_hand([passes, forward], copies, 64, memory) == 20
    # once a run: the size depends on the architecture, so a second measurement takes it without counting again
    monkeypatch.setattr(batch_memory, "pass_bytes", None)
    assert monitor._measured_batch(fake_trainer(), tiny_vit, exact, dataset, 64, settings, "cpu", "test") == size
    monkeypatch.undo()
    monkeypatch.setattr(batch_memory, "device_memory", lambda device: memory)
    no_bound = RobustnessMonitor(batch_size="memory")._measured_batch(fake_trainer(), tiny_vit, None, dataset, 64,
                                                                     settings, "cpu", "test")
    assert no_bound == by_hand([passes], copies, 64, memory) >= size
    spec = AttackSpec("autoattack", "L2", 0.5)
    assert monitor._autoattack_batch(fake_trainer(), tiny_vit, dataset, [spec], {spec.label: 12}, settings, "cpu",
                                     "test", size) == 12  # its 12 points fit at once
    said: list = []
    shared = RobustnessMonitor(batch_size="memory")._measured_batch(fake_trainer(2, said), tiny_vit, exact, dataset,
                                                                   64, settings, "cpu", "test")
    assert shared == by_hand([passes, forward], copies, 32, memory // 2) and said == [shared]


def test_the_lipschitz_batch_is_the_formulas_strictly_inside_the_points(monkeypatch, tiny_vit):
    """``--lipschitz.batch_size memory`` with memory for a few points: the hand formula over the largest of a local
    estimate, an ascent step and (at test, with pairs) a pair step and the float64 evaluation, each counted here;
    under DDP each process its share, decided once and broadcast."""
    import copy

    from stability.lipschitz import jacobian_norm, jacobian_norm_one_pass
    from stability.lipschitz.pairs import margin_lower_bound
    from stability.robustness.attacks import evaluating, gradients_allowed

    images, labels = points(64)
    dataset = torch.utils.data.TensorDataset(images, labels)
    exact = copy.deepcopy(tiny_vit).double()

    def counted(step):
        def count(x, _):
            with gradients_allowed(), evaluating(tiny_vit), evaluating(exact):
                return saved_for_backward(lambda: step(x))
        return two_counts(count)

    local = counted(lambda x: jacobian_norm(tiny_vit, x, 1))
    ascent = two_counts(lambda x, _: saved_bytes(tiny_vit, x, torch.zeros(len(x), dtype=torch.long)))
    pair = counted(lambda x: margin_lower_bound(tiny_vit, x, 1))
    float64 = two_counts(lambda x, y: batch_memory.float64_forward_bytes(exact, x, y) +
                         batch_memory.float64_forward_bytes(exact, x.flip(0), y))
    copies = COPIES * images[0].numel() * 4
    largest = [local, ascent, pair, float64]
    memory = 2 * (2 * max(c[1] for c in largest) + 10 * (2 * max(c[0] for c in largest) + copies)) + 1000
    monkeypatch.setattr(batch_memory, "device_memory", lambda device: memory)
    monitor = LipschitzMonitor(batch_size="memory", pair_points=64)
    with_pairs = monitor._measured_batch(fake_trainer(), tiny_vit, exact, dataset, 64, "cpu", "test")
    assert with_pairs == by_hand(largest, copies, 64, memory) == 10
    without = LipschitzMonitor(batch_size="memory")._measured_batch(fake_trainer(), tiny_vit, None, dataset, 64,
                                                                    "cpu", "fit")
    assert without == by_hand([local, ascent], copies, 64, memory) >= with_pairs
    said: list = []
    shared = LipschitzMonitor(batch_size="memory")._measured_batch(fake_trainer(2, said), tiny_vit, None, dataset, 64,
                                                                   "cpu", "fit")
    assert shared == by_hand([local, ascent], copies, 32, memory // 2) and said == [shared]
    rows = (COPIES + 10) * images[0].numel() * 4  # the exact estimate's Jacobian: 10 input-sized rows a point more
    with_rows = LipschitzMonitor(batch_size="memory")._measured_batch(fake_trainer(), tiny_vit, None, dataset, 64,
                                                                      "cpu", "fit", exact_logits=10)
    assert with_rows == by_hand([local, ascent], rows, 64, memory) < without
    # compiled, the one pass's graph (10 copies of each point) is a unit too, beside 20 rows a point more
    one_pass = counted(lambda x: jacobian_norm_one_pass(tiny_vit, x, 10))
    compiled = LipschitzMonitor(batch_size="memory", compile=True)._measured_batch(
        fake_trainer(), tiny_vit, None, dataset, 64, "cpu", "fit", exact_logits=10)
    assert compiled == by_hand([local, ascent, one_pass], (COPIES + 20) * images[0].numel() * 4, 64, memory)
    assert compiled < with_rows
    assert [LipschitzMonitor(compile=c)._jacobian_rows(m, 10) for c in (False, True) for m in ("exact", "power")] == [
        10, 0, 20, 0]  # compiled, the one pass also keeps the point's 10 copies and their gradients


def test_bad_lipschitz_batch_sizes_are_refused():
    assert LipschitzMonitor(batch_size="memory").batch_size == "memory"
    for bad in (0, "maybe"):
        with pytest.raises(ValueError, match="batch_size must be >= 1 or 'memory'"):
            LipschitzMonitor(batch_size=bad)


def test_the_lipschitz_estimates_sized_by_memory_give_the_numbers_of_the_same_size_set(tmp_path, tiny_vit_args,
                                                                                      caplog):
    """``--lipschitz.batch_size memory`` takes all 8 test points at once, with the numbers of ``--lipschitz.batch_size
    8``: the same points and seeds."""
    os.chdir(tmp_path)
    caplog.set_level("INFO")
    measure = ["--lipschitz.test_num_points", "8", "--lipschitz.iterations", "3", "--lipschitz.attention_points", "4",
               "--robustness.every_n_epochs", "0"]
    main(["fit", *tiny_vit_args, "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "3",
          "--lipschitz.num_points", "8", "--test_after_fit", "true", "--run_dir", "run", "--lipschitz.batch_size",
          "memory", *measure])
    results = tmp_path / "run" / "checkpoints" / "results.json"
    sized = json.loads(results.read_text())["lipschitz"]
    assert sized["batch_size"] == 8 and "lipschitz (test): 8 points at once (--lipschitz.batch_size memory" \
        in caplog.text
    main(["test", *tiny_vit_args, "--ckpt_path", str(results.parent / "last.ckpt"), "--lipschitz.batch_size", "8",
          *measure])
    by_hand = json.loads(results.read_text())["lipschitz"]
    assert by_hand["batch_size"] == 8 and by_hand == sized


def test_the_monitor_sizes_autoattack_by_memory(tmp_path, tiny_vit_args, caplog):
    """A fit and its test with the official AutoAttack on 4 points, batch sized by memory: all 4 at once."""
    os.chdir(tmp_path)
    caplog.set_level("INFO")
    main(["fit", *tiny_vit_args, "--trainer.max_epochs", "1", "--lipschitz.every_n_epochs", "0",
          "--test_after_fit", "true", "--robustness.every_n_epochs", "1", "--robustness.num_points", "8",
          "--robustness.test_num_points", "8", "--robustness.attacks", "[]", "--robustness.test_attacks",
          "[autoattack]", "--robustness.autoattack_num_points", "4", "--robustness.batch_size", "2",
          "--robustness.autoattack_batch_size", "memory"])
    (path,) = tmp_path.rglob("results.json")
    robustness = json.loads(path.read_text())["robustness"]
    assert robustness["autoattack_batch_size"] == 4 and robustness["autoattack_points"] == 4
    assert "AutoAttack attacks 4 points at once" in caplog.text


@pytest.mark.gpu
def test_a_pass_on_the_gpu_stays_inside_its_estimate(tiny_vit):
    """The CUDA allocator's peak over a forward and backward pass at 256 points is at most the estimate."""
    device = torch.device("cuda")
    network = tiny_vit.to(device)
    images, labels = (t.to(device) for t in points(256))
    per_point, fixed = pass_bytes(network, images[:4], labels[:4])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    saved_bytes(network, images, labels)
    peak = torch.cuda.max_memory_allocated(device) - before
    assert peak <= TRANSIENT_FACTOR * (fixed + 256 * per_point)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["power", "exact"])
def test_a_local_estimate_on_the_gpu_stays_inside_its_estimate(tiny_vit, method):
    """The same for the Lipschitz measurements' largest unit, a local estimate (power iteration, which sizes the
    batch) at 256 points, with the input copies the monitor allows beside it, for either method (the exact one keeps
    its 10 Jacobian rows a point more)."""
    from stability.callbacks.lipschitz_monitor import COPIES, LipschitzMonitor

    device = torch.device("cuda")
    network = tiny_vit.to(device)
    images, labels = (t.to(device) for t in points(256))
    monitor = LipschitzMonitor(iterations=10, attention=False, method=method)
    local = monitor._units(network)[0]
    per_point, fixed = unit_bytes(lambda x, _: saved_for_backward(lambda: local(x)), images[:4], labels[:4])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    monitor.measure_points(network, 0, images)
    peak = torch.cuda.max_memory_allocated(device) - before
    rows = COPIES + monitor._jacobian_rows(method, 10)
    assert peak <= TRANSIENT_FACTOR * (fixed + 256 * per_point) + 256 * rows * images[0].numel() * 4


def test_the_cpus_memory_is_the_cgroups_limit_where_lower(tmp_path, monkeypatch):
    limit = tmp_path / "memory.max"
    monkeypatch.setattr(batch_memory, "CGROUP_LIMIT", limit)
    machine = batch_memory.device_memory("cpu")  # no file: the machine's
    limit.write_text("1073741824\n")
    assert batch_memory.device_memory("cpu") == min(machine, 2 ** 30)
    limit.write_text("max\n")
    assert batch_memory.device_memory("cpu") == machine


def test_under_ddp_each_process_gets_its_share_of_the_points_and_of_the_cpus_memory(monkeypatch, tiny_vit):
    """With 2 processes on one machine's CPU: at most half the points a batch (each process attacks), sized by half
    the memory; what rank 0 decides is broadcast."""
    from types import SimpleNamespace

    from stability.robustness.attacks import AttackSettings, AttackSpec

    images, labels = points(8)
    dataset = torch.utils.data.TensorDataset(images, labels)
    sized = []
    monkeypatch.setattr("stability.callbacks.robustness_monitor.memory_sized_batch",
                        lambda net, x, y, points, classes, memory, **_: sized.append((points, memory)) or points)
    monkeypatch.setattr(batch_memory, "device_memory", lambda device: 8 * 2 ** 30)
    broadcast = []
    trainer = SimpleNamespace(is_global_zero=True, num_devices=2, world_size=2, strategy=SimpleNamespace(
        broadcast=lambda value, src: broadcast.append(value) or value))
    monitor = RobustnessMonitor(autoattack_batch_size="memory")
    spec = AttackSpec("autoattack", "L2", 0.5)
    size = monitor._autoattack_batch(trainer, tiny_vit, dataset, [spec], {spec.label: 7},
                                     AttackSettings(10, 3, None, "standard", 0), "cpu", "test", 256)
    assert size == 4 and sized == [(4, 4 * 2 ** 30)] and broadcast == [4]
