"""A Muon checkpoint saved before the parameter groups were split by shape factor resumes: rewritten into the old
layout (one group per role, torch's adjust_lr_fn 'spectral_unclamped', no shape factor), it ends a resumed run with
exactly the weights of a run resumed from the current layout; one that does not fit the network stops with one line
saying why."""
import copy

import lightning as L
import pytest
import torch

from stability.classifier import ImageClassifier
from stability.data import Digits
from stability.optim import LR_SHAPE_FACTOR
from stability.stabilizers.muon import IncompatibleCheckpoint

TINY = dict(embed_dim=16, depth=2, num_heads=2)  # MLP 16 → 32 → 16: fc2 is wide, its shape factor √½


def module(layers="hidden"):
    L.seed_everything(0)
    return ImageClassifier(backbone_options=TINY, stabilizer="lipschitz_transformer,muon",
                           stabilizer_options={"muon": {"constraint": "hard_cap", "layers": layers}})


def trainer(epochs, root):
    return L.Trainer(max_epochs=epochs, limit_train_batches=4, limit_val_batches=1, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                     default_root_dir=root, deterministic=True)


def test_a_checkpoint_of_the_old_layout_resumes_exactly(tmp_path):
    # the reference: two epochs, the checkpoint after the first
    first = module()
    t = trainer(1, tmp_path / "a")
    t.fit(first, Digits(batch_size=32))
    path = tmp_path / "new.ckpt"
    t.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    # rewrite it as the old code saved it: one group (one role scale), matrices in module order
    network = first.network
    muon_stab = first.stabilizers[1]
    grouping = muon_stab._grouping(network)
    from stability.stabilizers.muon import constrained_matrices

    module_order = [name for name, _ in constrained_matrices(network, "hidden")]
    new_flat = [name for _, _, members in grouping for name, _ in members]
    assert new_flat != module_order  # the split reorders the matrices: the map is exercised
    old = copy.deepcopy(checkpoint)
    muon = old["optimizer_states"][0]["optimizers"][0]
    new_groups = muon["param_groups"]
    old_state = {module_order.index(name): muon["state"][j] for j, name in enumerate(new_flat) if j in muon["state"]}
    merged = {k: v for k, v in new_groups[0].items() if k not in ("params", LR_SHAPE_FACTOR)}
    merged.update(params=list(range(len(module_order))), adjust_lr_fn="spectral_unclamped",
                  lr=new_groups[0]["lr"] / new_groups[0][LR_SHAPE_FACTOR],
                  initial_lr=new_groups[0]["initial_lr"] / new_groups[0][LR_SHAPE_FACTOR])
    old["optimizer_states"][0]["optimizers"][0] = {"state": old_state, "param_groups": [merged]}
    scheduler = old["lr_schedulers"][0]
    factors = [g[LR_SHAPE_FACTOR] for g in new_groups]
    for key in ("base_lrs", "_last_lr"):
        scheduler[key] = [scheduler[key][0] / factors[0]] + scheduler[key][len(new_groups):]
    old_path = tmp_path / "old.ckpt"
    torch.save(old, old_path)
    finals = []
    for ckpt in (path, old_path):
        resumed = module()
        trainer(2, tmp_path / ckpt.stem).fit(resumed, Digits(batch_size=32), ckpt_path=ckpt)
        finals.append(resumed.state_dict())
    for (name, a), b in zip(finals[0].items(), finals[1].values()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)


def test_a_muon_state_that_does_not_fit_the_network_stops_with_one_line(tmp_path):
    first = module()
    t = trainer(1, tmp_path)
    t.fit(first, Digits(batch_size=32))
    checkpoint = torch.load(t.checkpoint_callback.last_model_path or _save(t, tmp_path), weights_only=False)
    muon = checkpoint["optimizer_states"][0]["optimizers"][0]
    for group in muon["param_groups"]:
        group.pop(LR_SHAPE_FACTOR)
    muon["param_groups"][0]["params"] = muon["param_groups"][0]["params"][:-1]  # a matrix missing
    other = module(layers="all")
    with pytest.raises(IncompatibleCheckpoint, match="cannot resume here"):
        other.on_load_checkpoint(checkpoint)


def _save(t, tmp_path):
    path = tmp_path / "last.ckpt"
    t.save_checkpoint(path)
    return path
