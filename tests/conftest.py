"""Shared test settings: radixkv's hypothesis profiles (``HYPOTHESIS_PROFILE=ci`` is what CI uses),
and this directory on ``sys.path`` for the helper modules the tests share (``hf_cases``)."""

import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch

from radixkv.testing import settings

settings.load_profile()
sys.path.insert(0, str(Path(__file__).parent / "helpers"))   # --import-mode=importlib does not add it


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny tensors: one intra-op thread is much faster than several contending for two cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
