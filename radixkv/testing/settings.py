"""Hypothesis settings profiles for radixkv's machines, for its own tests and for yours.

Importing this module registers the profiles; ``load_profile()`` loads the one named by
``HYPOTHESIS_PROFILE`` (default ``"dev"``).  Put this in your ``conftest.py``::

    from radixkv.testing import settings
    settings.load_profile()                  # HYPOTHESIS_PROFILE=ci|dev|thorough|mutation

Profiles (every one has no deadline: a step may touch a disk or a server):

* ``dev`` — 25 examples, for a quick local run.
* ``ci`` — 60 examples, prints the reproduction blob of a failure.
* ``thorough`` — 1000 examples, for a long run before a release.
* ``mutation`` — what radixkv's own mutation self-test uses: derandomised (a fixed seed, the same
  examples on every run and machine), no example database, no shrinking (a mutant only has to be
  caught, not minimised), 40 examples of up to 40 steps.

``MUTATION`` and friends are the ``hypothesis.settings`` objects themselves, to pass to
``run_state_machine_as_test(..., settings=...)`` or ``TierContract.check(..., settings=...)``.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase
from hypothesis import settings as _settings

__all__ = ["CI", "DEV", "MUTATION", "PROFILES", "THOROUGH", "load_profile"]

_BASE = _settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                                       HealthCheck.data_too_large])

DEV = _settings(_BASE, max_examples=25)
CI = _settings(_BASE, max_examples=60, print_blob=True)
THOROUGH = _settings(_BASE, max_examples=1000)
MUTATION = _settings(_BASE, max_examples=40, stateful_step_count=40, derandomize=True, database=None,
                     phases=[Phase.explicit, Phase.generate], print_blob=False)

PROFILES = {"dev": DEV, "ci": CI, "thorough": THOROUGH, "mutation": MUTATION}

for _name, _profile in PROFILES.items():
    _settings.register_profile(_name, _profile)


def load_profile(name: str | None = None) -> _settings:
    """Load profile ``name`` (default: ``$HYPOTHESIS_PROFILE``, else ``"dev"``) and return it.
    Any profile registered with hypothesis works; an unknown name raises ``ValueError``."""
    name = name if name is not None else os.environ.get("HYPOTHESIS_PROFILE", "dev")
    try:
        profile = _settings.get_profile(name)
    except Exception:  # hypothesis's InvalidArgument
        raise ValueError(f"name: no hypothesis profile {name!r}; radixkv registers "
                         f"{', '.join(sorted(PROFILES))}") from None
    _settings.load_profile(name)
    return profile
