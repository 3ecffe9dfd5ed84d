"""``python -m radixkv.bench NAME [options]``: run one benchmark (see ``radixkv.bench``)."""

from __future__ import annotations

import importlib
import sys

from radixkv.bench import BENCHMARKS as _CORE
from radixkv.tools._args import Refused

BENCHMARKS = (*_CORE, "vllm", "fleet", "p2p")   # vllm, fleet: need vLLM (radixkv[vllm]); p2p: radixkv[p2p]
#: Commands whose module has another name (no module is named like a standard-library one).
_MODULES = {"copy": "block_copy"}


def main(argv: list[str] | None = None) -> int:
    """``python -m radixkv.bench NAME [options]``: import benchmark ``NAME`` and run its ``main`` on the
    options; its exit status.  No name or an unknown one prints the usage line and returns 2; a refused
    flag or value is one line on stderr and 2, never a usage block.  Cost: one import, then the
    benchmark's run."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in BENCHMARKS:
        print(f"usage: python -m radixkv.bench {{{','.join(BENCHMARKS)}}} [options]  (--help on each)")
        return 2
    module = importlib.import_module(f"radixkv.bench.{_MODULES.get(argv[0], argv[0])}")
    try:
        return int(module.main(argv[1:]) or 0)
    except Refused as exc:            # a bad flag or value: one line, never a usage block
        print(exc, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
