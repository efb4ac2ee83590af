"""Typed option objects: frozen dataclasses whose misspelt names are a ``ConfigError``.

``@options`` makes a class a frozen, keyword-only dataclass; an unknown keyword names itself,
the closest valid one and every valid one, as a :class:`~r3data.errors.ConfigError` (Python's
own ``TypeError`` names neither). :func:`as_options` accepts an option object, a mapping of
its fields (a YAML config) or None; :func:`checked_keywords` does the same check for a
function's keyword arguments.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from r3data.errors import ConfigError

__all__ = ["as_options", "checked_keywords", "options", "unknown_names"]

T = TypeVar("T")


def unknown_names(
    what: str,
    given: Iterable[str],
    valid: Iterable[str],
    moved: Mapping[str, str] | None = None,
) -> None:
    """Raise a :class:`ConfigError` naming every name of ``given`` that is not in ``valid``;
    ``moved`` says where a former option went."""
    valid = sorted(valid)
    unknown = sorted(set(given) - set(valid))
    if not unknown:
        return
    close = difflib.get_close_matches(unknown[0], valid, n=1)
    if moved and unknown[0] in moved:
        hint = f" (now {moved[unknown[0]]})"
    else:
        hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(
        f"{what}: unknown option {', '.join(map(repr, unknown))}{hint}; valid options: "
        f"{', '.join(valid)}"
    )


def options(cls: type[T]) -> type[T]:
    """A frozen, keyword-only dataclass whose unknown keywords raise :class:`ConfigError`."""
    cls = dataclasses.dataclass(frozen=True, kw_only=True)(cls)
    names = tuple(f.name for f in dataclasses.fields(cls) if f.init)
    init = cls.__init__

    @functools.wraps(init)
    def checked_init(self: Any, *args: Any, **kwargs: Any) -> None:
        if args:
            raise ConfigError(
                f"{cls.__name__}: options are keywords ({', '.join(names)}), found "
                f"{len(args)} positional"
            )
        unknown_names(cls.__name__, kwargs, names)
        init(self, **kwargs)

    cls.__init__ = checked_init  # type: ignore[method-assign]
    return cls


def as_options(cls: type[T], value: T | Mapping[str, Any] | None, name: str) -> T:
    """``value`` as a ``cls``: itself, ``cls(**value)`` for a mapping, ``cls()`` for None."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        return cls(**value)
    raise ConfigError(
        f"{name}: expected a {cls.__name__} (or a mapping of its fields), found "
        f"{type(value).__name__}"
    )


def checked_keywords(
    moved: Mapping[str, str] | None = None,
) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """A decorator: the function's unknown keyword arguments raise :class:`ConfigError`
    (named, with the closest valid one, or where ``moved`` says a former one went)."""

    def decorate(function: Callable[..., T]) -> Callable[..., T]:
        code = function.__code__  # every parameter a caller may name: all but positional-only
        valid = code.co_varnames[
            code.co_posonlyargcount : code.co_argcount + code.co_kwonlyargcount
        ]

        @functools.wraps(function)
        def checked(*args: Any, **kwargs: Any) -> T:
            unknown_names(f"{function.__name__}()", kwargs, valid, moved)
            return function(*args, **kwargs)

        return checked

    return decorate
