"""Every run logs what its training cost in machine-independent units (stability/callbacks/cost.py): the matrix FLOPs
of a step — equal to torch's own FlopCounterMode on the same step — summed over the steps so far at every epoch end,
the step's time predicted on the reference GPU, and the validation metrics against the FLOPs spent."""
import lightning as L
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from stability import tags
from stability.callbacks import CostMeter
from stability.classifier import ImageClassifier
from stability.data import Digits
from stability.testing.gpu_model import FITTED, count, cuda_path

OPTIONS = dict(embed_dim=16, depth=1, num_heads=2)


def fit(tmp_path, stabilizer="none", epochs=2, enabled=True):
    L.seed_everything(0)
    module = ImageClassifier(image_size=8, backbone_options={**OPTIONS, "drop_rate": 0.1}, stabilizer=stabilizer)
    meter = CostMeter(enabled=enabled)
    logger = L.pytorch.loggers.TensorBoardLogger(str(tmp_path), name="", version="")
    trainer = L.Trainer(max_epochs=epochs, limit_train_batches=4, limit_val_batches=2, logger=logger,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[meter], log_every_n_steps=1)
    data = Digits(batch_size=32, random_crop=1)
    trainer.fit(module, data)
    return module, meter, data


def _attention(q, k, v, *args, out_shape=None, **kwargs):
    return sdpa_flop_count(q, k, v)


def _attention_backward(grad, q, k, v, *args, out_shape=None, **kwargs):
    return sdpa_backward_flop_count(grad, q, k, v)


# torch's formulas for its CUDA attention kernels, given to the CPU's (FlopCounterMode knows only the CUDA ones)
CPU_ATTENTION = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _attention,
                 torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _attention_backward}


def reference_step_flops(stabilizer="none") -> float:
    """torch's FlopCounterMode on the second step of the same module and batch (an independent count)."""
    L.seed_everything(0)
    module = ImageClassifier(image_size=8, backbone_options={**OPTIONS, "drop_rate": 0.1}, stabilizer=stabilizer)
    data = Digits(batch_size=32)
    data.setup()
    images, labels = next(iter(data.train_dataloader()))
    optimizer = module.build_optimizer()

    def step():
        optimizer.zero_grad()
        _, terms = module.losses(images, labels)
        sum(t for name, t in terms.items() if name != "cross_entropy").backward()
        optimizer.step()

    step()
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) as counter:
        step()
    return counter.get_total_flops()


def test_a_runs_step_flops_are_torchs_count_and_they_add_up_by_epoch(tmp_path, scalars):
    module, meter, _ = fit(tmp_path)
    assert meter.step_flops == pytest.approx(reference_step_flops(), rel=1e-9)
    per_step = scalars(tmp_path, tags.COST_STEP_GFLOPS)
    total = scalars(tmp_path, tags.COST_TRAIN_TFLOPS)
    assert per_step == pytest.approx([meter.step_flops / 1e9] * 2)
    assert total == pytest.approx([4 * meter.step_flops / 1e12, 8 * meter.step_flops / 1e12])  # 4 steps an epoch
    assert len(scalars(tmp_path, tags.by_gflop("val/acc"))) == 2


def test_the_gpu_prediction_is_the_models_on_the_gpu_path(tmp_path, scalars):
    """On the CPU the prediction counts a copy of the model stepped as a GPU steps it (fused AdamW): fewer launches
    than the CPU's own step (one AdamW launch for each parameter group where the CPU's loop launches several per
    parameter), and the logged seconds are the fitted model's for that count."""
    module, meter, data = fit(tmp_path, epochs=1)
    images, labels = next(iter(data.train_dataloader()))
    L.seed_everything(0)
    copy = ImageClassifier(image_size=8, backbone_options={**OPTIONS, "drop_rate": 0.1})
    with cuda_path(copy):
        optimizer = copy.build_optimizer()

        def step():
            optimizer.zero_grad(set_to_none=True)
            _, terms = copy.losses(images, labels)
            sum(t for name, t in terms.items() if name != "cross_entropy").backward()
            optimizer.step()

        step()
        on_gpu = count(step)
    assert on_gpu.ops["_fused_adamw_"] == len(optimizer.param_groups)  # one launch a group: decay and no decay
    assert meter.gpu_step_s == pytest.approx(FITTED["h200"].seconds(on_gpu), rel=0.02)  # same step, same counts
    assert scalars(tmp_path, tags.COST_GPU_TRAIN_S) == pytest.approx([4 * meter.gpu_step_s])


def test_counting_leaves_the_training_as_it_was(tmp_path):
    """The count steps a copy of the model mid-epoch (random crops and dropout drawn from the global streams): the
    weights after two epochs equal those of the same run without the count, bit for bit."""
    counted, _, _ = fit(tmp_path / "counted")
    plain, meter, _ = fit(tmp_path / "plain", enabled=False)
    assert meter.step_flops is None
    for (name, a), (_, b) in zip(counted.state_dict().items(), plain.state_dict().items()):
        assert torch.equal(a, b), name


def test_a_bad_gpu_model_is_refused_by_name():
    with pytest.raises(ValueError, match="--cost.gpu_model 'a100'"):
        CostMeter(gpu_model="a100")
