"""Shared test settings: radixkv's hypothesis profiles (``HYPOTHESIS_PROFILE=ci`` is what CI uses)."""

from typing import Iterator

import pytest
import torch

from radixkv.testing import settings

settings.load_profile()


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny tensors: one intra-op thread is much faster than several contending for two cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
