"""Reuse beyond the exact prefix (opt-in, approximate): CacheBlend.

* ``segments`` — segment chunks keyed without a prefix, found wherever they appear.
* ``rope`` — rotary position helpers, for re-rotating reused keys.
* ``blend`` — positional recovery, per-layer recompute shares and the selection of the rows to
  recompute; the blended forward itself is ``radixkv.integrations.paged_blend.blend_prefill``.
"""
