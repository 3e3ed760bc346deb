"""A stand-in torchvision: only CUDA builds of torchvision are reachable here, and vLLM's
Qwen3.5 module imports it through transformers' image processors for its vision tower,
which a text-only benchmark never runs. Every submodule imports, and every name in it is
an inert placeholder that refuses to be called."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+standin"


class _Inert(type):
    def __getattr__(cls, name: str) -> type:  # InterpolationMode.BILINEAR and the like
        if name.startswith("__"):
            raise AttributeError(name)
        return cls


class _Placeholder(metaclass=_Inert):
    def __init__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("torchvision stand-in: images are not served by this benchmark")

    def __class_getitem__(cls, item: object) -> type:
        return cls


def _name(name: str) -> type:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Placeholder


__getattr__ = _name


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []  # type: ignore[attr-defined]
        module.__getattr__ = _name  # type: ignore[attr-defined]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


sys.meta_path.append(_Finder())
