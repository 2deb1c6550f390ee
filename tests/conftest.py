"""One intra-op thread per test process, the checkout under test first on the import path, and tests marked `gpu`
skipped without a CUDA device, a temporary cache, and `hf_dir` (a tiny transformers model directory, for the recipe
and the search that take one); nothing else is global.

The tests' tensors are tiny: a second OpenMP thread buys nothing on them, and on a machine whose cores are busy (2
cores, gloo ranks or other jobs) it spins waiting for them and makes the run several times slower. Set before torch
is imported, so subprocesses (the CLI's first process) get it too; gloo ranks set their own.

The tests import shardlab from the checkout they belong to, in this process, in spawned ranks (they inherit
sys.path) and in subprocesses (PYTHONPATH), even where another checkout is installed in editable mode. What they
measure and keep (the search's probes, the CPU device) goes to a temporary SHARDLAB_CACHE, not the user's.
"""

import os
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = str(Path(__file__).resolve().parents[1])
sys.path.insert(0, ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])
CACHE = tempfile.TemporaryDirectory(prefix="shardlab-tests-")
os.environ["SHARDLAB_CACHE"] = CACHE.name  # what the tests measure (probes, the CPU device) is not the user's


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    import torch  # only when a gpu test was collected: pure test runs stay free of the torch import

    if not torch.cuda.is_available():
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory):
    """A small local transformers model directory (its config alone), for the recipe that trains one by directory."""
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("hf")
    config = transformers.Qwen3Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16,
    )  # fmt: skip
    config.save_pretrained(root)
    return root
