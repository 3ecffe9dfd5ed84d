"""Tools around the cache: the command line and what operators and notebooks use.

* ``cli`` — ``python -m radixkv COMMAND``.
* ``demo`` — radixkv's main job on embedded defaults; ``workloads`` — synthetic workloads.
* ``warm`` — the remote tier's chunks onto local disk, and ``precompute`` through an engine.
* ``inspection`` — ``python -m radixkv inspect``: what each tier holds, verified.
* ``viz`` — pictures of the tree, the stats and TTFT for notebooks.
* ``s3server``, ``redisserver`` — local servers on loopback for tests, benchmarks and the demo.
"""
