import os

import pytest
import torch

os.environ.setdefault("PYTHONHASHSEED", "0")
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
