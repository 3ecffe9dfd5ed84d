"""The command line's argument parser: an error (an unknown command or flag, a bad value) is one
line naming the problem, never a usage block and a traceback."""

from __future__ import annotations

import argparse
from typing import NoReturn

__all__ = ["Parser", "Refused"]


class Refused(Exception):
    """A command refused its input; the message is the one line the user sees."""


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors raise ``Refused`` with one line (``radixkv.tools.cli``
    prints it and exits with status 2)."""

    def error(self, message: str) -> NoReturn:
        """Raise ``Refused`` with ``message`` in one line that points to ``--help``, instead of printing
        the usage and exiting.  Never returns.  O(1)."""
        raise Refused(f"{self.prog}: {message} (see {self.prog} --help)")
