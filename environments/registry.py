"""Environments by name and version. The version is part of what a node signs, so a validator
grades with exactly the code the node generated with, or refuses (`TaskEnvironmentError`)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from protocol.errors import TaskEnvironmentError

from .alphabet_sort import AlphabetSort
from .arithmetic import Arithmetic
from .base import Environment
from .calculator import CalcArith
from .length import MODES, LengthReward
from .lowercase import Lowercase
from .mathematics import MathEnvironment
from .programming import CodeEnvironment
from .reverse_text import ReverseText
from .wordle import Wordle

_FACTORIES: dict[str, dict[str, Callable[[], Environment]]] = {}
_INSTANCES: dict[tuple[str, str], Environment] = {}
_LOCK = threading.Lock()


def register(name: str, version: str, factory: Callable[[], Environment]) -> None:
    """Add an environment version; registering the same (name, version) twice is an error."""
    versions = _FACTORIES.setdefault(name, {})
    if version in versions:
        raise TaskEnvironmentError(f"{name}@{version} is already registered")
    versions[version] = factory


def unregister(name: str, version: str) -> None:
    """Remove an environment version added with `register` (a plugin unloading, a test cleaning up after
    itself); unknown ones are ignored."""
    with _LOCK:
        _FACTORIES.get(name, {}).pop(version, None)
        if name in _FACTORIES and not _FACTORIES[name]:
            del _FACTORIES[name]
        _INSTANCES.pop((name, version), None)


for _cls in (ReverseText, Arithmetic, MathEnvironment, CodeEnvironment, Lowercase, CalcArith, AlphabetSort,
             Wordle):
    register(_cls.name, _cls.version, _cls)


def _version_key(version: str) -> tuple[int | str, ...]:
    return tuple(int(p) if p.isdigit() else p for p in version.replace("+", ".").split("."))


def names() -> list[str]:
    """Registered base names (wrap any with `+length-exact|max|clip`)."""
    return sorted(_FACTORIES)


def versions(name: str) -> list[str]:
    """Registered versions of `name`, oldest first."""
    return sorted(_FACTORIES.get(name, {}), key=_version_key)


def get(name: str, version: str | None = None) -> Environment:
    """The environment `name` at `version` (latest when None); one shared instance per pair.

    `name` may carry a length wrapper, e.g. `math+length-max`, whose versions look like `1.length1`.
    """
    if not isinstance(name, str) or (version is not None and not isinstance(version, str)):
        raise TaskEnvironmentError("environment name and version must be strings")
    base, sep, mode = name.partition("+length-")
    if sep and mode not in MODES:
        raise TaskEnvironmentError(f"unknown length mode {mode!r} in {name!r}")
    inner_version: str | None = version
    if sep and version is not None:
        inner_version, dot, suffix = version.partition(".length")
        if not dot or suffix != "1":
            raise TaskEnvironmentError(f"unknown version {version!r} of {name!r}")
    known = _FACTORIES.get(base)
    if not known:
        raise TaskEnvironmentError(f"unknown environment {name!r}; known: {', '.join(names())}")
    chosen = inner_version if inner_version is not None else versions(base)[-1]
    if chosen not in known:
        raise TaskEnvironmentError(f"unknown version {version!r} of {name!r}; known: {versions(base)}")
    with _LOCK:
        inner = _INSTANCES.get((base, chosen))
        if inner is None:
            inner = _INSTANCES[(base, chosen)] = known[chosen]()
        if not sep:
            return inner
        key = (name, f"{chosen}.length1")
        wrapped = _INSTANCES.get(key)
        if wrapped is None:
            wrapped = _INSTANCES[key] = LengthReward(inner, mode=mode)  # type: ignore[arg-type]
        return wrapped
