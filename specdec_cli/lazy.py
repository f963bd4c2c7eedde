"""Names a package exports but imports on first use (PEP 562), so that reading one light name from it (a constant,
a path helper) does not import torch and transformers with it: `specdec --help` and a usage mistake answer
without them."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping


def exports(package: str, names: Mapping[str, tuple[str, str]]) -> Callable[[str], object]:
    """A module `__getattr__` for `package`: `names` maps an exported name to (module, attribute), the module
    absolute or relative to the package (".demo"), imported when the name is first read and then kept as a plain
    attribute of the package (later reads, and a test's monkeypatch, see that)."""

    def __getattr__(name: str) -> object:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, attribute = names[name]
        value = getattr(importlib.import_module(module, package), attribute)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
