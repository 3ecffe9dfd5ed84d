"""Benchmarks, each a command: ``python -m radixkv.bench NAME [options]``.

Every benchmark module has a ``main(argv) -> int`` and states in its docstring the command that
produced its committed results (``benchmarks/results/``).  Ratios are measured side by side in one
run; medians, not means, because the machines they run on are shared and noisy.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

BENCHMARKS = ("blend", "capacity", "codec", "copy", "fleet_index", "fleet_sim", "hash", "hybrid", "policy", "s3", "tiers", "tree", "ttft")


def out_file(path: str) -> str:
    """``--out`` of every benchmark (an argparse ``type``): ``path`` when its folder exists, so a run
    is refused before it starts rather than failing to write its report at the end.  One stat."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"no folder {folder!r} to write {path!r} in")
    return path


def median_seconds(fn: Callable[[], object], repeat: int = 7, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeat`` runs after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def machine_line() -> str:
    """One line naming the machine a result was measured on (CPU model, cores, torch version)."""
    import os
    import platform

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{cpu}, {os.cpu_count()} cores, {gpu}, Python {platform.python_version()}, "
            f"torch {torch.__version__}, torch threads {torch.get_num_threads()}")


class Report:
    """A benchmark's report: each call prints a line and keeps it; ``save(path)`` writes them all.

    It opens with the exact command and the machine, the header every committed result carries.
    """

    def __init__(self, name: str, argv: list[str] | None,
                 echo: Callable[[str], object] = lambda line: print(line, flush=True)) -> None:
        self.lines: list[str] = []
        self.echo = echo            # e.g. tqdm.write, so that lines and a progress bar do not collide
        self(f"# python -m radixkv.bench {name} {' '.join(argv or [])}".rstrip())
        self(f"# machine: {machine_line()}")

    def __call__(self, line: str = "") -> None:
        self.echo(line)
        self.lines.append(line)

    def save(self, path: str | None) -> None:
        """Write the report to ``path`` (nothing when ``None``)."""
        if path:
            with open(path, "w") as f:
                f.write("\n".join(self.lines) + "\n")
