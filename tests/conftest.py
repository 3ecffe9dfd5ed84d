"""Shared test settings: radixkv's hypothesis profiles (``HYPOTHESIS_PROFILE=ci`` is what CI uses)."""

from radixkv.testing import settings

settings.load_profile()
