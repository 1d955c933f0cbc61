"""Where a config's values come from outside Python: ``LMCACHE_<FIELD>`` environment variables
(:func:`env_values`, each text parsed by its field's type: :func:`parse_env`) and YAML files
(:func:`read_yaml_mapping`). LMCache's names met there are applied through
:mod:`lmcache_triton.lmcache_compat`.

Its own module because reading text is a concern apart from declaring the fields
(:mod:`lmcache_triton.config`) and from LMCache's vocabulary: every function takes the field table
it reads into. Standard library, PyYAML and the config modules below it only; nothing happens at
import (the environment is read when a config is loaded).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from typing import Any

import yaml

from lmcache_triton.config_fields import FALSE_WORDS, NONE_WORDS, TRUE_WORDS, ConfigError, Field, unquote
from lmcache_triton.lmcache_compat import (
    LMCACHE_ENV_ONLY, LMCACHE_NAMES, Compat, apply_compat, translate, translate_values, warn_once,
)

__all__ = ["CONFIG_FILE_ENV", "ENV_PREFIX", "env_name", "env_values", "parse_env", "read_yaml_mapping"]

ENV_PREFIX = "LMCACHE_"
CONFIG_FILE_ENV = "LMCACHE_CONFIG_FILE"

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


def env_name(key: str) -> str:
    """The environment variable of the field ``key``: ``LMCACHE_<KEY>``."""
    return ENV_PREFIX + key.upper()


def parse_env(f: Field, raw: str) -> Any:
    """Parse the text of ``LMCACHE_<FIELD>`` by the field's type (the field's checks come later,
    when the config is built)."""
    var = env_name(f.name)
    text = raw.strip()

    def fail(extra: str = "") -> ConfigError:
        return ConfigError(
            f"cannot parse environment variable {var}={raw!r}: expected {f.describe()}"
            + (f" ({extra})" if extra else "")
        )

    if f.optional and text.lower() in NONE_WORDS:
        return None
    kind = f.kind
    if kind == "str":
        # Strings are kept as written (blend_special_str is " # # "), quotes removed.
        return unquote(raw)
    if kind == "bool":
        low = text.lower()
        if low in TRUE_WORDS:
            return True
        if low in FALSE_WORDS:
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


def env_values(fields: Mapping[str, Field], environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The values of ``fields`` set through ``LMCACHE_<FIELD>`` variables (of ``os.environ`` by
    default), parsed; LMCache's other variables (``LMCACHE_NAMES``, ``LMCACHE_ENV_ONLY``) mapped,
    warned about or refused; unknown ones warned about once."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    compat: list[tuple[str, Compat, str]] = []
    field_vars = {env_name(k): k for k in fields}
    for var, raw in env.items():
        if not var.startswith(ENV_PREFIX):
            continue
        key = field_vars.get(var)
        if key is not None:
            values[key] = parse_env(fields[key], raw)
            continue
        if var in _NON_FIELD_ENV:
            continue
        entry = LMCACHE_NAMES.get(var[len(ENV_PREFIX):].lower()) or LMCACHE_ENV_ONLY.get(var)
        if entry is not None:
            compat.append((var, entry, raw))
        else:
            match = difflib.get_close_matches(var[len(ENV_PREFIX):].lower(), list(fields), n=1, cutoff=0.6)
            hint = f"; did you mean '{env_name(match[0])}'?" if match else ""
            warn_once(var, f"ignoring unknown environment variable {var}{hint}")
    translate_values(values, "environment")
    for var, entry, raw in compat:  # after the fields, so an alias meets its target's value
        apply_compat(var, entry, raw, "", values, fields, parse=parse_env)
    return values


def read_yaml_mapping(path: str | os.PathLike, fields: Mapping[str, Field]) -> dict[str, Any]:
    """The values of ``fields`` in the YAML mapping at ``path``; LMCache's other names applied."""
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
    return translate(data, f"config file {p!r}", fields)

