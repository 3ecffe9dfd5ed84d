"""Shared test settings: radixkv's hypothesis profiles (``HYPOTHESIS_PROFILE=ci`` is what CI uses),
this directory on ``sys.path`` for the helper modules the tests share (``hf_cases``), and the
longest test files first (``pytest -n 2 --dist loadfile --no-loadscope-reorder``, as ``make test``
runs it, hands out files in collection order; without the flag xdist orders them by their number
of tests, and a long file of one test started last is the run's tail)."""

import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch

from radixkv.testing import settings

settings.load_profile()
sys.path.insert(0, str(Path(__file__).parent / "helpers"))   # --import-mode=importlib does not add it


#: The test files that take minutes each on the CI machine, longest first (see the durations CI prints).
LONGEST_FIRST = ("integrations/test_vllm.py", "p2p/test_p2p.py", "testing/test_mutations.py", "fleet/test_vllm.py",
                 "tools/test_cli.py", "integrations/test_vllm_metrics.py", "core/test_capacity.py",
                 "core/test_policy_replay.py", "p2p/test_vllm_p2p.py", "tools/test_notebooks.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Move the ``LONGEST_FIRST`` files to the front, in that order; the rest keep theirs."""
    here = Path(__file__).parent

    def rank(item: pytest.Item) -> int:
        try:
            rel = Path(str(item.fspath)).relative_to(here).as_posix()
        except ValueError:
            return len(LONGEST_FIRST)
        return LONGEST_FIRST.index(rel) if rel in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)      # stable: the order within a file and among the rest is kept


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny tensors: one intra-op thread is much faster than several contending for two cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
