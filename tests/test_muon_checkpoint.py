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
                           stabilizer_options={"muon": {"constraint": "hard_cap", "layers": layers,
                                                        "update_scales": {"mlp": 0.5}}})


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
    # rewrite it as the old code saved it: one group per role scale (here two: the MLP's 0.5 and the rest's 1) in
    # first-seen order, each with its matrices in module order, learning rates without the shape factor
    network = first.network
    grouping = first.stabilizers[1]._grouping(network)
    from stability.stabilizers.muon import constrained_matrices

    module_order = [name for name, _ in constrained_matrices(network, "hidden")]
    scale_of = {name: scale for scale, _, members in grouping for name, _ in members}
    scales = list(dict.fromkeys(scale_of[name] for name in module_order))
    old_order = [name for scale in scales for name in module_order if scale_of[name] == scale]
    new_flat = [name for _, _, members in grouping for name, _ in members]
    assert len(scales) == 2 and len(grouping) > len(scales) and new_flat != old_order  # the map is exercised
    old = copy.deepcopy(checkpoint)
    muon = old["optimizer_states"][0]["optimizers"][0]
    new_groups = muon["param_groups"]
    old_state = {old_order.index(name): muon["state"][j] for j, name in enumerate(new_flat) if j in muon["state"]}
    first_group = {scale: next(g for g, (s_, _, _) in zip(new_groups, grouping) if s_ == scale) for scale in scales}
    old_groups = []
    for scale in scales:
        group = first_group[scale]
        factor = group[LR_SHAPE_FACTOR]
        merged = {k: v for k, v in group.items() if k not in ("params", LR_SHAPE_FACTOR)}
        merged.update(params=[i for i, name in enumerate(old_order) if scale_of[name] == scale],
                      adjust_lr_fn="spectral_unclamped", lr=group["lr"] / factor,
                      initial_lr=group["initial_lr"] / factor)
        old_groups.append(merged)
    old["optimizer_states"][0]["optimizers"][0] = {"state": old_state, "param_groups": old_groups}
    scheduler = old["lr_schedulers"][0]
    for key in ("base_lrs", "_last_lr"):
        by_group = dict(zip((id(g) for g in new_groups), scheduler[key]))
        scheduler[key] = ([by_group[id(first_group[s])] / first_group[s][LR_SHAPE_FACTOR] for s in scales]
                          + scheduler[key][len(new_groups):])
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
