"""Task losses that replace the cross-entropy, against their formulas: the temperature-and-offset
cross-entropy of 1-Lipschitz classifiers (tau_ce)."""
import pytest
import torch
from torch import nn

from stability.classifier import ImageClassifier
from stability.stabilizers.tau_ce import TauCrossEntropy

VIT = dict(embed_dim=16, depth=1, num_heads=2)


@pytest.mark.parametrize("temperature, offset", [(1.0, 0.0), (8.0, 0.0), (16.0, 0.3)])
def test_tau_ce_is_its_formula_with_hard_and_soft_labels(temperature, offset):
    module = ImageClassifier(backbone_options=VIT, stabilizer="tau_ce", label_smoothing=0.0,
                             stabilizer_options={"tau_ce": {"temperature": temperature, "offset": offset}})
    images, labels = torch.rand(6, 1, 8, 8), torch.randint(0, 10, (6,))
    logits, terms = module.losses(images, labels)
    hard = nn.functional.one_hot(labels, 10).float()
    expected = -(torch.log_softmax(temperature * (logits - offset * hard), -1) * hard).sum(-1).mean() / temperature
    torch.testing.assert_close(terms["task"], expected)
    torch.testing.assert_close(terms["cross_entropy"], nn.functional.cross_entropy(logits, labels).detach())
    soft = torch.softmax(torch.randn(6, 10), -1)  # MixUp / CutMix labels
    _, terms = module.losses(images, soft)
    expected = -(torch.log_softmax(temperature * (logits - offset * soft), -1) * soft).sum(-1).mean() / temperature
    torch.testing.assert_close(terms["task"], expected)
    if temperature == 1.0 and offset == 0.0:  # the plain cross-entropy
        torch.testing.assert_close(terms["task"], nn.functional.cross_entropy(logits, soft))


def test_tau_ce_leaves_the_model_and_its_bound_alone_and_checks_its_options():
    plain = ImageClassifier(backbone_options=VIT, stabilizer="lipschitz_transformer")
    tau = ImageClassifier(backbone_options=VIT, stabilizer="lipschitz_transformer,tau_ce")
    tau.load_state_dict(plain.state_dict())
    x = torch.rand(2, 1, 8, 8)
    torch.testing.assert_close(tau(x), plain(x))
    assert tau.network.logit_scale == plain.network.logit_scale == 1.0
    with pytest.raises(ValueError, match="temperature > 0"):
        TauCrossEntropy(temperature=0)
    with pytest.raises(ValueError, match="each replace the task loss"):
        module = ImageClassifier(backbone_options=VIT, stabilizer="lipschitz_transformer,tau_ce,lipschitz_margin")
        module.losses(x, torch.tensor([1, 2]))
