"""A long measurement says, after its batches, how far it is and re-estimates its end from the points it measured."""
import torch
from torch.utils.data import TensorDataset

from stability.callbacks.measuring import Session
from stability.callbacks.points import measure_batches


def test_each_batch_but_the_last_says_the_points_done_and_the_rest(caplog, tmp_path):
    caplog.set_level("INFO")
    dataset = TensorDataset(torch.rand(10, 1, 4, 4), torch.arange(10) % 3)
    seen = []
    session = Session("robustness (test)", store=tmp_path / "kept", progress_every_s=0.0)  # a line every batch
    out = measure_batches(dataset, 10, 4, torch.device("cpu"), lambda i, x, y: seen.append(i) or {"n": y.clone()},
                          session, "pgd_Linf_2/255")
    assert seen == [0, 1, 2] and torch.equal(torch.cat([o["n"] for o in out]), torch.arange(10) % 3)
    lines = [r.getMessage() for r in caplog.records if "robustness (test): pgd_Linf_2/255: " in r.getMessage()]
    assert [line.split(" points in ")[0] for line in lines] == ["robustness (test): pgd_Linf_2/255: 4 of 10",
                                                               "robustness (test): pgd_Linf_2/255: 8 of 10"]
    assert all("; the rest ≈ " in line for line in lines)
    caplog.clear()  # again, every batch kept: nothing measured, so no estimate of the rest
    measure_batches(dataset, 10, 4, torch.device("cpu"), lambda i, x, y: {"n": y.clone()}, session, "pgd_Linf_2/255")
    lines = [r.getMessage() for r in caplog.records if "robustness (test): pgd_Linf_2/255: " in r.getMessage()]
    assert len(lines) == 2 and not any("the rest" in line for line in lines)
    caplog.clear()  # with a progress bar (which shows its own ETA): no line
    Session("robustness (test)", show_bar=True).progress("pgd_Linf_2/255", 4, 10, 100.0)
    quiet = Session("robustness (test)")  # by default: nothing in the first 10 s, then every 10 s at most
    for seconds in (1.0, 9.0, 12.0, 15.0, 23.0):
        quiet.progress("pgd_Linf_2/255", 4, 10, seconds)
    said = [r.getMessage() for r in caplog.records if "4 of 10" in r.getMessage()]
    assert [line.split(" points in ")[1].split(";")[0] for line in said] == ["12 s", "23 s"]
