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
        raise PatchTargetChanged(f"{owner.__name__}.{attr} takes ({', '.join(names)}, ...), "
                                 f"the patch expects ({', '.join(params)}, ...)")


def wrap(*targets: tuple[type, str, Callable, tuple[str, ...]]) -> None:
    """Replace each ``owner.attr`` of ``(owner, attr, hook, params)`` by a wrapper calling ``hook(original, *args,
    **kwargs)``, all or none (:func:`check_params`). Classmethods and staticmethods stay such (``original``: the plain
    function); a wrapper keeps the original's name, docstring and itself as ``__lookahead_original__``."""
    for owner, attr, _, params in targets:
        check_params(owner, attr, params)
    for owner, attr, hook, _ in targets:
        original, kind = _target(owner, attr)
        wrapper = _calling(hook, original)
        setattr(owner, attr, kind(wrapper) if kind is not None else wrapper)


def _calling(hook: Callable, original: Callable) -> Callable:
    def wrapper(*args, **kwargs):
        return hook(original, *args, **kwargs)

    functools.update_wrapper(wrapper, original)
    wrapper.__lookahead_original__ = original
    return wrapper


def method_patch(owner: str, attr: str, params: tuple[str, ...] = ()) -> Callable:
    """Decorator: ``hook(original, *args, **kwargs)`` becomes a named patch (``() -> True``) wrapping ``attr`` of
    the class ``owner`` (a dotted path, imported when applied) through :func:`wrap`."""

    def decorate(hook: Callable) -> Callable[[], bool]:
        def apply() -> bool:
            module, _, name = owner.rpartition(".")
            wrap((getattr(importlib.import_module(module), name), attr, hook, params))
            return True

        apply.__name__, apply.__qualname__, apply.__doc__ = hook.__name__, hook.__qualname__, hook.__doc__
        return apply

    return decorate
