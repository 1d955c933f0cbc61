"""Engine configuration: :class:`LMCacheEngineConfig`.

The field names, meanings and (where LMCache has them) defaults follow LMCache's
``lmcache/v1/config.py`` so that an LMCache YAML file or set of ``LMCACHE_*`` variables
works here unchanged for the options this package implements.

This module imports only the standard library and PyYAML, and does nothing at import.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import yaml

__all__ = ["ConfigError", "LMCacheEngineConfig", "ENV_PREFIX", "CONFIG_FILE_ENV"]

logger = logging.getLogger("lmcache_triton")

ENV_PREFIX = "LMCACHE_"
CONFIG_FILE_ENV = "LMCACHE_CONFIG_FILE"
OVERRIDE_PREFIX = "lmcache."

# LMCACHE_* variables that are not config fields but are legitimately set by users of
# LMCache (or read elsewhere); they are ignored silently.
_NON_FIELD_ENV = frozenset(
    {
        "LMCACHE_CONFIG_FILE",
        "LMCACHE_LOG_LEVEL",
        "LMCACHE_USE_EXPERIMENTAL",
        "LMCACHE_TRACK_USAGE",
    }
)
# Unknown LMCACHE_* variables already warned about in this process (warn once each).
_warned_env: set[str] = set()

REMOTE_SCHEMES = ("lm", "redis", "rediss", "valkey")
REMOTE_SERDES = ("naive", "lz4")


class ConfigError(ValueError):
    """An invalid configuration value, key, file or environment variable."""


# ---------------------------------------------------------------------------------------
# Field types. Kinds: int, float, bool, str, list[int], list[float], dict.
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Spec:
    kind: str
    optional: bool = False

    def describe(self) -> str:
        return f"{self.kind} or None" if self.optional else self.kind


_SPECS: dict[str, _Spec] = {
    "chunk_size": _Spec("int"),
    "local_cpu": _Spec("bool"),
    "max_local_cpu_size": _Spec("float"),
    "local_disk": _Spec("str", optional=True),
    "max_local_disk_size": _Spec("float"),
    "remote_url": _Spec("str", optional=True),
    "remote_serde": _Spec("str"),
    "remote_auth_token": _Spec("str", optional=True),
    "blocking_timeout_secs": _Spec("float"),
    "use_layerwise": _Spec("bool"),
    "enable_blending": _Spec("bool"),
    "blend_recompute_ratios": _Spec("list[float]"),
    "blend_check_layers": _Spec("list[int]"),
    "blend_min_tokens": _Spec("int"),
    "blend_special_str": _Spec("str"),
    "save_decode_cache": _Spec("bool"),
    "save_unfull_chunk": _Spec("bool"),
    "enable_async_loading": _Spec("bool"),
    "lookup_timeout_ms": _Spec("int"),
    "prometheus_port": _Spec("int", optional=True),
    "pin_lease_secs": _Spec("float"),
    "verify_hit_rate": _Spec("float"),
    "namespace_secret": _Spec("str", optional=True),
    "extra_config": _Spec("dict", optional=True),
}

_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})
_NONE = frozenset({"none", "null", ""})


def _suggest(name: str, candidates) -> str:
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean '{match[0]}'?" if match else ""


def _unknown_key(key: Any, source: str = "", bare: str | None = None) -> ConfigError:
    where = f" in {source}" if source else ""
    hint = _suggest(str(key) if bare is None else bare, _SPECS)
    return ConfigError(
        f"unknown config key {key!r}{where}{hint} "
        f"(valid keys: {', '.join(_SPECS)})"
    )


def _type_error(key: str, spec: _Spec, value: Any) -> ConfigError:
    return ConfigError(
        f"invalid value for '{key}': expected {spec.describe()}, "
        f"got {type(value).__name__} {value!r}"
    )


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _coerce(key: str, value: Any) -> Any:
    """Check ``value`` against the field's type; return it normalized (int -> float for
    float fields, tuples -> lists, a lone scalar -> one-element list as LMCache accepts)."""
    spec = _SPECS[key]
    if value is None:
        if spec.optional:
            return None
        raise _type_error(key, spec, value)
    kind = spec.kind
    if kind == "int":
        if _is_int(value):
            return value
    elif kind == "float":
        if _is_number(value):
            value = float(value)
            if math.isfinite(value):
                return value
            raise ConfigError(f"invalid value for '{key}': must be a finite number, got {value!r}")
    elif kind == "bool":
        if isinstance(value, bool):
            return value
    elif kind == "str":
        if isinstance(value, str):
            return value
    elif kind in ("list[int]", "list[float]"):
        elem_ok = _is_int if kind == "list[int]" else _is_number
        items = list(value) if isinstance(value, (list, tuple)) else [value]
        if all(elem_ok(x) for x in items):
            if kind == "list[float]":
                items = [float(x) for x in items]
            return items
    elif kind == "dict":
        if isinstance(value, Mapping):
            if all(isinstance(k, str) for k in value):
                return dict(value)
            raise ConfigError(f"invalid value for '{key}': keys must be strings, got {value!r}")
    raise _type_error(key, spec, value)


# ---------------------------------------------------------------------------------------
# Environment variable parsing
# ---------------------------------------------------------------------------------------
def _env_name(key: str) -> str:
    return ENV_PREFIX + key.upper()


def _unquote(s: str) -> str:
    t = s.strip()
    if len(t) >= 2 and t[0] == t[-1] and t[0] in "'\"":
        return t[1:-1]
    return s


def _parse_env(key: str, raw: str) -> Any:
    """Parse the text of ``LMCACHE_<KEY>`` by the field's type."""
    spec = _SPECS[key]
    var = _env_name(key)
    text = raw.strip()

    def fail(extra: str = "") -> ConfigError:
        return ConfigError(
            f"cannot parse environment variable {var}={raw!r}: expected {spec.describe()}"
            + (f" ({extra})" if extra else "")
        )

    if spec.optional and text.lower() in _NONE:
        return None
    kind = spec.kind
    if kind == "str":
        # Strings are kept as written (blend_special_str is " # # "), quotes removed.
        return _unquote(raw)
    if kind == "bool":
        low = text.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise fail("one of true/false/1/0/yes/no/on/off")
    if kind == "int":
        try:
            return int(text)
        except ValueError:
            raise fail() from None
    if kind == "float":
        try:
            return float(text)
        except ValueError:
            raise fail() from None
    if kind in ("list[int]", "list[float]"):
        conv = int if kind == "list[int]" else float
        if text.startswith("["):
            try:
                items = yaml.safe_load(text)
            except yaml.YAMLError as e:
                raise fail(str(e).splitlines()[0]) from None
            if not isinstance(items, list):
                raise fail()
        else:
            items = [p.strip() for p in text.split(",") if p.strip()]
        try:
            return [conv(x) if isinstance(x, str) else x for x in items]
        except ValueError:
            raise fail("comma-separated like 1,3 or a list like [1, 3]") from None
    if kind == "dict":
        try:
            value = yaml.safe_load(text)  # YAML is a superset of JSON
        except yaml.YAMLError as e:
            raise fail(str(e).splitlines()[0]) from None
        if not isinstance(value, dict):
            raise fail('a mapping like {"key": 1}')
        return value
    raise AssertionError(kind)  # pragma: no cover


def _env_values(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The config values set through ``LMCACHE_<FIELD>`` variables, parsed."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    field_vars = {_env_name(k): k for k in _SPECS}
    for var, raw in env.items():
        if not var.startswith(ENV_PREFIX):
            continue
        key = field_vars.get(var)
        if key is not None:
            values[key] = _parse_env(key, raw)
        elif var not in _NON_FIELD_ENV and var not in _warned_env:
            _warned_env.add(var)
            logger.warning(
                "ignoring unknown environment variable %s%s",
                var,
                _suggest(var, field_vars),
            )
    return values


# ---------------------------------------------------------------------------------------
# Files and overrides
# ---------------------------------------------------------------------------------------
def _read_yaml_mapping(path: str | os.PathLike) -> dict[str, Any]:
    p = os.fspath(path)
    try:
        with open(p, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config file {p!r}: {e.strerror or e}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"cannot parse config file {p!r} as YAML: {e}") from e
    if data is None:  # empty file
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {p!r} must hold a YAML mapping of config keys, "
            f"got {type(data).__name__}"
        )
    for k in data:
        if k not in _SPECS:
            raise _unknown_key(k, f"config file {p!r}")
    return data


def _strip_override_prefix(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Accept ``{"chunk_size": 256}`` and ``{"lmcache.chunk_size": 256}`` alike."""
    out: dict[str, Any] = {}
    for raw_key, value in overrides.items():
        if not isinstance(raw_key, str):
            raise _unknown_key(raw_key, "overrides")
        key = raw_key[len(OVERRIDE_PREFIX):] if raw_key.startswith(OVERRIDE_PREFIX) else raw_key
        if key not in _SPECS:
            raise _unknown_key(raw_key, "overrides", bare=key)
        if key in out and out[key] != value:
            raise ConfigError(
                f"config key '{key}' is given twice in overrides with different values "
                f"({out[key]!r} and {value!r}, with and without the '{OVERRIDE_PREFIX}' prefix)"
            )
        out[key] = value
    return out


def _check_keys(values: Mapping[str, Any], source: str) -> None:
    for k in values:
        if k not in _SPECS:
            raise _unknown_key(k, source)


def _redact_url(url: str) -> str:
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return parts._replace(netloc=f"{user}:***@{netloc}").geturl()


# ---------------------------------------------------------------------------------------
# The config
# ---------------------------------------------------------------------------------------
@dataclass
class LMCacheEngineConfig:
    """Configuration of an LMCache engine (field names and defaults as in LMCache).

    Constructors: ``LMCacheEngineConfig(...)`` / :meth:`from_defaults` (defaults plus
    keyword overrides), :meth:`from_dict`, :meth:`from_file` (a YAML mapping),
    :meth:`from_env` (``LMCACHE_<FIELD>`` variables) and :meth:`load`. Every one of
    them validates; an invalid value raises :class:`ConfigError` (a ``ValueError``)
    whose message names the key and the accepted values.

    Resolution order of :meth:`load` (later wins, key by key)::

        1. the defaults below
        2. the YAML file named by ``LMCACHE_CONFIG_FILE`` (if set)
        3. ``LMCACHE_<FIELD>`` environment variables (e.g. ``LMCACHE_CHUNK_SIZE=512``)
        4. ``overrides`` (vLLM's ``kv_connector_extra_config``; keys with or without
           the ``lmcache.`` prefix)

    Validation runs once on the merged result, so constraints spanning two keys
    (``enable_blending`` needs ``use_layerwise``) may be satisfied across sources.
    Unlike LMCache (whose docs say env vars are ignored when a file is set), a file
    and env vars combine here.

    Environment values are parsed by the field's type: bools accept
    true/false/1/0/yes/no/on/off, lists accept ``1,3`` or ``[1, 3]``, ``extra_config``
    is YAML/JSON, and ``none``/``null``/empty mean None for optional fields.
    ``LMCACHE_*`` variables that are not fields are ignored (unknown ones are logged
    once as a warning).
    """

    # Tokens per chunk; a positive power of two.
    chunk_size: int = 256
    # CPU (pinned memory) tier.
    local_cpu: bool = True
    max_local_cpu_size: float = 5.0  # GB
    # Disk tier: a directory ("file:///path" or "/path"); needs max_local_disk_size > 0.
    local_disk: str | None = None
    max_local_disk_size: float = 0.0  # GB
    # Remote tier: lm://host:port, redis://host:port[/db], rediss://..., valkey://...
    remote_url: str | None = None
    remote_serde: str = "naive"  # "naive" | "lz4"
    # Not an LMCache field; kept out of repr() and redacted in summary()/to_dict(redact=True).
    remote_auth_token: str | None = field(default=None, repr=False)
    blocking_timeout_secs: float = 10.0
    # Layerwise pipelining and CacheBlend.
    use_layerwise: bool = False
    enable_blending: bool = False
    # LMCache stores None for these two and documents 0.15 and 1 as the effective defaults.
    blend_recompute_ratios: list[float] = field(default_factory=lambda: [0.15])
    blend_check_layers: list[int] = field(default_factory=lambda: [1])
    blend_min_tokens: int = 256
    blend_special_str: str = " # # "
    # What to store.
    save_decode_cache: bool = False
    # LMCache's current default is False (older releases had True); blending forces True.
    save_unfull_chunk: bool = False
    enable_async_loading: bool = False
    # Scheduler-side lookup RPC timeout.
    lookup_timeout_ms: int = 3000
    # Not an LMCache field: each process serving an engine exports lmcache_triton_* metrics on
    # http://0.0.0.0:(prometheus_port + rank)/metrics. None: no HTTP server (the metrics still join
    # vLLM's own /metrics when PROMETHEUS_MULTIPROC_DIR is set).
    prometheus_port: int | None = None
    # Not LMCache fields. The longest a lookup's pins may hold chunks in the CPU tier: a load
    # normally follows within one scheduler step, and a lookup whose request was aborted, timed
    # out or never scheduled must not hold tier capacity for good (expired leases are counted).
    pin_lease_secs: float = 30.0
    # The share of hits (0..1) that vLLM recomputes instead of loading, to compare the computed KV
    # with the stored chunk (a canary: a mismatch is counted, logged and the chunk removed).
    verify_hit_rate: float = 0.0
    # Keys carry a keyed digest of each request's cache_salt, never the salt. Set the same secret
    # on every instance that shares a store to make those digests unguessable too.
    namespace_secret: str | None = field(default=None, repr=False)
    extra_config: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> LMCacheEngineConfig:
        """Check (and normalize in place) every field; raise :class:`ConfigError`."""
        for key in _SPECS:
            setattr(self, key, _coerce(key, getattr(self, key)))

        cs = self.chunk_size
        if cs <= 0 or cs & (cs - 1):
            raise ConfigError(
                f"invalid value for 'chunk_size': must be a positive power of two "
                f"(e.g. 16, 64, 256, 512), got {cs!r}"
            )
        for key in ("max_local_cpu_size", "max_local_disk_size", "blend_min_tokens"):
            if getattr(self, key) < 0:
                raise ConfigError(
                    f"invalid value for '{key}': must be >= 0, got {getattr(self, key)!r}"
                )
        if not 0.0 <= self.verify_hit_rate <= 1.0:
            raise ConfigError(
                f"invalid value for 'verify_hit_rate': must be in [0, 1], got {self.verify_hit_rate!r}"
            )
        for key in ("blocking_timeout_secs", "lookup_timeout_ms", "pin_lease_secs"):
            if getattr(self, key) <= 0:
                raise ConfigError(
                    f"invalid value for '{key}': must be > 0, got {getattr(self, key)!r}"
                )

        if self.prometheus_port is not None and not 1 <= self.prometheus_port <= 65535:
            raise ConfigError(
                f"invalid value for 'prometheus_port': must be a TCP port in 1..65535 or None, "
                f"got {self.prometheus_port!r}"
            )

        self.local_disk = self._normalize_local_disk(self.local_disk)
        if self.local_disk is not None and self.max_local_disk_size <= 0:
            raise ConfigError(
                f"'local_disk' is set ({self.local_disk!r}) but 'max_local_disk_size' is "
                f"{self.max_local_disk_size!r}: set max_local_disk_size to a size in GB > 0, "
                f"or unset local_disk"
            )

        if self.remote_url is not None:
            self._check_remote_url(self.remote_url)
        if self.remote_serde not in REMOTE_SERDES:
            raise ConfigError(
                f"invalid value for 'remote_serde': must be one of "
                f"{', '.join(map(repr, REMOTE_SERDES))}, got {self.remote_serde!r}"
            )

        if not self.blend_recompute_ratios:
            raise ConfigError(
                "invalid value for 'blend_recompute_ratios': "
                "must be a non-empty list of floats in [0, 1]"
            )
        for r in self.blend_recompute_ratios:
            if not 0.0 <= r <= 1.0:
                raise ConfigError(
                    f"invalid value for 'blend_recompute_ratios': each ratio must be in [0, 1], "
                    f"got {self.blend_recompute_ratios!r}"
                )
        if not self.blend_check_layers:
            raise ConfigError(
                "invalid value for 'blend_check_layers': "
                "must be a non-empty list of layer indices >= 0"
            )
        if any(layer < 0 for layer in self.blend_check_layers):
            raise ConfigError(
                f"invalid value for 'blend_check_layers': each layer index must be >= 0, "
                f"got {self.blend_check_layers!r}"
            )
        if self.enable_blending:
            if not self.use_layerwise:
                raise ConfigError(
                    "'enable_blending' = True requires 'use_layerwise' = True "
                    "(CacheBlend recomputes layer by layer)"
                )
            if not self.save_unfull_chunk:
                # As LMCache does: blending needs the last, partial chunk of each segment.
                logger.warning("setting save_unfull_chunk=True because enable_blending=True")
                self.save_unfull_chunk = True
        return self

    @staticmethod
    def _normalize_local_disk(value: str | None) -> str | None:
        if value is None:
            return None
        path = value
        if path.startswith("file://"):
            path = path[len("file://"):]
        elif "://" in path:
            raise ConfigError(
                f"invalid value for 'local_disk': must be a directory path or a "
                f"'file:///path' URL, got {value!r}"
            )
        if not path.strip():
            raise ConfigError(
                f"invalid value for 'local_disk': must be a non-empty directory path "
                f"('/path' or 'file:///path') or None, got {value!r}"
            )
        return path

    @staticmethod
    def _check_remote_url(url: str) -> None:
        accepted = (
            "lm://host:port, redis://host:port[/db], rediss://host:port[/db], "
            "valkey://host:port[/db]"
        )

        def bad(why: str) -> ConfigError:
            return ConfigError(
                f"invalid value for 'remote_url': {why}; accepted forms: {accepted}, got {url!r}"
            )

        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as e:
            raise bad(str(e)) from None
        if parts.scheme not in REMOTE_SCHEMES:
            raise bad(f"unsupported scheme {parts.scheme!r}" if parts.scheme else "no scheme")
        if not parts.hostname:
            raise bad("missing host")
        if parts.scheme == "lm":
            if port is None:
                raise bad("missing port")
            if parts.path not in ("", "/"):
                raise bad("lm:// URLs take no path")
        else:
            db = parts.path.strip("/")
            if db and not db.isdigit():
                raise bad(f"the database must be a number, got {db!r}")
        if parts.query or parts.fragment:
            raise bad("no query or fragment allowed")

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_defaults(cls, **overrides: Any) -> LMCacheEngineConfig:
        """The defaults, with ``overrides`` (field names) applied; validated."""
        _check_keys(overrides, "overrides")
        return cls(**overrides)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> LMCacheEngineConfig:
        """Defaults plus a mapping of field names (e.g. the output of :meth:`to_dict`)."""
        return cls.from_defaults(**dict(values))

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> LMCacheEngineConfig:
        """Defaults plus the keys of the YAML mapping at ``path``."""
        return cls(**_read_yaml_mapping(path))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> LMCacheEngineConfig:
        """Defaults plus ``LMCACHE_<FIELD>`` variables (of ``os.environ`` by default)."""
        return cls(**_env_values(environ))

    @classmethod
    def load(
        cls,
        overrides: Mapping[str, Any] | None = None,
        *,
        config_file: str | os.PathLike | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> LMCacheEngineConfig:
        """defaults < config file < ``LMCACHE_*`` env vars < ``overrides``.

        The file is ``config_file`` if given, else ``$LMCACHE_CONFIG_FILE`` if set and
        non-empty. ``overrides`` keys may carry the ``lmcache.`` prefix.
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        path = config_file if config_file is not None else (env.get(CONFIG_FILE_ENV) or None)
        if path is not None:
            values.update(_read_yaml_mapping(path))
        values.update(_env_values(env))
        if overrides:
            values.update(_strip_override_prefix(overrides))
        return cls(**values)

    # ------------------------------------------------------------------ views
    def to_dict(self, redact: bool = False) -> dict[str, Any]:
        """All fields as a plain dict (lists/dicts copied); ``redact`` hides secrets."""
        d = {k: _copy(getattr(self, k)) for k in _SPECS}
        if redact:
            for secret in ("remote_auth_token", "namespace_secret"):
                if d[secret] is not None:
                    d[secret] = "***"
            if d["remote_url"] is not None:
                d["remote_url"] = _redact_url(d["remote_url"])
        return d

    def replace(self, **changes: Any) -> LMCacheEngineConfig:
        """A validated copy with ``changes`` applied."""
        _check_keys(changes, "replace()")
        values = self.to_dict()
        values.update(changes)
        return type(self)(**values)

    def summary(self) -> str:
        """A compact one-line description for log lines (secrets redacted)."""
        d = self.to_dict(redact=True)
        defaults = _defaults()
        parts = [f"chunk_size={d['chunk_size']}"]
        parts.append(f"cpu={d['max_local_cpu_size']:g}GB" if d["local_cpu"] else "cpu=off")
        if d["local_disk"]:
            parts.append(f"disk={d['local_disk']}({d['max_local_disk_size']:g}GB)")
        else:
            parts.append("disk=off")
        if d["remote_url"]:
            parts.append(f"remote={d['remote_url']}({d['remote_serde']})")
        else:
            parts.append("remote=off")
        shown = {"chunk_size", "local_cpu", "max_local_cpu_size", "local_disk",
                 "max_local_disk_size", "remote_url", "remote_serde"}
        for k, v in d.items():
            if k not in shown and v != defaults[k]:
                parts.append(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}")
        return "LMCacheEngineConfig(" + " ".join(parts) + ")"

    def __str__(self) -> str:
        return self.summary()

    def get_extra_config_value(self, key: str, default: Any = None) -> Any:
        """``extra_config[key]``, or ``default`` (LMCache has the same helper)."""
        return (self.extra_config or {}).get(key, default)


def _copy(v: Any) -> Any:
    return copy.deepcopy(v) if isinstance(v, (list, dict)) else v


def _defaults() -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(LMCacheEngineConfig):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        else:
            out[f.name] = f.default_factory()  # type: ignore[misc]
    return out
