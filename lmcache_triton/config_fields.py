"""The field framework of a frozen, validated config dataclass: declare each field once with
:func:`option` (its annotation is its type), and :func:`build_fields` derives the table that
coerces, checks, redacts and documents every value (:class:`Field`, :func:`field_reference`).

Its own module so that the config's module holds the declaration alone: nothing here knows a field
of :class:`~lmcache_triton.config.LMCacheEngineConfig`, LMCache's names or where values come from
(LMCACHE_* variables, files: :mod:`lmcache_triton.config_sources`). Also here, for every source
and for LMCache's names: :class:`ConfigError`, the words that mean true, false and None in text,
and the unknown-key error with its "did you mean". Standard library only; nothing happens at import.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ConfigError", "FALSE_WORDS", "Field", "FrozenDict", "NONE_WORDS", "TRUE_WORDS", "build_fields",
    "field_reference", "freeze", "is_number", "option", "suggest", "thaw", "unknown_key", "unquote",
]


class ConfigError(ValueError):
    """An invalid configuration value, key, file or environment variable."""


def option(default: Any, doc: str, *, choices: tuple[Any, ...] = (), ge: float | None = None,
           gt: float | None = None, le: float | None = None, nonempty: bool = False,
           check: Callable[[Any], str | None] | None = None, normalize: Callable[[Any], Any] | None = None,
           accepted: str = "", secret: bool = False, redact: Callable[[Any], Any] | None = None,
           ours: bool = False) -> Any:
    """A field of a config dataclass (:class:`~lmcache_triton.config.LMCacheEngineConfig`): its
    default, its doc, and the values it accepts.

    The type is the field's annotation (``int``, ``float``, ``bool``, ``str``, ``tuple[int, ...]``,
    ``tuple[float, ...]``, ``dict[str, Any]``; ``| None`` for optional ones). ``choices``: the
    accepted values; ``ge``/``gt``/``le``: bounds (of each element for a tuple); ``nonempty``: a
    tuple needs one element or more; ``check(value)``: the reason a value is refused, or None;
    ``normalize(value)``: the stored form of a value of the same meaning (``file:///x`` -> ``/x``);
    ``accepted``: the accepted values in words, for the reference, where ``check`` says them;
    ``secret``: shown as ``***`` in repr(), errors and ``to_dict(redact=True)``; ``redact(value)``: the
    value as those show it, where only part of it is secret; ``ours``: not an LMCache field.
    """
    if isinstance(default, (list, dict, set)):
        raise TypeError("a field's default must be immutable: a tuple, or None for a mapping")
    meta = dict(doc=doc, choices=choices, ge=ge, gt=gt, le=le, nonempty=nonempty, check=check,
                normalize=normalize, accepted=accepted, secret=secret, redact=redact, ours=ours)
    return dataclasses.field(default=default, metadata=meta)


def suggest(name: str, candidates) -> str:
    """"; did you mean 'x'?" for the candidate closest to a misspelt ``name``, or nothing."""
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean '{match[0]}'?" if match else ""


def unknown_key(key: Any, fields: Mapping[str, Field], source: str = "", bare: str | None = None) -> ConfigError:
    """The error for ``key``, not one of ``fields`` (given in ``source``), with the closest field."""
    where = f" in {source}" if source else ""
    hint = suggest(str(key) if bare is None else bare, fields)
    return ConfigError(
        f"unknown config key {key!r}{where}{hint} "
        f"(valid keys: {', '.join(fields)})"
    )




# How true, false and None are written in text values (LMCACHE_* variables, LMCache's defaults).
TRUE_WORDS = frozenset({"true", "1", "yes", "on"})
FALSE_WORDS = frozenset({"false", "0", "no", "off"})
NONE_WORDS = frozenset({"none", "null", ""})


def unquote(s: str) -> str:
    """``s`` without the quotes around it, if it is quoted ('x' or "x")."""
    t = s.strip()
    if len(t) >= 2 and t[0] == t[-1] and t[0] in "'\"":
        return t[1:-1]
    return s


class FrozenDict(dict):
    """A dict that refuses changes (``extra_config`` as stored); hashable when its values are."""

    __slots__ = ()

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("extra_config is read-only (the config is frozen): "
                        "use config.replace(extra_config={...})")

    __setitem__ = __delitem__ = __ior__ = _refuse  # type: ignore[assignment]
    clear = pop = popitem = setdefault = update = _refuse  # type: ignore[assignment]

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(frozenset(self.items()))

    def __reduce__(self) -> tuple[Any, ...]:
        return (FrozenDict, (dict(self),))

    def __copy__(self) -> FrozenDict:
        return self

    def __deepcopy__(self, memo: Any) -> FrozenDict:
        return self


def freeze(value: Any) -> Any:
    """``value`` read-only: mappings become :class:`FrozenDict`, lists tuples, all the way down."""
    if isinstance(value, Mapping):
        return FrozenDict({k: freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    """``value`` as plain, mutable data (dicts, lists), for YAML and JSON: the opposite of :func:`freeze`."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [thaw(v) for v in value]
    return value


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    """An int or a float, not a bool (True is an int to Python, not a number to a config)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# The scalar types a field (or a list field's elements) may have: kind -> test of a value.
_IS: dict[str, Callable[[Any], bool]] = {
    "int": _is_int, "float": is_number, "bool": lambda v: isinstance(v, bool), "str": lambda v: isinstance(v, str),
}


@dataclass(frozen=True, eq=False)
class Field:
    """One field, as its declaration says: name, type (``kind``: int, float, bool, str, list[int],
    list[float] or dict, as written in YAML), default, doc and accepted values."""

    name: str
    kind: str
    optional: bool
    default: Any
    meta: Mapping[str, Any]
    # Values LMCache accepts for this field and this project refuses -> why (lmcache_compat's
    # table), added to the error that refuses one.
    why_refused: Mapping[Any, str] = dataclasses.field(default_factory=dict)

    def describe(self) -> str:
        return f"{self.kind} or None" if self.optional else self.kind

    def shown(self, value: Any) -> Any:
        """``value`` as errors and ``to_dict(redact=True)`` may show it."""
        if value is None:
            return None
        if self.meta["secret"]:
            return "***"
        redact = self.meta["redact"]
        try:
            return value if redact is None else redact(value)
        except (TypeError, AttributeError):  # a value of the wrong type, about to be refused
            return value

    def _type_error(self, value: Any) -> ConfigError:
        return ConfigError(f"invalid value for '{self.name}': expected {self.describe()}, "
                           f"got {type(value).__name__} {self.shown(value)!r}")

    def coerce(self, value: Any) -> Any:
        """``value`` checked against the type and stored in its normal form: int -> float for a
        float, a list (or a lone scalar, as LMCache accepts) -> a tuple, a mapping -> a read-only
        dict, plus the field's own ``normalize``."""
        if value is None:
            if self.optional:
                return None
            raise self._type_error(value)
        kind, out = self.kind, _MISSING
        if kind == "dict":
            if isinstance(value, Mapping):
                if not all(isinstance(k, str) for k in value):
                    raise ConfigError(f"invalid value for '{self.name}': keys must be strings, "
                                      f"got {self.shown(value)!r}")
                out = freeze(value)
        elif kind.startswith("list["):
            elem = kind[len("list["):-1]
            items = tuple(value) if isinstance(value, (list, tuple)) else (value,)
            if all(_IS[elem](x) for x in items):
                out = tuple(float(x) for x in items) if elem == "float" else items
        elif _IS[kind](value):
            out = float(value) if kind == "float" else value
            if kind == "float" and not math.isfinite(out):
                raise ConfigError(f"invalid value for '{self.name}': must be a finite number, got {value!r}")
        if out is _MISSING:
            raise self._type_error(value)
        normalize = self.meta["normalize"]
        return normalize(out) if normalize is not None else out

    def check(self, value: Any) -> None:
        """Refuse a (coerced) value outside the accepted ones."""
        if value is None:
            return
        m, name = self.meta, self.name
        items = value if self.kind.startswith("list") else (value,)
        each = "each value " if self.kind.startswith("list") else ""
        if m["nonempty"] and not items:
            raise ConfigError(f"invalid value for '{name}': must be a non-empty list")
        if m["choices"] and value not in m["choices"]:
            hint = self.why_refused.get(value, "")
            raise ConfigError(f"invalid value for '{name}': must be one of {', '.join(map(repr, m['choices']))}, "
                              f"got {value!r}" + (f" ({hint})" if hint else ""))
        ge, gt, le = m["ge"], m["gt"], m["le"]
        for x in items:
            if ge is not None and le is not None and not ge <= x <= le:
                why = f"must be in [{ge}, {le}]"
            elif ge is not None and x < ge:
                why = f"must be >= {ge}"
            elif gt is not None and x <= gt:
                why = f"must be > {gt}"
            else:
                continue
            raise ConfigError(f"invalid value for '{name}': {each}{why}{' or None' if self.optional else ''}, "
                              f"got {value!r}")
        reason = m["check"](value) if m["check"] is not None else None
        if reason:
            raise ConfigError(f"invalid value for '{name}': {reason}, got {self.shown(value)!r}")


_MISSING = object()


def build_fields(cls: type, why_refused: Mapping[str, Mapping[Any, str]] | None = None) -> dict[str, Field]:
    """The fields of the dataclass ``cls``, declared with :func:`option`, by name in declaration
    order. ``why_refused``: field -> value -> why that value is refused (see :class:`Field`)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        tp, optional = hints[f.name], False
        if typing.get_origin(tp) in (types.UnionType, typing.Union):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            optional, (tp,) = True, args
        origin = typing.get_origin(tp)
        if origin is tuple:
            kind = f"list[{typing.get_args(tp)[0].__name__}]"
        else:
            kind = "dict" if origin is dict else tp.__name__
        assert kind in (*_IS, "list[int]", "list[float]", "dict"), (f.name, kind)
        refused = types.MappingProxyType(dict((why_refused or {}).get(f.name, {})))
        out[f.name] = Field(f.name, kind, optional, f.default, f.metadata, refused)
    return out


def field_reference(fields: Mapping[str, Field]) -> str:
    """``fields`` as a Markdown table (name, type, default, accepted values, doc)."""
    rows = ["| Field | Type | Default | Accepts | Meaning |", "|---|---|---|---|---|"]
    for f in fields.values():
        m = f.meta
        accepts = [m["accepted"]] if m["accepted"] else []
        if m["choices"]:
            accepts.append(" \\| ".join(map(str, m["choices"])))
        if m["ge"] is not None and m["le"] is not None:
            accepts.append(f"{m['ge']}..{m['le']}")
        elif m["ge"] is not None:
            accepts.append(f">= {m['ge']}")
        elif m["gt"] is not None:
            accepts.append(f"> {m['gt']}")
        if m["nonempty"]:
            accepts.append("non-empty")
        default = f"`{json.dumps(thaw(f.default))}`"
        doc = m["doc"] + (" *Not in LMCache.*" if m["ours"] else "") + (" Secret: redacted." if m["secret"] else "")
        rows.append(f"| `{f.name}` | {f.describe()} | {default} | {', '.join(accepts)} | {doc} |")
    return "\n".join(rows) + "\n"
