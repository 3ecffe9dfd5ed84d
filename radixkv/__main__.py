"""``python -m radixkv COMMAND``: the command line lives in ``radixkv.tools.cli``."""

from __future__ import annotations

import sys

from radixkv.tools.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
