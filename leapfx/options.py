"""Option checks shared by every floor: one wording for "this option's value is invalid".

Options are validated where they enter (``apply``, ``fit``, ``generate``, ``export_onnx``, the
CLI) and every error names the option, the value and what is allowed::

    exit_layer: 0 is invalid; allowed: an integer 1..3

This module imports nothing of leapfx, so it sits beneath every floor (``tools/check_layers.py``).

- ``is_int`` / ``is_number``: Python's ``bool`` is an ``int``; an option that takes a count or a
  number never takes ``True``.
- ``check_int``, ``check_number``, ``check_bool``, ``check_choice``: raise ``ValueError`` in the
  wording above; ``allowed=`` replaces the generated description where an option says more
  (what ``None`` means, the unit).
- ``SavedOptions``: the options read from saved parts. ``pick`` is "the option given, else the
  parts' value, else the default"; ``require`` refuses a given option the parts contradict.

>>> check_int("steps", 0, 1)
Traceback (most recent call last):
...
ValueError: steps: 0 is invalid; allowed: an integer >= 1
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


def is_int(value: Any) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An ``int`` or ``float`` that is not a ``bool``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def invalid(name: str, value: Any, allowed: str) -> ValueError:
    """The error every check raises: ``name: value is invalid; allowed: ...``."""
    return ValueError(f"{name}: {value!r} is invalid; allowed: {allowed}")


def int_range(low: int | None = None, high: int | None = None) -> str:
    """``an integer 1..4``, ``an integer >= 1``, ``an integer <= 4`` or ``an integer``."""
    if low is not None and high is not None:
        return f"an integer {low}..{high}"
    if low is not None:
        return f"an integer >= {low}"
    if high is not None:
        return f"an integer <= {high}"
    return "an integer"


def in_range(value: Any, low: Any = None, high: Any = None) -> bool:
    """``low <= value <= high``, a missing bound not checked."""
    return (low is None or value >= low) and (high is None or value <= high)


def check_int(
    name: str,
    value: Any,
    low: int | None = None,
    high: int | None = None,
    *,
    none: bool = False,
    allowed: str | None = None,
) -> Any:
    """``value`` unless it is not an integer in ``low..high`` (``None`` passes with ``none``).

    >>> check_int("rank", 8, 1)
    8
    >>> check_int("fast_keys", True, 1, none=True)
    Traceback (most recent call last):
    ...
    ValueError: fast_keys: True is invalid; allowed: None or an integer >= 1
    """
    if none and value is None:
        return value
    if not (is_int(value) and in_range(value, low, high)):
        if allowed is None:
            allowed = ("None or " if none else "") + int_range(low, high)
        raise invalid(name, value, allowed)
    return value


def check_number(
    name: str,
    value: Any,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    finite: bool = True,
    none: bool = False,
    allowed: str | None = None,
) -> Any:
    """``value`` unless it is not a number in the interval (``None`` passes with ``none``).

    ``low_open`` / ``high_open`` leave a bound out; ``finite`` refuses inf and nan.

    >>> check_number("lr", 0.0, 0, low_open=True)
    Traceback (most recent call last):
    ...
    ValueError: lr: 0.0 is invalid; allowed: a finite number > 0
    """
    if none and value is None:
        return value
    ok = is_number(value) and not (finite and not math.isfinite(value))
    ok = ok and (low is None or (value > low if low_open else value >= low))
    ok = ok and (high is None or (value < high if high_open else value <= high))
    if not ok:
        if allowed is None:
            allowed = ("None or " if none else "") + _number_range(
                low, high, low_open, high_open, finite
            )
        raise invalid(name, value, allowed)
    return value


def _number_range(low, high, low_open: bool, high_open: bool, finite: bool) -> str:
    kind = "a finite number" if finite else "a number"
    if low is not None and high is not None:
        return f"{kind} in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    if low is not None:
        return f"{kind} {'>' if low_open else '>='} {low}"
    if high is not None:
        return f"{kind} {'<' if high_open else '<='} {high}"
    return kind


def check_bool(name: str, value: Any, *, none: bool = False, allowed: str | None = None) -> Any:
    """``value`` unless it is not ``True`` or ``False`` (``None`` passes with ``none``).

    >>> check_bool("progress", 1)
    Traceback (most recent call last):
    ...
    ValueError: progress: 1 is invalid; allowed: True or False
    """
    if none and value is None:
        return value
    if not isinstance(value, bool):
        raise invalid(name, value, allowed or ("True, False or None" if none else "True or False"))
    return value


def check_choice(name: str, value: Any, choices: Iterable, *, allowed: str | None = None) -> Any:
    """``value`` unless it is not one of ``choices`` (listed by repr in the error).

    >>> check_choice("policy", "mru", ("lru", "lfu"))
    Traceback (most recent call last):
    ...
    ValueError: policy: 'mru' is invalid; allowed: 'lru', 'lfu'
    """
    choices = tuple(choices)
    if value not in choices:
        raise invalid(name, value, allowed or ", ".join(map(repr, choices)))
    return value


@dataclass(frozen=True)
class SavedOptions:
    """The options saved with trained parts, and where they came from.

    A recipe's option left as None takes the parts' value, else its default; an option given
    must agree with what the parts were trained with (``require``).

    >>> saved = SavedOptions({"exit_layer": 2}, path="p")
    >>> saved.pick("exit_layer", None, 1), saved.pick("rank", None, 8), saved.pick("rank", 4, 8)
    (2, 8, 4)
    >>> saved.require("exit_layer", 3)
    Traceback (most recent call last):
    ...
    ValueError: exit_layer: 3 does not match the parts at 'p', trained with 2; allowed: 2 or None
    """

    options: Mapping[str, Any] = field(default_factory=dict)
    path: str | None = None
    what: str = "parts"  # how the error names the directory: "the parts", "the adapter", ...

    def get(self, key: str, default: Any = None) -> Any:
        """The saved value of ``key``; ``default`` when it is missing or None."""
        value = self.options.get(key)
        return default if value is None else value

    def pick(self, name: str, given: Any, default: Any = None, *, key: str | None = None) -> Any:
        """``given`` if not None, else the saved ``key`` (``name``) if not None, else default."""
        return given if given is not None else self.get(key or name, default)

    def picker(self, given: Any) -> Callable[[str, Any], Any]:
        """``pick(name, default)`` of the options object ``given``'s field ``name``."""
        return lambda name, default=None: self.pick(name, getattr(given, name), default)

    def require(
        self,
        name: str,
        value: Any,
        saved: Any = None,
        *,
        key: str | None = None,
        trained: str | None = None,
        allowed: str | None = None,
        verb: str = "does",
    ) -> None:
        """Refuse ``value`` where the parts hold another one (``saved``, else the saved ``key``
        or ``name``); nothing saved accepts any value.

        The error reads ``name: value does not match the parts at 'path', trained with X;
        allowed: X or None``; ``trained`` replaces "trained with X", ``allowed`` the X allowed.
        """
        if saved is None:
            saved = self.options.get(key or name)
        if saved is None or saved == value:
            return
        shown = repr(saved) if isinstance(saved, str) else str(saved)
        raise ValueError(
            f"{name}: {value!r} {verb} not match the {self.what} at {self.path!r}, "
            f"{trained or f'trained with {shown}'}; allowed: {allowed or shown} or None"
        )
