"""Every public function, and every public method and property of a public class, of every module
of ``radixkv`` and ``radixkv.backends`` has a docstring (``inspect.getdoc``: one inherited from the
method it overrides counts) and type hints on its parameters (but ``self``, ``cls``, ``*args`` and
``**kwargs``) and on its return (a property: its getter's).  Public: no leading underscore, defined
in that module (``__module__``).  What a docstring says (its cost, its contract) is for review, not
for this test."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from types import ModuleType
from typing import Any, Iterator

import pytest

import radixkv
import radixkv.backends

PACKAGES = (radixkv, radixkv.backends)
#: Modules that must be among those checked: a walk that finds nothing would pass.
EXPECTED = ("radixkv.core.cache", "radixkv.core.tree", "radixkv.backends.cpu", "radixkv.testing.machines",
            "radixkv.integrations._vllm_events", "radixkv.bench.fleet_sim")


def _optional_missing(exc: ImportError) -> str | None:
    """The optional dependency whose absence ``exc`` reports (as ``pytest.importorskip`` would skip
    for), or ``None`` for any other import error, which the test reports as it is."""
    name = getattr(exc, "name", None)
    if isinstance(exc, ModuleNotFoundError) and name and name.split(".")[0] != "radixkv":
        return name
    if "pip install radixkv[" in str(exc):        # radixkv's own message for a missing extra
        return str(exc)
    return None


def _modules(missing: dict[str, str]) -> Iterator[ModuleType]:
    """Every module of ``PACKAGES``, imported once each; those that need a missing optional
    dependency go into ``missing`` (module name -> what is missing)."""
    def onerror(name: str) -> None:               # a subpackage that failed to import while walked
        try:
            importlib.import_module(name)
        except ImportError as exc:
            what = _optional_missing(exc)
            if what is None:
                raise
            missing[name] = what

    names = {pkg.__name__: None for pkg in PACKAGES}
    for pkg in PACKAGES:
        for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".", onerror=onerror):
            names.setdefault(info.name, None)
    for name in names:
        if name in missing:
            continue
        try:
            yield importlib.import_module(name)
        except ImportError as exc:
            what = _optional_missing(exc)
            if what is None:
                raise
            missing[name] = what


def _public(module: ModuleType) -> Iterator[tuple[str, Any]]:
    """(qualified name, function) of the module's public functions and of the public methods
    (static and class methods included) of its public classes."""
    def defined_here(obj: Any) -> bool:
        return getattr(obj, "__module__", None) == module.__name__

    for name, obj in vars(module).items():
        if name.startswith("_") or not defined_here(obj):
            continue
        if inspect.isfunction(obj):
            yield f"{module.__name__}.{name}", obj
        elif inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                elif isinstance(member, property) and member.fget is not None:
                    member = member.fget            # a property's getter: its docstring is the property's
                if not attr.startswith("_") and inspect.isfunction(member) and defined_here(member):
                    yield f"{module.__name__}.{name}.{attr}", member


def _faults(func: Any) -> list[str]:
    """What ``func`` lacks: its docstring, the hints of named parameters, its return hint."""
    out = [] if inspect.getdoc(func) else ["no docstring"]
    sig = inspect.signature(func)
    bare = [p.name for p in sig.parameters.values()
            if p.annotation is p.empty and p.name not in ("self", "cls")
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if bare:
        out.append(f"no type hint on {', '.join(bare)}")
    if sig.return_annotation is sig.empty:
        out.append("no return type hint")
    return out


def test_every_public_function_has_a_docstring_and_type_hints() -> None:
    missing: dict[str, str] = {}
    checked, offenders = [], []
    for module in _modules(missing):
        checked.append(module.__name__)
        for qualname, func in _public(module):
            faults = _faults(func)
            if faults:
                offenders.append(f"{qualname}: {'; '.join(faults)}")
    left_out = "".join(f"\n  {name} (needs {what})" for name, what in sorted(missing.items()))
    assert not offenders, (f"{len(offenders)} public functions and methods lack a docstring or type hints:\n  "
                           + "\n  ".join(offenders)
                           + (f"\nnot checked, an optional dependency is missing:{left_out}" if missing else ""))
    unseen = set(EXPECTED) - set(checked) - set(missing)
    assert not unseen, f"the walk missed {sorted(unseen)}"
    if missing:
        pytest.skip(f"{len(checked)} modules checked; not checked, an optional dependency is missing:{left_out}")
