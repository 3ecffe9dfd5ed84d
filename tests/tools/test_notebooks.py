"""Every notebook in ``notebooks/`` runs top to bottom without an error, at small sizes.

The test makes its own kernel: a kernelspec in a temporary ``JUPYTER_PATH`` whose command is this
interpreter (``sys.executable -m ipykernel_launcher``), so the notebooks run against the radixkv
installed here, with nothing installed by hand.  The kernel gets ``RADIXKV_NOTEBOOK_SMALL=1``,
which every notebook's first code cell reads to pick small sizes.  A notebook that needs an optional
package names it in its metadata (``"radixkv": {"requires": [...]}``) and is skipped without it.
Skipped as a whole without nbclient, nbformat, ipykernel or matplotlib (the ``notebooks`` extra).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow      # every notebook, executed: `pytest -m "not slow"` leaves it out

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))
KERNEL = "radixkv-notebook-test"


@pytest.fixture(scope="module")
def kernel_name(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("jupyter")
    spec = root / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "radixkv tests", "language": "python",
        "env": {"RADIXKV_NOTEBOOK_SMALL": "1", "MPLBACKEND": "module://matplotlib_inline.backend_inline"},
    }))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_PATH", str(root))        # read when the kernel spec manager is made
        mp.setenv("RADIXKV_NOTEBOOK_SMALL", "1")
        yield KERNEL


def test_there_are_notebooks() -> None:
    assert [p.name for p in NOTEBOOKS] == ["01_tour.ipynb", "02_workloads.ipynb", "03_ttft.ipynb", "04_metrics.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: Path, kernel_name: str, tmp_path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    for module in nb.metadata.get("radixkv", {}).get("requires", []):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{path.name} needs {module}")
    first_code = next(c for c in nb.cells if c.cell_type == "code")
    assert "RADIXKV_NOTEBOOK_SMALL" in first_code.source, "the first code cell must read the size knob"
    client = nbclient.NotebookClient(nb, kernel_name=kernel_name, timeout=300, startup_timeout=120,
                                     record_timing=False, resources={"metadata": {"path": str(tmp_path)}})
    client.execute()                      # raises CellExecutionError on the first failing cell
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "a notebook of pictures drew none"
    assert not list(tmp_path.iterdir()), "the notebook left files in its working directory"
