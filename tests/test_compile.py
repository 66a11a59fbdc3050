"""``--model.compile true``: the network trains compiled by torch.compile with the numbers of the eager network,
checkpoints keep the plain network's keys, logging steps that hook into the forward run eagerly, and a stabilizer that
needs hooks on every step is refused by name with the reason."""
import pickle

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from stability.callbacks import TrainingStability
from stability.classifier import ImageClassifier
from stability.data import Digits

TINY = dict(embed_dim=16, depth=1, num_heads=2)


def fit(compile: bool, tmp_path) -> tuple[ImageClassifier, L.Trainer]:
    L.seed_everything(0)
    # SGD: AdamW's first step moves a parameter whose exact gradient is zero (the key biases) by ±lr with the sign of
    # its rounding noise, which differs between compiled and eager kernels (stability/testing/parity.py)
    module = ImageClassifier(backbone_options=TINY, stabilizer="qk_norm", compile=compile, optimizer="sgd", lr=0.05)
    trainer = L.Trainer(max_epochs=1, limit_train_batches=4, limit_val_batches=1, log_every_n_steps=2,
                        logger=TensorBoardLogger(tmp_path / str(compile)), enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        accelerator="cpu", devices=1, callbacks=[TrainingStability(log_every_n_steps=2)],
                        deterministic=True)
    trainer.fit(module, Digits(batch_size=32))
    return module, trainer


def test_a_compiled_fit_matches_the_eager_one_and_saves_plain_keys(tmp_path):
    """Four steps, two of them logging steps (eager, observed by the training-stability hooks), two compiled."""
    eager, _ = fit(False, tmp_path)
    torch._dynamo.reset()
    # torch._dynamo.reset() does not clear the global counters: the compiled graph ran if their count grew
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled, trainer = fit(True, tmp_path)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs  # the compiled graph ran
    assert compiled.__dict__["_compiled_network"] is not None and not compiled.eager_forward
    for (name, a), b in zip(eager.state_dict().items(), compiled.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6, msg=name)
    assert not [k for k in compiled.state_dict() if "_orig_mod" in k]
    path = tmp_path / "compiled.ckpt"
    trainer.save_checkpoint(path)
    assert not [k for k in torch.load(path, weights_only=False)["state_dict"] if "_orig_mod" in k]
    assert "stability/attn_logit_max/blocks.0.attn" in trainer.callback_metrics  # observed on a logging step


def test_a_stabilizer_that_hooks_every_step_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="jasmin cannot train compiled: its materialised attention maps"):
        ImageClassifier(backbone_options=TINY, stabilizer="jasmin", compile=True,
                        stabilizer_options={"jasmin": {"row_statistics": "materialized"}})
    with pytest.raises(ValueError, match="jasmin cannot train compiled"):  # Swin: no streamed statistics
        ImageClassifier(backbone="swin", stabilizer="jasmin", compile=True)
    ImageClassifier(backbone_options=TINY, stabilizer="jasmin", compile=True,
                    stabilizer_options={"jasmin": {"row_statistics": "materialized", "lam": 0.0}})  # λ = 0: no hooks


def jasmin_steps(compile: bool) -> ImageClassifier:
    """Three SGD steps of a tiny ViT with JaSMin (streamed: what it takes compiled), on batches of 16, 16 and 7."""
    L.seed_everything(0)
    module = ImageClassifier(backbone_options=TINY, stabilizer="jasmin", compile=compile, optimizer="sgd", lr=0.05,
                             stabilizer_options={"jasmin": {"row_statistics": "auto" if compile else "streamed",
                                                            "lam": 0.1, "k": 0}}).train()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.05)
    data = Digits()
    data.setup()
    images, labels = data.train_set.tensors
    for start, stop in ((0, 16), (16, 32), (32, 39)):
        optimizer.zero_grad()
        _, terms = module.losses(images[start:stop], labels[start:stop])
        assert terms["jasmin"].isfinite()
        sum(terms.values()).backward()
        optimizer.step()
    return module


def test_jasmin_trains_compiled_with_the_eager_numbers():
    """JaSMin's streamed statistics read the queries and keys that the compiled graph returns (no hooks added per
    step) and run as a compiled graph of their own: after three steps, every weight equals the eager run's (whose
    statistics take the other backward); both graphs ran, each once for both sizes."""
    eager = jasmin_steps(False)
    torch._dynamo.reset()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled = jasmin_steps(True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 2  # ran, and took the batch of 7
    jasmin = next(s for s in compiled.stabilizers if s.name == "jasmin")
    assert jasmin.streamed and not jasmin.needs_attention_probs  # on the CPU too, where auto materialises eager
    for (name, a), b in zip(eager.state_dict().items(), compiled.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6, msg=name)
    L.seed_everything(0)
    initial = ImageClassifier(backbone_options=TINY, stabilizer="jasmin").state_dict()
    assert max((a - b).abs().max() for a, b in zip(eager.state_dict().values(), initial.values())) > 1e-3  # moved
    pickle.loads(pickle.dumps(compiled.network))  # the capture's hooks stay on the network: they pickle


def test_the_compiled_network_compiles_once_for_every_batch_size():
    """An epoch's last batch is smaller: the compiled network's graph takes it without a second compilation."""
    torch._dynamo.reset()
    module = ImageClassifier(backbone_options=TINY, compile=True).train()
    images = torch.rand(9, 1, 8, 8)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for batch in (8, 5, 3):
        module.losses(images[:batch], torch.zeros(batch, dtype=torch.long))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 1


def test_the_compile_mode_reaches_torch_compile_and_marks_each_graph_step(monkeypatch):
    """``compile_mode`` is torch.compile's ``mode``; with one that captures CUDA graphs each compiled training step
    first tells torch a new step begins (the previous step's graph outputs may then be reused); bad values are refused
    by name."""
    seen, steps = {}, []

    def recording(model, **kwargs):
        seen.update(kwargs)
        return model

    monkeypatch.setattr(torch, "compile", recording)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: steps.append(1))
    images = torch.rand(4, 1, 8, 8)
    for mode, marks in (("reduce-overhead", 1), ("max-autotune-no-cudagraphs", 0), ("default", 0)):
        module = ImageClassifier(backbone_options=TINY, compile=True, compile_mode=mode)
        assert seen["mode"] == mode
        steps.clear()
        module._training_network(images)
        assert len(steps) == marks, mode
    with pytest.raises(ValueError, match=r"compile_mode must be one of \['default', 'reduce-overhead'"):
        ImageClassifier(backbone_options=TINY, compile=True, compile_mode="fast")
    with pytest.raises(ValueError, match="compile_mode 'reduce-overhead' needs --model.compile true"):
        ImageClassifier(backbone_options=TINY, compile_mode="reduce-overhead")


def test_a_fit_with_a_compile_mode_runs_its_callbacks(monkeypatch, tmp_path, tiny_vit_args, capsys):
    """The cost meter counts an eager copy of the module: it must not carry the compile mode without compiling; graph
    modes refuse gradient accumulation by name."""
    import os

    from stability.cli import main

    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: model)
    os.chdir(tmp_path)
    main(["fit", *tiny_vit_args, "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2",
          "--lipschitz.every_n_epochs", "0", "--robustness.every_n_epochs", "0", "--model.compile", "true",
          "--model.compile_mode", "reduce-overhead"])
    assert list(tmp_path.rglob("last.ckpt"))

    with pytest.raises(SystemExit):
        main(["fit", *tiny_vit_args, "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2",
              "--trainer.accumulate_grad_batches", "2", "--model.compile", "true", "--model.compile_mode",
              "reduce-overhead"])
    assert "accumulate_grad_batches 2 keeps between steps" in capsys.readouterr().err


COMPILED_CASES = [  # (backbone, image size, options, stabilizers): every stabilizer that compiles, each backbone
    *[("vit", 8, TINY, [name]) for name in
      ("none", "qk_norm", "softcap", "lipsformer", "jasmin", "sigma_reparam", "specformer", "spectral_norm", "muon",
       "z_loss", "tau_ce", "lipschitz_transformer")],
    *[("vit", 8, TINY, ["lipschitz_transformer", "muon", loss]) for loss in ("gloro", "emma", "lipschitz_margin")],
    ("hybrid", 8, {}, ["lipschitz_transformer", "muon", "gloro"]),
    ("lipcnn", 8, {}, ["gloro"]),
    ("swin", 16, {}, ["qk_norm"]), ("swin", 16, {}, ["sigma_reparam"]),
    ("cswin", 16, {}, ["none"]), ("cswin", 16, {}, ["lipsformer"]),
]


@pytest.mark.parametrize("backbone, size, options, stabilizers", COMPILED_CASES,
                         ids=[f"{c[0]}-{'+'.join(c[3])}" for c in COMPILED_CASES])
def test_a_compiled_training_step_has_no_graph_break_and_one_graph_for_every_batch_size(
        monkeypatch, backbone, size, options, stabilizers):
    """Each function a compiled training step compiles (the network; the certified losses' bound composition) is
    compiled once, without a graph break, for batches of 32, 17, 10 and 3 (an epoch's last batch, a measurement's):
    Dynamo's decisions, traced here with a counting backend that skips Inductor's code generation. Exception, on the
    CPU only: the AOL convolutions of the hybrid and the anchor compile once more across a batch of 16 (torch's CPU
    convolution choice reads the batch size; a GPU's does not). (Before LePE's taps, CSwin compiled again for a batch of
    5; a planted graph break fails here.)"""
    from torch._dynamo.testing import CompileCounter

    real_compile = torch.compile
    counters, after_the_step = [], []

    def traced(model, mode=None, **options):  # the bound's composition asks for fullgraph=True, dynamic=False
        counter = CompileCounter()
        # Muon's constraint runs after the optimizer's step, not in these losses (tests/test_muon.py counts it)
        (after_the_step if getattr(model, "__name__", "") in ("_constrain", "_cap_all") else counters).append(counter)
        return real_compile(model, backend=counter, **options)

    monkeypatch.setattr(torch, "compile", traced)
    torch._dynamo.reset()
    breaks = dict(torch._dynamo.utils.counters["graph_break"])
    torch.manual_seed(0)
    module = ImageClassifier(backbone=backbone, image_size=size, backbone_options=options, stabilizer=stabilizers,
                             compile=True).train()
    images = torch.rand(32, 1, size, size)
    for batch in (32, 17, 10, 3):
        _, terms = module.losses(images[:batch], torch.zeros(batch, dtype=torch.long))
        sum(terms.values()).backward()
    assert dict(torch._dynamo.utils.counters["graph_break"]) == breaks
    network, *others = [counter.frame_count for counter in counters]
    assert network == (2 if backbone in ("hybrid", "lipcnn") else 1)
    assert others == [1] * len(others)
