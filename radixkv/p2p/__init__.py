"""Peer-to-peer sharing: instances read each other's CPU tier (``p2p_enabled: true``).

* ``node`` — what an instance runs to serve its CPU tier to peers (``join`` builds it).
* ``tier`` — ``PeerTier``, the tier that reads from peers (registered as ``"peer"``).
* ``controller`` — who holds what, answering peer lookups (``python -m radixkv controller``).
* ``wire`` — the signed control messages (msgspec over pyzmq).
* ``transport`` — NIXL (UCX) one-sided reads, where NIXL loads.

Built on the fleet's events and index (``radixkv.fleet``); chunks keep their seals, so a peer
cannot inject KV.
"""
