"""The checked wrapper every named patch (patches.py, serve_patches.py) goes through."""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Callable


class PatchTargetChanged(RuntimeError):
    """A vLLM method a patch wraps no longer has the parameters the patch passes on."""


def _target(owner: type, attr: str) -> tuple[Callable, type | None]:
    """``owner.attr`` as a plain function, and its kind (classmethod, staticmethod; None: a method)."""
    static = inspect.getattr_static(owner, attr)
    if isinstance(static, (classmethod, staticmethod)):
        return static.__func__, type(static)
    return getattr(owner, attr), None


def check_params(owner: type, attr: str, params: tuple[str, ...]) -> None:
    """Raise :class:`PatchTargetChanged` unless ``owner.attr`` starts with ``params``."""
    names = tuple(inspect.signature(_target(owner, attr)[0]).parameters)[: len(params)]
    if names != params:
        raise PatchTargetChanged(
            f"{owner.__name__}.{attr} takes ({', '.join(names)}, ...), the patch expects ({', '.join(params)}, ...)"
        )


def wrap(owner: type, attr: str, hook: Callable, params: tuple[str, ...] = ()) -> None:
    """Replace ``owner.attr`` by a wrapper calling ``hook(original, *args, **kwargs)``, once the original's
    leading parameters are checked to be ``params``, those the hook passes on (else :class:`PatchTargetChanged`,
    the method left alone). Classmethods and staticmethods are put back as such (``original`` is the plain
    function, ``cls`` first); the wrapper keeps the original's name, docstring, and it as ``__lookahead_original__``."""
    check_params(owner, attr, params)
    original, kind = _target(owner, attr)

    def wrapper(*args, **kwargs):
        return hook(original, *args, **kwargs)

    functools.update_wrapper(wrapper, original)
    wrapper.__lookahead_original__ = original
    setattr(owner, attr, kind(wrapper) if kind is not None else wrapper)


def method_patch(owner: str, attr: str, params: tuple[str, ...] = ()) -> Callable:
    """Decorator: ``hook(original, *args, **kwargs)`` becomes a named patch (``() -> True``) wrapping
    ``attr`` of the class ``owner`` (a dotted path, imported when the patch is applied) through :func:`wrap`."""

    def decorate(hook: Callable) -> Callable[[], bool]:
        def apply() -> bool:
            module, _, name = owner.rpartition(".")
            wrap(getattr(importlib.import_module(module), name), attr, hook, params)
            return True

        apply.__name__, apply.__qualname__, apply.__doc__ = hook.__name__, hook.__qualname__, hook.__doc__
        return apply

    return decorate
