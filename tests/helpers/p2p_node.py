"""One instance of a peer-to-peer test, in a process of its own: ``python tests/helpers/p2p_node.py SPEC.json``.

It builds its stack from a radixkv config with ``p2p_enabled`` (a CPU tier served to peers), stores
``chunks`` chunks of ``chunk_kv(seed, i)`` for ``tokens(seed)``, writes ``{"address": ...}`` to
``ready`` and serves until killed.  ``mode``:

* ``"serve"``: as described;
* ``"forge"``: every blob in its CPU tier has a payload byte flipped after storing (a peer that
  returns forged bytes);
* ``"die_on_request"``: exits at once when asked to ``Fetch`` chunks, before answering: a peer
  that dies mid-transfer (for NIXL the test kills it between the pin and the read).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch

from radixkv.config import CacheConfig
from radixkv.core.pool import KVLayout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32, page_size=4)
CHUNK = 8


def config(spec: dict[str, Any], instance: str, address: str | None) -> CacheConfig:
    """The config of one instance of a test fleet."""
    return CacheConfig.from_mapping({
        "chunk_size": CHUNK, "page_size": LAYOUT.page_size, "num_pages": 1, "local_cpu": True,
        "max_local_cpu_size": spec.get("cpu_gb", 0.001), "secret": spec["secret"], "namespace": {"model": "p2p-test"},
        "p2p_enabled": True, "p2p_controller": spec["controller"], "p2p_instance": instance,
        "p2p_address": address, "p2p_transport": spec.get("transport", "zmq"),
        "remote_timeout": spec.get("timeout", 2.0), "peer_codec": spec.get("peer_codec")})


def tokens(seed: int, chunks: int) -> list[int]:
    """The prompt of a test: ``chunks`` whole chunks of token ids."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 30000, (chunks * CHUNK,), generator=g).tolist()


def chunk_kv(seed: int, i: int) -> torch.Tensor:
    """The KV of chunk ``i`` of a test."""
    g = torch.Generator().manual_seed(seed * 1000 + i)
    return torch.randn(LAYOUT.chunk_shape(CHUNK), generator=g)


def main(spec_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    from radixkv.p2p.node import PeerServer

    if spec["mode"] == "die_on_request":
        answer = PeerServer.handle

        def dying(self: PeerServer, body: Any, blobs: Any) -> Any:
            if type(body).__name__ == "Fetch":
                os._exit(0)
            return answer(self, body, blobs)

        PeerServer.handle = dying  # type: ignore[method-assign]
    cfg = config(spec, spec["instance"], "tcp://127.0.0.1:0")
    stack = cfg.make_stack(LAYOUT, exclusive=False)
    assert stack is not None
    refs = stack.refs(tokens(spec["seed"], spec["chunks"]))
    stack.store([(ref, chunk_kv(spec["seed"], i)) for i, ref in enumerate(refs)])
    assert stack.flush(10.0)
    cpu = stack.tiers[0]
    if spec["mode"] == "forge":
        memory = cpu.arena.numpy()                     # type: ignore[attr-defined]
        for entry in cpu.entries():
            lease = cpu.lease(entry.key)               # type: ignore[attr-defined]
            memory[lease.offset + lease.length - 5] ^= 0xFF
            cpu.unlease(lease)                         # type: ignore[attr-defined]
    peer = stack.tiers[1]
    address = peer.node.endpoint                       # type: ignore[attr-defined]
    with open(spec["ready"] + ".tmp", "w") as f:
        json.dump({"address": address, "pid": os.getpid()}, f)
    os.replace(spec["ready"] + ".tmp", spec["ready"])
    while True:
        time.sleep(1.0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
