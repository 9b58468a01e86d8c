"""Makes `import deep_ep` (and `deep_ep.<submodule>`) resolve to ferry.deep_ep, so that an engine written against
DeepEP runs on Ferry without a change to its code (docs/deep_ep.md, "Switching an engine").

Two ways to turn it on:
  - FERRY_DEEP_EP=1 in the environment of a Python where ferry is pip-installed: the wheel's ferry-deep-ep.pth
    imports this module at interpreter start and calls activate_from_env(), in every process the engine starts
    (spawned workers inherit the environment);
  - ferry.deep_ep.install() (or this module's install()) before the engine imports deep_ep.

This module is imported at every interpreter start where the wheel is installed, so it uses the standard library only
and costs one environment lookup when the variable is unset: ferry (and torch) are imported only when a program
imports deep_ep. A module named deep_ep that is already imported is left alone (install() then says so).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys

_ALIAS = "deep_ep"
_TARGET = "ferry.deep_ep"
ENV = "FERRY_DEEP_EP"


class _AliasLoader(importlib.abc.Loader):
    """Loads deep_ep[.x] as the module object of ferry.deep_ep[.x] (one object under both names, so isinstance checks
    and module state agree), keeping that module's own spec."""

    def __init__(self, target: str):
        self.target = target
        self.module = None

    def create_module(self, spec):
        self.module = importlib.import_module(self.target)
        self.spec = self.module.__spec__  # (the import system sets __spec__ to the alias's; put back in exec_module)
        return self.module

    def exec_module(self, module) -> None:
        module.__spec__ = self.spec


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != _ALIAS and not fullname.startswith(_ALIAS + "."):
            return None
        real = _TARGET + fullname[len(_ALIAS):]
        if importlib.util.find_spec(real) is None:
            return None  # not part of ferry.deep_ep: deep_ep.<x> is then not found (ModuleNotFoundError)
        return importlib.util.spec_from_loader(fullname, _AliasLoader(real))


_FINDER = _AliasFinder()


def installed() -> bool:
    """Whether `import deep_ep` resolves to ferry.deep_ep in this process."""
    module = sys.modules.get(_ALIAS)
    if module is not None:
        return getattr(module, "__name__", None) == _TARGET
    return _FINDER in sys.meta_path


def install() -> None:
    """From now on `import deep_ep` and `import deep_ep.<x>` give ferry.deep_ep and ferry.deep_ep.<x>. Raises
    RuntimeError when another deep_ep is already imported (an engine module imported it before this call)."""
    module = sys.modules.get(_ALIAS)
    if module is not None and getattr(module, "__name__", None) != _TARGET:
        raise RuntimeError(f"ferry.deep_ep: another deep_ep ({getattr(module, '__file__', module)!r}) is already "
                           "imported; make deep_ep resolve to Ferry before the engine imports it (set FERRY_DEEP_EP=1 "
                           "for the whole process, or call ferry.deep_ep.install() first)")
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def uninstall() -> None:
    """Undoes install(): later imports of deep_ep find whatever the path holds (modules already imported stay)."""
    while _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)


def activate_from_env() -> None:
    """install() when FERRY_DEEP_EP is set to anything but "" or "0" (what ferry-deep-ep.pth calls)."""
    if os.environ.get(ENV, "") not in ("", "0"):
        install()
