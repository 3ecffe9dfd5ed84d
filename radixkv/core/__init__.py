"""The core: the prefix-caching algorithm and its data structures, with no optional dependency.

Read it bottom up; each module imports only those listed before it:

* ``_checks``, ``_exit``, ``_ext`` — argument checks, flush at exit, the block-copy extension's build.
* ``hashing`` (chained chunk keys, ``Namespace``), ``pool`` (``KVLayout``, the paged ``KVPool``),
  ``format`` (a chunk's bytes and seal), ``observe`` (the observer seam), ``policy`` (eviction
  policies of the CPU tier), ``ops`` (gather/scatter pages).
* ``tier`` (the ``Tier`` interface and a reference tier), ``deadline`` (bounds on remote waits),
  ``workers`` (the worker pool remote tiers wait on).
* ``tree`` (``RadixTree``: the token trie over pool pages, LRU + locks).
* ``writer`` (the thread that stores chunks down the stack), ``stack`` (``TierStack``: lookup,
  load, store across tiers).
* ``groups`` (KV groups: sliding windows, hybrid models), ``request`` (one request's state).
* ``loads`` (tier -> pool) and ``stores`` (pool -> tier): the two directions of data.
* ``cache`` (``PrefixCache``: the engine protocol).

The public names are re-exported by ``radixkv`` itself; nothing here imports a feature, an
integration or a tool (checked by the import-linter contracts in ``setup.cfg``), except the Jupyter
display hooks ``_repr_html_``.
"""
