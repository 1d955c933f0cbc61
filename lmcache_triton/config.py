"""Engine configuration: the declaration of :class:`LMCacheEngineConfig`.

The field names, meanings and (where LMCache has them) defaults follow LMCache's
``lmcache/v1/config.py`` so that an LMCache YAML file or set of ``LMCACHE_*`` variables
works here unchanged for the options this package implements. LMCache's other names are
mapped, ignored with a warning that says why, or refused: see
:data:`lmcache_triton.lmcache_compat.LMCACHE_NAMES`.

Each field is declared once, in the class body: its annotation is its type, and :func:`option`
holds its default, its doc and the values it accepts. Coercion, the checks, the parsing of
``LMCACHE_*`` variables, redaction and the field reference (:func:`reference`, in the README) are
all derived from that declaration (``_FIELDS``). A config is frozen once built: change one with
:meth:`LMCacheEngineConfig.replace`, which returns a new, validated config.

This module holds the declaration and the constructors; the rest lives in rooms of one concern
each, all on the lowest floor with this one (the standard library and PyYAML only, nothing done
at import): the field framework (:mod:`~lmcache_triton.config_fields`), LMCache's names and the
connector's keys (:mod:`~lmcache_triton.lmcache_compat`), environment variables and YAML files
(:mod:`~lmcache_triton.config_sources`), and the remote_url schemes and their redaction
(:mod:`~lmcache_triton.remote_url`, which storage/ reads too).
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lmcache_triton import lmcache_compat
from lmcache_triton.config_fields import ConfigError, Field, build_fields, field_reference, option, thaw, unknown_key
from lmcache_triton.config_sources import CONFIG_FILE_ENV, env_values, read_yaml_mapping
from lmcache_triton.lmcache_compat import strip_override_prefix, warn_once, why_refused
from lmcache_triton.remote_url import named_like_secret, redact_url, remote_url_forms, remote_url_problem

__all__ = ["ConfigError", "LMCacheEngineConfig", "connector_overrides", "reference"]


# ---------------------------------------------------------------------------------------
# The checks and normal forms of single fields (option(check=, normalize=, redact=))
# ---------------------------------------------------------------------------------------
def _redact_secret_keys(mapping: Mapping[str, Any]) -> dict[str, Any]:
    return {k: "***" if isinstance(k, str) and named_like_secret(k) else v
            for k, v in mapping.items()}


def _power_of_two(value: int) -> str | None:
    if value <= 0 or value & (value - 1):
        return "must be a positive power of two (e.g. 16, 64, 256, 512)"
    return None


def _disk_path(value: str) -> str:
    """local_disk as a path: a ``file://`` URL is stored as its path (the same directory)."""
    path = value[len("file://"):] if value.startswith("file://") else value
    if "://" in path:
        raise ConfigError(f"invalid value for 'local_disk': must be a directory path or a "
                          f"'file:///path' URL, got {value!r}")
    if not path.strip():
        raise ConfigError(f"invalid value for 'local_disk': must be a non-empty directory path "
                          f"('/path' or 'file:///path') or None, got {value!r}")
    return path


# ---------------------------------------------------------------------------------------
# The config
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True, repr=False)
class LMCacheEngineConfig:
    """Configuration of an LMCache engine (field names and defaults as in LMCache).

    Constructors: ``LMCacheEngineConfig(...)`` / :meth:`from_defaults` (defaults plus
    keyword overrides), :meth:`from_dict`, :meth:`from_file` (a YAML mapping),
    :meth:`from_env` (``LMCACHE_<FIELD>`` variables) and :meth:`load`. Every one of
    them validates; an invalid value raises :class:`ConfigError` (a ``ValueError``)
    whose message names the key and the accepted values. The config they return is frozen
    (assigning a field raises ``dataclasses.FrozenInstanceError``; list fields are tuples and
    ``extra_config`` a read-only dict), hashable, and equal to another exactly when every
    field is: :meth:`replace` makes a changed, validated copy.

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
    once as a warning). :meth:`from_file`, :meth:`from_env` and :meth:`load` also take
    LMCache's other names (``lmcache_compat.LMCACHE_NAMES``: mapped, or ignored with a warning, or refused);
    ``__init__``, :meth:`from_defaults` and :meth:`from_dict` take field names only.

    Validation reports and never rewrites: a value is stored as given, or in a normal form of the
    same meaning (``2`` -> ``2.0`` for a float, ``[1, 3]`` -> ``(1, 3)``, ``0.15`` -> ``(0.15,)``
    for a list, ``file:///x`` -> ``/x``), or refused. The one value the config picks itself is
    that of ``save_unfull_chunk`` when it is not given (see its doc): that is logged.
    """

    chunk_size: int = option(256, "Tokens per chunk.", check=_power_of_two, accepted="a positive power of two")
    local_cpu: bool = option(True, "Keep chunks in the CPU tier (one pinned-memory pool).")
    max_local_cpu_size: float = option(5.0, "Size of the CPU tier, GB.", ge=0)
    local_disk: str | None = option(
        None, "Directory of the disk tier ('/path', or 'file:///path', stored as the path); needs "
        "max_local_disk_size > 0.", normalize=_disk_path)
    max_local_disk_size: float = option(0.0, "Size of the disk tier, GB.", ge=0)
    remote_url: str | None = option(
        None, "The remote tier: the cache server here (lm://), Redis / Valkey, or a Redis Cluster / "
        "Valkey cluster (several seed nodes). A password in it is "
        "redacted wherever the URL is shown.", check=remote_url_problem, accepted=remote_url_forms(),
        redact=redact_url)
    remote_serde: str = option("naive", "How chunks are encoded for the remote tier (lz4: lossless).",
                               choices=("naive", "lz4"))
    remote_auth_token: str | None = option(
        None, "The remote tier's token: the cache server's, or the Redis password when remote_url has "
        "none.", secret=True, ours=True)
    blocking_timeout_secs: float = option(10.0, "The longest one remote call may take, seconds.", gt=0)
    use_layerwise: bool | None = option(
        None, "Load and store layer by layer, pipelined with the forward pass. Not given (None): true "
        "with enable_blending (CacheBlend blends layer by layer; logged), else false. False with "
        "enable_blending is an error.")
    enable_blending: bool = option(False, "CacheBlend: reuse chunks that are not a prefix; turns "
                                          "use_layerwise on.")
    blend_recompute_ratios: tuple[float, ...] = option(
        (0.15,), "CacheBlend: the share of tokens recomputed after each check layer (LMCache stores "
        "None and documents 0.15).", ge=0, le=1, nonempty=True)
    blend_check_layers: tuple[int, ...] = option(
        (1,), "CacheBlend: the layers where the tokens to recompute are chosen (LMCache stores None "
        "and documents 1).", ge=0, nonempty=True)
    blend_min_tokens: int = option(256, "CacheBlend: the fewest tokens a segment needs to be cached "
                                        "on its own.", ge=0)
    blend_special_str: str = option(" # # ", "CacheBlend: the text that separates a prompt's segments.")
    save_decode_cache: bool = option(False, "Also store the KV of generated tokens.")
    enable_pd: bool = option(
        False, "Prefill/decode disaggregation: a sender (prefill instance) sends each prompt's chunks to "
        "the receiver (decode instance) that a request's kv_transfer_params.disagg_spec names; needs "
        "pd_role. Both sides save the prompt's partial last chunk (save_unfull_chunk defaults to true).")
    pd_role: str | None = option(None, "With enable_pd: 'sender' (the prefill instance, kv_role kv_producer) "
                                       "or 'receiver' (the decode instance, kv_role kv_consumer).",
                                 choices=("sender", "receiver"))
    pd_peer_host: str | None = option(
        None, "PD receiver: the address its transfer listener binds (one per worker rank).",
        check=lambda v: "must not be empty" if not v.strip() else None, accepted="a host name or address")
    pd_peer_init_port: tuple[int, ...] | None = option(
        None, "PD receiver: the TCP port of each worker rank's listener (one port per rank; a single "
        "port P means P + rank). The proxy tells the sender the same ports.", ge=1, le=65535, nonempty=True)
    pd_buffer_size: int | None = option(
        None, "PD receiver: bytes of received chunks it holds (its CPU tier's size; None: "
        "max_local_cpu_size). When full the least recently used unheld chunks make room.", gt=0)
    enable_offload_server: bool = option(
        False, "Each worker rank serves offload requests (store these slots under these chunk hashes) on an "
        "owner-only IPC socket; whoever reaches it decides what is stored under which hash.")
    save_unfull_chunk: bool | None = option(
        None, "Store the partial last chunk of a prompt. Not given (None): true with enable_blending "
        "(CacheBlend needs each segment's partial chunk; LMCache forces it too, logged), else false as "
        "in current LMCache. False with enable_blending is an error.")
    enable_async_loading: bool = option(False, "Lookups answer 'not yet' instead of waiting for every "
                                               "rank; vLLM asks again at a later step.")
    lookup_timeout_ms: int = option(3000, "Scheduler-side lookup RPC timeout, ms.", gt=0)
    load_policy: str = option(
        "cost", "'cost': load a hit only where the measured cost of loading it (each tier's latency and "
        "throughput) beats recomputing it (vLLM's measured prefill time) by load_margin, and stop a "
        "load that overruns its deadline; 'always': load every hit.", choices=("cost", "always"), ours=True)
    load_margin: float = option(
        0.25, "load_policy cost: load when the estimated load time x (1 + load_margin) is at most the "
        "estimated recompute time.", ge=0, ours=True)
    load_deadline_factor: float = option(
        2.0, "load_policy cost: a load stops once it runs this many times past its estimate (at least "
        "50 ms past): what arrived is used, vLLM computes the rest.", ge=1, ours=True)
    load_deadline_ms: float | None = option(
        None, "An absolute limit on any load from a lower tier, ms (with either load_policy); None: "
        "load_deadline_factor alone (and lookup_timeout_ms).", gt=0, ours=True)
    kv_load_failure_policy: str = option(
        "recompute", "What vLLM does with a request whose chunks fail to load after the lookup found "
        "them: 'recompute' (the connector sets vLLM's kv_load_failure_policy to it): vLLM computes the "
        "blocks reported, the request goes on; 'fail': the request ends with an error. vLLM's own field "
        "defaults to 'fail' and cannot say whether a user set it, so this one decides.",
        choices=("recompute", "fail"), ours=True)
    prometheus_port: int | None = option(
        None, "Each process serving an engine exports its lmcache_triton metrics on "
        "http://0.0.0.0:(prometheus_port + rank)/metrics. None: no HTTP server (the metrics still join "
        "vLLM's own /metrics when PROMETHEUS_MULTIPROC_DIR is set).", ge=1, le=65535, ours=True)
    reservation_lease_secs: float = option(
        30.0, "The longest a lookup's reservation may hold chunks in the CPU tier: a load normally "
        "follows within one scheduler step; an aborted or unscheduled request must not hold tier "
        "capacity for good (expired leases are counted).", gt=0, ours=True)
    verify_hit_rate: float = option(
        0.0, "The share of hits that vLLM recomputes instead of loading, to compare the computed KV "
        "with the stored chunk (a canary: a mismatch is counted, logged and the chunk removed).",
        ge=0, le=1, ours=True)
    namespace_secret: str | None = option(
        None, "Keys carry a keyed digest of each request's cache_salt, never the salt; set the same "
        "secret on every instance that shares a store to make those digests unguessable too.",
        secret=True, ours=True)
    extra_config: dict[str, Any] | None = option(
        None, "Free-form settings, as LMCache's (stored read-only; see get_extra_config_value). Values "
        "of keys named like secrets (password, token...) are redacted.", redact=_redact_secret_keys)

    def __post_init__(self) -> None:
        # Types and normal forms (see the class doc), before the instance is handed out.
        for f in _FIELDS.values():
            object.__setattr__(self, f.name, f.coerce(getattr(self, f.name)))
        # The fields the config fills in itself, when not given; remembered so that replace()
        # resolves them anew rather than carrying the values picked here.
        unset = frozenset(name for name in ("save_unfull_chunk", "use_layerwise") if getattr(self, name) is None)
        if "save_unfull_chunk" in unset:
            # PD: the decoder then loads all but the prompt's last token (LMCache's PD configs set it)
            object.__setattr__(self, "save_unfull_chunk", self.enable_blending or self.enable_pd)
        if "use_layerwise" in unset:
            # LMCache's published blending config (benchmarks/rag/example_blending.yaml) sets
            # enable_blending alone; LMCache 0.5.6 accepts it and then does not blend (its blending
            # runs on the layerwise path only). What the user meant is blending: turn it on, say so.
            object.__setattr__(self, "use_layerwise", self.enable_blending)
        object.__setattr__(self, "_unset", unset)
        self.validate()
        if self.enable_blending:
            auto = [name for name in ("use_layerwise", "save_unfull_chunk") if name in unset]
            if auto:
                warn_once("blending=auto:" + ",".join(auto), (
                    f"setting {' and '.join(f'{name}=True' for name in auto)} because enable_blending=True "
                    "(CacheBlend blends layer by layer and stores each segment's partial last chunk; "
                    f"LMCache forces save_unfull_chunk too); set {' and '.join(f'{n}: true' for n in auto)} "
                    "to silence this"))

    # ------------------------------------------------------------------ validation
    def validate(self) -> LMCacheEngineConfig:
        """Check every field and the constraints between fields; raise :class:`ConfigError`.
        Changes nothing (the config is frozen); returns ``self``."""
        for f in _FIELDS.values():
            f.check(getattr(self, f.name))
        if self.local_disk is not None and self.max_local_disk_size <= 0:
            raise ConfigError(
                f"'local_disk' is set ({self.local_disk!r}) but 'max_local_disk_size' is "
                f"{self.max_local_disk_size!r}: set max_local_disk_size to a size in GB > 0, "
                f"or unset local_disk"
            )
        if self.enable_blending and not self.use_layerwise:
            # Not turned on silently: false was asked for (left unset, it is true with blending).
            raise ConfigError(
                "'use_layerwise' = False conflicts with 'enable_blending' = True (CacheBlend "
                "recomputes layer by layer; LMCache too blends only on its layerwise path): remove "
                "use_layerwise (with blending it then defaults to true) or set it true "
                "(LMCACHE_USE_LAYERWISE=true), or turn enable_blending off"
            )
        if self.enable_pd:
            if self.pd_role is None:
                raise ConfigError("'enable_pd' = True needs 'pd_role': 'sender' (the prefill instance) or "
                                  "'receiver' (the decode instance)")
            if self.pd_role == "receiver" and (self.pd_peer_host is None or self.pd_peer_init_port is None):
                raise ConfigError(
                    "'pd_role' = 'receiver' needs 'pd_peer_host' (the address its listener binds) and "
                    "'pd_peer_init_port' (one port per worker rank, or a base port: base + rank)")
            if self.use_layerwise or self.enable_blending:
                raise ConfigError("'enable_pd' = True does not work with use_layerwise or enable_blending here: "
                                  "prefill/decode disaggregation moves whole chunks of a prefix")
        if self.enable_blending and not self.save_unfull_chunk:
            # Not turned on silently (LMCache does): false was asked for, and the config must either
            # be what was asked for or fail. Left unset, it is true with blending (__post_init__).
            raise ConfigError(
                "'save_unfull_chunk' = False conflicts with 'enable_blending' = True (CacheBlend "
                "stores each segment's partial last chunk): remove save_unfull_chunk (with "
                "blending it then defaults to true) or set it true, or turn enable_blending off; "
                "kv_connector_extra_config's discard_partial_chunks: true also means "
                "save_unfull_chunk=False"
            )
        return self

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
        return cls(**read_yaml_mapping(path, _FIELDS))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> LMCacheEngineConfig:
        """Defaults plus ``LMCACHE_<FIELD>`` variables (of ``os.environ`` by default)."""
        return cls(**env_values(_FIELDS, environ))

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
            values.update(read_yaml_mapping(path, _FIELDS))
        values.update(env_values(_FIELDS, env))
        if overrides:
            values.update(strip_override_prefix(overrides, _FIELDS))
        return cls(**values)

    def replace(self, **changes: Any) -> LMCacheEngineConfig:
        """A new, validated config with ``changes`` (field names) applied. A field this config
        filled in itself (``save_unfull_chunk`` not given) is resolved anew for the copy."""
        _check_keys(changes, "replace()")
        values = {name: getattr(self, name) for name in _FIELDS if name not in self._unset}
        values.update(changes)
        return type(self)(**values)

    # ------------------------------------------------------------------ views
    def to_dict(self, redact: bool = False) -> dict[str, Any]:
        """All fields as a plain dict of plain values (lists, dicts; copies); ``redact`` hides
        secrets: the secret fields, remote_url's password, extra_config keys named like secrets."""
        d = {name: thaw(getattr(self, name)) for name in _FIELDS}
        if redact:
            for name, f in _FIELDS.items():
                d[name] = f.shown(d[name])
        return d

    def summary(self) -> str:
        """A compact one-line description for log lines (secrets redacted)."""
        d = self.to_dict(redact=True)
        defaults = LMCacheEngineConfig().to_dict(redact=True)
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

    def __repr__(self) -> str:  # every field, secrets redacted (remote_url's password too)
        shown = ", ".join(f"{name}={f.shown(getattr(self, name))!r}" for name, f in _FIELDS.items())
        return f"{type(self).__name__}({shown})"

    @property
    def pd_receiver(self) -> bool:
        return self.enable_pd and self.pd_role == "receiver"

    @property
    def pd_sender(self) -> bool:
        return self.enable_pd and self.pd_role == "sender"

    @property
    def cpu_tier_bytes(self) -> int:
        """The CPU tier's size: a PD receiver's is its receive buffer, pd_buffer_size when given."""
        if self.pd_receiver and self.pd_buffer_size is not None:
            return self.pd_buffer_size
        return int(self.max_local_cpu_size * (1 << 30))

    def get_extra_config_value(self, key: str, default: Any = None) -> Any:
        """``extra_config[key]``, or ``default`` (LMCache has the same helper)."""
        return (self.extra_config or {}).get(key, default)


def _refuse_assignment(self: LMCacheEngineConfig, name: str, value: Any = None) -> None:
    raise dataclasses.FrozenInstanceError(
        f"cannot set or delete {name!r}: an LMCacheEngineConfig is frozen once built; "
        f"use config.replace({name}=...) for a new, validated config"
    )


# The dataclass's own refusal, with the way out in the message (its __init__ and __post_init__
# set fields through object.__setattr__, as frozen dataclasses do).
LMCacheEngineConfig.__setattr__ = _refuse_assignment  # type: ignore[method-assign,assignment]
LMCacheEngineConfig.__delattr__ = _refuse_assignment  # type: ignore[method-assign,assignment]


# The field table, derived from the declaration above.
_FIELDS: dict[str, Field] = build_fields(LMCacheEngineConfig, why_refused())


def reference() -> str:
    """The fields as a Markdown table (name, type, default, accepted values, doc): the README's."""
    return field_reference(_FIELDS)


def connector_overrides(extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """The config overrides in vLLM's ``kv_connector_extra_config``, as LMCache's connector reads
    them: ``lmcache.<key>`` keys, plus the keys it reads without the prefix (mapped or warned
    about; see :func:`lmcache_triton.lmcache_compat.connector_overrides`)."""
    return lmcache_compat.connector_overrides(extra, _FIELDS)


def _check_keys(values: Mapping[str, Any], source: str) -> None:
    for k in values:
        if k not in _FIELDS:
            raise unknown_key(k, _FIELDS, source)
