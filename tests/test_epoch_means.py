"""Epoch means under DDP are exact and safe when the processes log different tags: a loss term that only one of two
processes (CPU, gloo) produces gets its mean over that process's samples, and the run neither hangs nor mixes tags
(one all-reduce per tag, in each process's own order, would pair different tags' sums or wait forever)."""
import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import json, sys
    import lightning as L
    import torch
    from stability.classifier import ImageClassifier
    from stability.data import Digits
    from stability.stabilizers import Stabilizer, register_stabilizer

    @register_stabilizer
    class SecondProcessOnly(Stabilizer):
        """A term of 2 on the second process only."""
        name = "second_process_only"

        def loss(self, step):
            if torch.distributed.get_rank() == 1:
                return step.logits.new_tensor(2.0)
            return None

    L.seed_everything(0)
    module = ImageClassifier(backbone_options=dict(embed_dim=16, depth=1, num_heads=2),
                             stabilizer="second_process_only")
    trainer = L.Trainer(strategy="ddp", devices=2, accelerator="cpu", max_epochs=1, limit_train_batches=4,
                        limit_val_batches=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, Digits(batch_size=16))
    if trainer.is_global_zero:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        json.dump(metrics, open(sys.argv[1], "w"))
    torch.distributed.destroy_process_group()  # as `stability` does: gloo left to the exit can abort the process
''')


def test_a_term_only_one_process_logs_gets_its_exact_mean_and_nothing_hangs(tmp_path):
    script = tmp_path / "fit.py"
    script.write_text(SCRIPT)
    out = tmp_path / "metrics.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script), str(out)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)  # 11 s here; a mismatched reduce hangs
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads(out.read_text())
    assert metrics["loss/second_process_only_epoch"] == 2.0  # over the second process's samples only
    assert metrics["loss/task_epoch"] > 0 and "train/loss_epoch" in metrics
