"""The registry of the record types a saved trace may name: `torchlens._persist` builds no other
object from a file. A record type joins with the `persisted` class decorator where it is defined."""

from __future__ import annotations

from typing import TypeVar

__all__ = ["PERSISTED", "persisted"]

_T = TypeVar("_T", bound=type)

#: class name -> class, for every record type a saved trace may name.
PERSISTED: dict[str, type] = {}


def persisted(cls: _T) -> _T:
    """Class decorator: `cls` is a record a saved trace may hold (see `PERSISTED`)."""
    if PERSISTED.setdefault(cls.__name__, cls) is not cls:
        raise TypeError(f"two persisted record types are named {cls.__name__}")
    return cls
