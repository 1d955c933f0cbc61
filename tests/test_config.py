"""Tests of lmcache_triton.config (CPU only; no torch, except the remote_url tests, which import storage/)."""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from lmcache_triton import config as config_mod
from lmcache_triton.config import ConfigError, LMCacheEngineConfig
from lmcache_triton.remote_url import CLUSTER_PROTOCOLS, REMOTE_SCHEMES, redact_url, remote_url_forms


pytestmark = pytest.mark.usefixtures("clean_lmcache_env")


def write(tmp_path, text, name="cfg.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


# ------------------------------------------------------------------ defaults


def test_defaults_match_lmcache():
    c = LMCacheEngineConfig()
    assert c == LMCacheEngineConfig.from_defaults()
    assert c.chunk_size == 256
    assert c.local_cpu is True
    assert c.max_local_cpu_size == 5.0
    assert c.local_disk is None and c.max_local_disk_size == 0.0
    assert c.remote_url is None and c.remote_serde == "naive" and c.remote_auth_token is None
    assert c.blocking_timeout_secs == 10.0
    assert c.use_layerwise is False and c.enable_blending is False
    assert c.blend_recompute_ratios == (0.15,) and c.blend_check_layers == (1,)
    assert c.blend_min_tokens == 256 and c.blend_special_str == " # # "
    assert c.save_decode_cache is False
    assert c.save_unfull_chunk is False
    assert c.enable_async_loading is False
    assert c.lookup_timeout_ms == 3000
    assert c.extra_config is None


def test_lists_are_tuples_and_extra_config_read_only():
    # Replaces test_default_lists_not_shared: nothing of a config can change, shared or not.
    c = LMCacheEngineConfig.from_defaults(blend_check_layers=[1, 3], extra_config={"a": {"b": [1]}})
    assert c.blend_check_layers == (1, 3) and isinstance(c.blend_recompute_ratios, tuple)
    with pytest.raises(AttributeError):
        c.blend_check_layers.append(5)  # type: ignore[attr-defined]
    for mutate in (lambda d: d.__setitem__("x", 1), lambda d: d.pop("a"), lambda d: d.update(x=1),
                   lambda d: d.clear(), lambda d: d.setdefault("x", 1), lambda d: d["a"].__setitem__("b", 2)):
        with pytest.raises(TypeError, match="read-only.*replace"):
            mutate(c.extra_config)
    assert c.extra_config == {"a": {"b": (1,)}} and isinstance(c.extra_config, dict)
    assert c.to_dict()["extra_config"] == {"a": {"b": [1]}}  # plain again, for YAML / JSON


def test_import_has_no_torch():
    # Load config.py on its own (not through the package __init__) in a fresh interpreter.
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('cfg', {config_mod.__file__!r})\n"
        "mod = sys.modules['cfg'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(mod)\n"
        "print(sorted(m for m in ('torch', 'triton', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------ from_defaults / replace


def test_from_defaults_overrides_and_coercion():
    c = LMCacheEngineConfig.from_defaults(
        chunk_size=512, max_local_cpu_size=2, blend_check_layers=(1, 3), blend_recompute_ratios=0
    )
    assert c.chunk_size == 512
    assert c.max_local_cpu_size == 2.0 and isinstance(c.max_local_cpu_size, float)
    assert c.blend_check_layers == (1, 3)
    assert c.blend_recompute_ratios == (0.0,)


def test_replace_is_validated_copy():
    c = LMCacheEngineConfig()
    d = c.replace(chunk_size=1024, extra_config={"a": [1]})
    assert d.chunk_size == 1024 and c.chunk_size == 256
    assert d.extra_config == {"a": (1,)}
    with pytest.raises(ConfigError, match="chunk_size"):
        c.replace(chunk_size=100)
    with pytest.raises(ConfigError, match="unknown config key 'chunk_sise'.*'chunk_size'"):
        c.replace(chunk_sise=512)


def test_to_dict_round_trip_and_independent():
    c = LMCacheEngineConfig.from_defaults(extra_config={"x": {"y": 1}}, remote_auth_token="s3cr3t")
    d = c.to_dict()
    assert set(d) == {f.name for f in __import__("dataclasses").fields(LMCacheEngineConfig)}
    assert LMCacheEngineConfig.from_dict(d) == c
    d["extra_config"]["x"]["y"] = 2
    d["blend_check_layers"].append(9)
    assert c.extra_config == {"x": {"y": 1}} and c.blend_check_layers == (1,)
    assert d["blend_check_layers"] == [1, 9] and isinstance(c.to_dict()["blend_check_layers"], list)
    assert c.to_dict(redact=True)["remote_auth_token"] == "***"


def test_summary_one_line_and_redacted():
    c = LMCacheEngineConfig.from_defaults(
        remote_url="redis://user:pw@localhost:6379/0",
        remote_auth_token="tok123",
        local_disk="/tmp/x",
        max_local_disk_size=3,
        use_layerwise=True,
    )
    s = str(c)
    assert s == c.summary() and "\n" not in s
    assert "chunk_size=256" in s and "disk=/tmp/x(3GB)" in s and "use_layerwise=True" in s
    assert "pw" not in s and "tok123" not in s and "tok123" not in repr(c)
    assert "blend_special_str" not in s  # defaults other than the core ones are left out


# ------------------------------------------------------------------ from_file


def test_from_file(tmp_path):
    p = write(
        tmp_path,
        "chunk_size: 512\nlocal_cpu: false\nmax_local_cpu_size: 1\n"
        "local_disk: file:///tmp/lmc/\nmax_local_disk_size: 2.5\n"
        "remote_url: lm://localhost:65432\nremote_serde: lz4\n"
        "blend_check_layers: [0, 2]\nextra_config: {a: 1}\n",
    )
    c = LMCacheEngineConfig.from_file(p)
    assert c.chunk_size == 512 and c.local_cpu is False and c.max_local_cpu_size == 1.0
    assert c.local_disk == "/tmp/lmc/" and c.max_local_disk_size == 2.5
    assert c.remote_url == "lm://localhost:65432" and c.remote_serde == "lz4"
    assert c.blend_check_layers == (0, 2) and c.extra_config == {"a": 1}
    assert LMCacheEngineConfig.from_file(str(p)) == c


def test_from_file_empty_is_defaults(tmp_path):
    assert LMCacheEngineConfig.from_file(write(tmp_path, "")) == LMCacheEngineConfig()


@pytest.mark.parametrize(
    "text",
    [
        pytest.param(None, id="missing"),
        pytest.param("chunk_size: [1, 2\n", id="unparsable"),
        pytest.param("- 1\n- 2\n", id="list"),
        pytest.param("just a string\n", id="scalar"),
    ],
)
def test_from_file_bad_file_names_path(tmp_path, text):
    p = tmp_path / "bad.yaml"
    if text is not None:
        p.write_text(text)
    with pytest.raises(ValueError, match="bad.yaml") as ei:
        LMCacheEngineConfig.from_file(p)
    assert isinstance(ei.value, ConfigError)


def test_from_file_unknown_key_suggests(tmp_path):
    p = write(tmp_path, "max_local_cpu_sise: 3\n")
    with pytest.raises(ConfigError, match="unknown config key 'max_local_cpu_sise'") as ei:
        LMCacheEngineConfig.from_file(p)
    assert "did you mean 'max_local_cpu_size'" in str(ei.value)


def test_from_file_wrong_type(tmp_path):
    p = write(tmp_path, "chunk_size: '256'\n")
    with pytest.raises(ConfigError, match=r"'chunk_size': expected int, got str '256'"):
        LMCacheEngineConfig.from_file(p)


# ------------------------------------------------------------------ from_env


def test_from_env_typed(monkeypatch):
    env = {
        "LMCACHE_CHUNK_SIZE": "512",
        "LMCACHE_LOCAL_CPU": "false",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": "2.5",
        "LMCACHE_USE_LAYERWISE": "YES",
        "LMCACHE_ENABLE_BLENDING": "on",
        "LMCACHE_SAVE_DECODE_CACHE": "1",
        "LMCACHE_BLEND_CHECK_LAYERS": "1,3",
        "LMCACHE_BLEND_RECOMPUTE_RATIOS": "[0.1, 0.2]",
        "LMCACHE_EXTRA_CONFIG": '{"a": 1, "b": [true]}',
        "LMCACHE_REMOTE_URL": "none",
        "LMCACHE_REMOTE_AUTH_TOKEN": "tok",
        "LMCACHE_BLEND_SPECIAL_STR": " ## ",
        "LMCACHE_LOCAL_DISK": "file:///var/cache/lmc",
        "LMCACHE_MAX_LOCAL_DISK_SIZE": "10",
        "LMCACHE_LOOKUP_TIMEOUT_MS": " 100 ",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    c = LMCacheEngineConfig.from_env()
    assert c.chunk_size == 512 and c.local_cpu is False and c.max_local_cpu_size == 2.5
    assert c.use_layerwise and c.enable_blending and c.save_decode_cache
    assert c.blend_check_layers == (1, 3) and c.blend_recompute_ratios == (0.1, 0.2)
    assert c.extra_config == {"a": 1, "b": (True,)}
    assert c.remote_url is None and c.remote_auth_token == "tok"
    assert c.blend_special_str == " ## "
    assert c.local_disk == "/var/cache/lmc" and c.max_local_disk_size == 10.0
    assert c.lookup_timeout_ms == 100
    # save_unfull_chunk not given: with blending it is true, as in LMCache
    assert c.save_unfull_chunk is True


@pytest.mark.parametrize(
    "value, expected",
    [("[1, 3]", (1, 3)), ("2", (2,)), (" 0 , 4 ", (0, 4))],
    ids=["yaml-list", "single", "spaces"],
)
def test_from_env_int_list_forms(monkeypatch, value, expected):
    monkeypatch.setenv("LMCACHE_BLEND_CHECK_LAYERS", value)
    assert LMCacheEngineConfig.from_env().blend_check_layers == expected


@pytest.mark.parametrize("value", ["", "null", "None", "NULL"])
def test_from_env_none_for_optional(monkeypatch, value):
    monkeypatch.setenv("LMCACHE_LOCAL_DISK", value)
    monkeypatch.setenv("LMCACHE_EXTRA_CONFIG", value)
    c = LMCacheEngineConfig.from_env()
    assert c.local_disk is None and c.extra_config is None


@pytest.mark.parametrize(
    "var, value, expected",
    [
        ("LMCACHE_CHUNK_SIZE", "abc", "expected int"),
        ("LMCACHE_CHUNK_SIZE", "1.5", "expected int"),
        ("LMCACHE_LOCAL_CPU", "maybe", "expected bool"),
        ("LMCACHE_MAX_LOCAL_CPU_SIZE", "lots", "expected float"),
        ("LMCACHE_BLEND_CHECK_LAYERS", "1,x", r"expected list\[int\]"),
        ("LMCACHE_BLEND_CHECK_LAYERS", "[1, 2", r"expected list\[int\]"),
        ("LMCACHE_EXTRA_CONFIG", "[1, 2]", "expected dict or None"),
        ("LMCACHE_CHUNK_SIZE", "none", "expected int"),
    ],
)
def test_from_env_parse_errors_name_variable(monkeypatch, var, value, expected):
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=var) as ei:
        LMCacheEngineConfig.from_env()
    assert ei.match(expected)


def test_from_env_ignores_non_fields_warns_once(monkeypatch, caplog):
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", "/nonexistent.yaml")
    monkeypatch.setenv("LMCACHE_LOG_LEVEL", "DEBUG")
    monkeypatch.setenv("LMCACHE_USE_EXPERIMENTAL", "True")
    monkeypatch.setenv("LMCACHE_CHUNK_SIZ", "512")
    with caplog.at_level(logging.WARNING, logger="lmcache_triton"):
        c = LMCacheEngineConfig.from_env()
        LMCacheEngineConfig.from_env()
    assert c == LMCacheEngineConfig()
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1, msgs
    assert "LMCACHE_CHUNK_SIZ" in msgs[0] and "LMCACHE_CHUNK_SIZE" in msgs[0]


def test_from_env_explicit_mapping():
    c = LMCacheEngineConfig.from_env({"LMCACHE_CHUNK_SIZE": "64", "PATH": "/bin"})
    assert c.chunk_size == 64


# ------------------------------------------------------------------ load: resolution order


def test_load_order_file_env_overrides(tmp_path, monkeypatch):
    p = write(tmp_path, "chunk_size: 512\nmax_local_cpu_size: 1\n")
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(p))
    monkeypatch.setenv("LMCACHE_CHUNK_SIZE", "1024")
    c = LMCacheEngineConfig.load({"chunk_size": 2048})
    assert c.chunk_size == 2048
    assert c.max_local_cpu_size == 1.0
    # without overrides, env beats file
    assert LMCacheEngineConfig.load().chunk_size == 1024
    monkeypatch.delenv("LMCACHE_CHUNK_SIZE")
    assert LMCacheEngineConfig.load().chunk_size == 512


def test_load_defaults_without_anything():
    assert LMCacheEngineConfig.load() == LMCacheEngineConfig()
    assert LMCacheEngineConfig.load({}) == LMCacheEngineConfig()


def test_load_empty_config_file_env_is_unset(monkeypatch):
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", "")
    assert LMCacheEngineConfig.load() == LMCacheEngineConfig()


def test_load_missing_config_file_names_path(monkeypatch, tmp_path):
    missing = tmp_path / "nope.yaml"
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(missing))
    with pytest.raises(ConfigError, match="nope.yaml"):
        LMCacheEngineConfig.load()


def test_load_explicit_config_file_beats_env_var(tmp_path, monkeypatch):
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(tmp_path / "nope.yaml"))
    p = write(tmp_path, "chunk_size: 128\n")
    assert LMCacheEngineConfig.load(config_file=p).chunk_size == 128


def test_load_lmcache_prefix(monkeypatch):
    c = LMCacheEngineConfig.load({"lmcache.chunk_size": 128, "local_cpu": False})
    assert c.chunk_size == 128 and c.local_cpu is False
    # same value twice is fine, different values are not
    assert LMCacheEngineConfig.load({"lmcache.chunk_size": 64, "chunk_size": 64}).chunk_size == 64
    with pytest.raises(ConfigError, match="chunk_size"):
        LMCacheEngineConfig.load({"lmcache.chunk_size": 64, "chunk_size": 128})


def test_load_unknown_override_key_suggests():
    with pytest.raises(ConfigError, match="unknown config key 'lmcache.chunk_sise'") as ei:
        LMCacheEngineConfig.load({"lmcache.chunk_sise": 256})
    assert "did you mean 'chunk_size'" in str(ei.value)
    with pytest.raises(ConfigError, match="unknown config key 'foo'"):
        LMCacheEngineConfig.load({"foo": 1})


def test_load_cross_source_constraint(tmp_path, monkeypatch):
    # blending in the file, layerwise from env: valid once merged
    p = write(tmp_path, "enable_blending: true\n")
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(p))
    monkeypatch.setenv("LMCACHE_USE_LAYERWISE", "true")
    c = LMCacheEngineConfig.load()
    assert c.enable_blending and c.use_layerwise
    with pytest.raises(ConfigError, match="'use_layerwise' = False conflicts"):
        LMCacheEngineConfig.load({"lmcache.use_layerwise": False})


def test_blending_alone_turns_layerwise_on(caplog):
    """LMCache's published blending config sets enable_blending without use_layerwise: blending is
    what was meant, and it runs layer by layer. One warning line names both fields it set."""
    with caplog.at_level(logging.WARNING, logger="lmcache_triton"):
        c = LMCacheEngineConfig.from_defaults(enable_blending=True)
        LMCacheEngineConfig.from_defaults(enable_blending=True)
    assert c.use_layerwise is True and c.save_unfull_chunk is True
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "use_layerwise=True and save_unfull_chunk=True because enable_blending" in msgs[0]
    assert LMCacheEngineConfig().use_layerwise is False
    # picked, not given: picked anew by replace(); given, kept
    assert c.replace(enable_blending=False).use_layerwise is False
    assert LMCacheEngineConfig.from_defaults(use_layerwise=True).replace(chunk_size=128).use_layerwise is True


def test_load_env_parse_error_surfaces(monkeypatch):
    monkeypatch.setenv("LMCACHE_LOCAL_CPU", "nah")
    with pytest.raises(ConfigError, match="LMCACHE_LOCAL_CPU"):
        LMCacheEngineConfig.load()


# ------------------------------------------------------------------ validation errors


@pytest.mark.parametrize(
    "changes, pattern",
    [
        ({"chunk_size": 0}, "chunk_size.*power of two"),
        ({"chunk_size": 300}, "chunk_size.*power of two"),
        ({"chunk_size": -256}, "chunk_size.*power of two"),
        ({"chunk_size": True}, "chunk_size.*expected int.*bool"),
        ({"chunk_size": 256.0}, "chunk_size.*expected int.*float"),
        ({"local_cpu": 1}, "local_cpu.*expected bool"),
        ({"local_cpu": "true"}, "local_cpu.*expected bool"),
        ({"max_local_cpu_size": -1}, "max_local_cpu_size.*>= 0"),
        ({"max_local_cpu_size": "5"}, "max_local_cpu_size.*expected float"),
        ({"max_local_cpu_size": float("nan")}, "max_local_cpu_size.*finite"),
        ({"max_local_disk_size": -0.5}, "max_local_disk_size.*>= 0"),
        ({"local_disk": "/tmp/x"}, "local_disk.*max_local_disk_size"),
        ({"local_disk": "", "max_local_disk_size": 1}, "local_disk.*non-empty"),
        ({"local_disk": "s3://bucket/x", "max_local_disk_size": 1}, "local_disk.*file:///path"),
        ({"local_disk": 5}, "local_disk.*expected str or None"),
        ({"remote_url": "http://host:80"}, "remote_url.*lm://host:port.*redis://"),
        ({"remote_url": "localhost:6379"}, "remote_url.*lm://host:port"),
        ({"remote_url": "lm://host"}, "remote_url.*missing port"),
        ({"remote_url": "lm://:8080"}, "remote_url.*missing host"),
        ({"remote_url": "redis://host:99999"}, "remote_url"),
        ({"remote_url": "redis://host:6379/abc"}, "remote_url.*database"),
        ({"remote_serde": "cachegen"}, "remote_serde.*'naive', 'lz4'"),
        ({"remote_serde": None}, "remote_serde.*expected str"),
        ({"blocking_timeout_secs": 0}, "blocking_timeout_secs.*> 0"),
        ({"lookup_timeout_ms": 0}, "lookup_timeout_ms.*> 0"),
        ({"lookup_timeout_ms": 1.5}, "lookup_timeout_ms.*expected int"),
        ({"enable_blending": True, "use_layerwise": False},
         "'use_layerwise' = False conflicts with 'enable_blending' = True.*remove use_layerwise"),
        ({"enable_blending": True, "use_layerwise": True, "save_unfull_chunk": False},
         "'save_unfull_chunk' = False conflicts with 'enable_blending' = True.*remove save_unfull_chunk"),
        ({"save_unfull_chunk": 1}, "save_unfull_chunk.*expected bool or None"),
        ({"prometheus_port": 0}, r"prometheus_port.*\[1, 65535\] or None"),
        ({"verify_hit_rate": 1.5}, r"verify_hit_rate.*\[0, 1\]"),
        ({"remote_url": "valkeys://h:1/x"}, "remote_url.*database"),
        ({"blend_recompute_ratios": [0.1, 1.5]}, r"blend_recompute_ratios.*\[0, 1\]"),
        ({"blend_recompute_ratios": []}, "blend_recompute_ratios.*non-empty"),
        ({"blend_recompute_ratios": ["a"]}, r"blend_recompute_ratios.*list\[float\]"),
        ({"blend_check_layers": [1, -1]}, "blend_check_layers.*>= 0"),
        ({"blend_check_layers": [1.0]}, r"blend_check_layers.*list\[int\]"),
        ({"blend_check_layers": [True]}, r"blend_check_layers.*list\[int\]"),
        ({"blend_min_tokens": -1}, "blend_min_tokens.*>= 0"),
        ({"extra_config": [1]}, "extra_config.*expected dict or None"),
        ({"extra_config": {1: 2}}, "extra_config.*keys must be strings"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_validation_errors_name_key(changes, pattern):
    with pytest.raises(ConfigError, match=pattern):
        LMCacheEngineConfig.from_defaults(**changes)
    with pytest.raises(ConfigError, match=pattern):
        LMCacheEngineConfig(**changes)


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


def test_unknown_key_from_defaults_suggests():
    with pytest.raises(ConfigError, match="unknown config key 'remote_serd'.*'remote_serde'"):
        LMCacheEngineConfig.from_defaults(remote_serd="lz4")


@pytest.mark.parametrize(
    "url",
    [
        "lm://localhost:65432",
        "redis://localhost:6379",
        "redis://localhost:6379/2",
        "redis://localhost",
        "rediss://user:pw@cache.example.com:6380/0",
        "valkey://10.0.0.1:6379",
        "valkeys://user:pw@cache.example.com:6380/1",
        "redis://[::1]:6379",
    ],
)
def test_remote_url_accepted(url):
    assert LMCacheEngineConfig.from_defaults(remote_url=url).remote_url == url


@pytest.mark.parametrize(
    "value, expected",
    [
        ("file:///tmp/lmc", "/tmp/lmc"),
        ("file:///tmp/lmc/", "/tmp/lmc/"),
        ("/tmp/lmc", "/tmp/lmc"),
        ("relative/dir", "relative/dir"),
    ],
)
def test_local_disk_normalization(value, expected):
    c = LMCacheEngineConfig.from_defaults(local_disk=value, max_local_disk_size=1)
    assert c.local_disk == expected
    # normalizing is idempotent through replace / to_dict
    assert c.replace(chunk_size=128).local_disk == expected


def test_blending_resolves_unset_save_unfull_chunk(caplog):
    """Replaces test_blending_valid_and_forces_save_unfull_chunk: save_unfull_chunk not given is
    true with blending (logged, once), false without; given, it is kept or the load fails."""
    with caplog.at_level(logging.WARNING, logger="lmcache_triton"):
        c = LMCacheEngineConfig.from_defaults(enable_blending=True, use_layerwise=True)
        LMCacheEngineConfig.from_defaults(enable_blending=True, use_layerwise=True)
    assert c.save_unfull_chunk is True
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "save_unfull_chunk=True because enable_blending=True" in msgs[0], msgs
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lmcache_triton"):
        given = LMCacheEngineConfig.from_defaults(enable_blending=True, use_layerwise=True, save_unfull_chunk=True)
        assert LMCacheEngineConfig().save_unfull_chunk is False
    assert caplog.records == [] and given == c
    # replace(): a value the config picked is picked anew; a value given is kept
    assert c.replace(enable_blending=False).save_unfull_chunk is False
    assert LMCacheEngineConfig().replace(enable_blending=True, use_layerwise=True).save_unfull_chunk is True
    assert given.replace(enable_blending=False).save_unfull_chunk is True
    with pytest.raises(ConfigError, match="'save_unfull_chunk' = False conflicts with 'enable_blending'"):
        c.replace(save_unfull_chunk=False)


def test_save_unfull_chunk_false_with_blending_fails_from_every_source(tmp_path):
    p = write(tmp_path, "enable_blending: true\nuse_layerwise: true\n")
    pattern = "'save_unfull_chunk' = False conflicts with 'enable_blending' = True"
    with pytest.raises(ConfigError, match=pattern):
        LMCacheEngineConfig.load(config_file=p, environ={"LMCACHE_SAVE_UNFULL_CHUNK": "false"})
    with pytest.raises(ConfigError, match=pattern + ".*discard_partial_chunks"):
        LMCacheEngineConfig.load(config_mod.connector_overrides({"discard_partial_chunks": True}), config_file=p,
                                 environ={})
    assert LMCacheEngineConfig.load(config_file=p, environ={"LMCACHE_SAVE_UNFULL_CHUNK": "none"}).save_unfull_chunk


# ------------------------------------------------------------------ one declaration, frozen, never rewritten


def test_one_declaration_per_field():
    """Types come from the annotations, everything else from option(): no second table."""
    import typing

    assert not hasattr(config_mod, "_SPECS")
    fields = dataclasses.fields(LMCacheEngineConfig)
    assert list(config_mod._FIELDS) == [f.name for f in fields]
    hints = typing.get_type_hints(LMCacheEngineConfig)
    kinds = {int: "int", float: "float", bool: "bool", str: "str", tuple[int, ...]: "list[int]",
             tuple[float, ...]: "list[float]", dict[str, typing.Any]: "dict"}
    for f in fields:
        spec = config_mod._FIELDS[f.name]
        tp = hints[f.name]
        args = [a for a in typing.get_args(tp) if a is not type(None)] if spec.optional else [tp]
        assert spec.kind == kinds[args[0]], f.name
        assert spec.optional == (type(None) in typing.get_args(tp)), f.name
        assert f.metadata["doc"].strip(), f"{f.name} has no doc"
        assert f.default is not dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    assert [n for n, f in config_mod._FIELDS.items() if f.meta["secret"]] == ["remote_auth_token", "namespace_secret"]


def test_configuration_page_reference_is_the_declarations():
    page = (Path(__file__).parents[1] / "docs" / "configuration.md").read_text()
    start = page.index("<!-- config-reference")
    body = page[page.index("\n", start) + 1:page.index("<!-- /config-reference -->")]
    assert body == config_mod.reference(), \
        "regenerate docs/configuration.md: python -m lmcache_triton.tools.config_docs > docs/configuration.md"
    for name in config_mod._FIELDS:
        assert f"| `{name}` |" in body


def _every_constructor(tmp_path):
    empty = write(tmp_path, "")
    return {
        "init": LMCacheEngineConfig(),
        "from_defaults": LMCacheEngineConfig.from_defaults(chunk_size=512),
        "from_dict": LMCacheEngineConfig.from_dict({"chunk_size": 512}),
        "from_file": LMCacheEngineConfig.from_file(empty),
        "from_env": LMCacheEngineConfig.from_env({"LMCACHE_CHUNK_SIZE": "512"}),
        "load": LMCacheEngineConfig.load({"lmcache.chunk_size": 512}, environ={}),
        "replace": LMCacheEngineConfig().replace(chunk_size=512),
        "dataclasses.replace": dataclasses.replace(LMCacheEngineConfig(), chunk_size=512),
    }


def test_frozen_after_every_constructor(tmp_path):
    for how, c in _every_constructor(tmp_path).items():
        before = c.to_dict()
        with pytest.raises(dataclasses.FrozenInstanceError, match=r"'chunk_size'.*replace\(chunk_size=\.\.\.\)"):
            c.chunk_size = 1024
        with pytest.raises(dataclasses.FrozenInstanceError, match="replace"):
            del c.local_cpu
        with pytest.raises(dataclasses.FrozenInstanceError):
            c.not_a_field = 1
        assert c.to_dict() == before, how


def test_equal_configs_hash_alike_and_copies_stay_frozen():
    import copy
    import pickle

    a = LMCacheEngineConfig.from_defaults(blend_check_layers=[1, 3], extra_config={"a": [1, {"b": 2}]},
                                          remote_auth_token="t")
    b = LMCacheEngineConfig.from_dict(a.to_dict())
    assert a == b and hash(a) == hash(b) and {a: "engine"}[b] == "engine"
    assert a != a.replace(chunk_size=512) and a.replace() == a and a.replace() is not a
    assert len({a, b, a.replace(remote_auth_token="u")}) == 2
    for copied in (copy.copy(a), copy.deepcopy(a), pickle.loads(pickle.dumps(a))):
        assert copied == a and hash(copied) == hash(a)
        with pytest.raises(dataclasses.FrozenInstanceError):
            copied.chunk_size = 1
        with pytest.raises(TypeError):
            copied.extra_config["a"] = 0
    blend = LMCacheEngineConfig.from_defaults(enable_blending=True, use_layerwise=True)
    assert pickle.loads(pickle.dumps(blend)).replace(enable_blending=False).save_unfull_chunk is False


@pytest.mark.parametrize(
    "given",
    [
        {},
        {"chunk_size": 512, "max_local_cpu_size": 2.5, "local_cpu": False},
        {"local_disk": "/tmp/lmc", "max_local_disk_size": 1.0, "remote_url": "rediss://u:pw@h:1/2",
         "remote_serde": "lz4", "remote_auth_token": "tok", "namespace_secret": "s"},
        {"use_layerwise": True, "enable_blending": True, "save_unfull_chunk": True,
         "blend_recompute_ratios": [0.1, 0.2], "blend_check_layers": [0, 2], "blend_min_tokens": 0},
        {"prometheus_port": 9100, "verify_hit_rate": 1.0, "reservation_lease_secs": 0.5,
         "lookup_timeout_ms": 1, "extra_config": {"k": [1, {"x": None}]}, "save_unfull_chunk": False},
    ],
    ids=["defaults", "tiers", "remote", "blending", "ours"],
)
def test_config_is_what_was_asked(given):
    """Validation reports and never rewrites: each given value comes back as given, and validate()
    on a built config changes nothing."""
    c = LMCacheEngineConfig.from_defaults(**given)
    d = c.to_dict()
    assert {k: d[k] for k in given} == given
    assert c.validate() is c and c.to_dict() == d
    assert LMCacheEngineConfig.from_dict(d) == c


# config and the modules it is built from (its rooms): together the lowest floor.
CONFIG_ROOMS = ("config", "config_fields", "config_sources", "lmcache_compat", "remote_url")


def test_config_imports_nothing_of_the_package():
    """config and its rooms are the lowest floor: the standard library, PyYAML and each other only."""
    import ast

    imported = set()
    for room in CONFIG_ROOMS:
        tree = ast.parse((Path(config_mod.__file__).parent / f"{room}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, "no relative imports"
                names = [node.module] if node.module != "lmcache_triton" else [f"lmcache_triton.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                top, _, rest = name.partition(".")
                if top == "lmcache_triton":
                    assert rest.split(".")[0] in CONFIG_ROOMS, f"{room} imports {name}, above the lowest floor"
                else:
                    imported.add(top)
    assert imported - set(sys.stdlib_module_names) == {"yaml"}


# ------------------------------------------------------------------ remote_url: one scheme table, one redaction

SECRET = "hunter2"


def test_remote_schemes_config_and_backend_factory_agree(monkeypatch):
    """Every scheme create_remote_backend builds a backend for, the config accepts, and the other way
    round; the redis backend hands redis-py the protocol the table says."""
    from lmcache_triton.storage import redis_backend, remote

    built = []
    monkeypatch.setattr(remote, "CacheServerBackend", lambda host, port, *a, **k: built.append(("lm", host, port)))
    monkeypatch.setattr(redis_backend, "RedisBackend", lambda url, *a, **k: built.append(("redis", url)))
    from lmcache_triton.storage import redis_cluster

    monkeypatch.setattr(redis_cluster, "RedisClusterBackend", lambda url, *a, **k: built.append(("cluster", url)))
    candidates = [*REMOTE_SCHEMES, "http", "https", "resp", "unix", "s3", "mooncakestore", "lms",
                  "tcp", "file", "redis+tls", "valkeyss", "REDIS"]
    accepted_by_config, accepted_by_factory = set(), set()
    for scheme in candidates:
        url = f"{scheme}://localhost:6379"
        try:
            LMCacheEngineConfig.from_defaults(remote_url=url)
            accepted_by_config.add(scheme)
        except ConfigError as e:
            assert "unsupported scheme" in str(e)
        try:
            remote.create_remote_backend(url, None)
            accepted_by_factory.add(scheme)
        except ValueError as e:
            assert "unsupported remote url scheme" in str(e)
            assert remote_url_forms() in str(e)
    assert accepted_by_config == accepted_by_factory
    assert {s.lower() for s in accepted_by_config} == set(REMOTE_SCHEMES)  # URL schemes ignore case
    assert "valkeys" in accepted_by_config and len(built) == len(accepted_by_factory)
    for scheme, protocol in REMOTE_SCHEMES.items():
        if protocol in ("redis", "rediss"):
            assert redis_backend.redis_url(f"{scheme}://h:1").startswith(f"{protocol}://")
        elif protocol != "lm":
            assert protocol in CLUSTER_PROTOCOLS


@pytest.mark.parametrize(
    "url, shown",
    [
        (f"redis://user:{SECRET}@localhost:6379/0", "redis://user:***@localhost:6379/0"),
        (f"rediss://:{SECRET}@cache.example.com:6380", "rediss://:***@cache.example.com:6380"),
        (f"valkey://default:{SECRET}@10.0.0.1:6379", "valkey://default:***@10.0.0.1:6379"),
        (f"valkeys://u:{SECRET}@[::1]:6379/3", "valkeys://u:***@[::1]:6379/3"),
        (f"redis://{SECRET}@h:1", "redis://***@h:1"),
        (f"redis://u:p@s{SECRET}@h:1", "redis://u:***@h:1"),
        (f"lm://tok:{SECRET}@h:65432", "lm://tok:***@h:65432"),
        ("redis://h:1/0", "redis://h:1/0"),
    ],
)
def test_one_redaction_for_config_and_backend(url, shown):
    from lmcache_triton.storage import redis_backend

    assert not hasattr(config_mod, "_redact_url") and not hasattr(redis_backend, "_redact")
    assert redact_url(url) == shown and SECRET not in shown
    c = LMCacheEngineConfig.from_defaults(remote_url=url)
    assert c.to_dict(redact=True)["remote_url"] == shown
    assert f"remote={shown}(" in c.summary() and SECRET not in repr(c) + str(c)
    if REMOTE_SCHEMES[url.split("://")[0]] != "lm":
        pytest.importorskip("redis")
        b = redis_backend.RedisBackend(url, None)  # connects lazily: nothing listens, nothing is sent
        try:
            assert b.url == shown
        finally:
            b.close()


@pytest.mark.parametrize(
    "url",
    [
        f"http://u:{SECRET}@h:1",                  # unsupported scheme
        f"redis://u:{SECRET}@[::1:6379",           # urlsplit refuses it
        f"redis://u:{SECRET}@h:1/x",               # not a database number
        f"redis://h:1/0?password={SECRET}",        # query
        f"lm://u:{SECRET}@h",                      # no port
        f"u:{SECRET}@h:6379",                      # no scheme
    ],
)
def test_refused_urls_never_show_the_secret(url):
    from lmcache_triton.storage import remote

    assert SECRET not in redact_url(url)
    with pytest.raises(ConfigError, match="remote_url") as ei:
        LMCacheEngineConfig.from_defaults(remote_url=url)
    assert SECRET not in str(ei.value)
    try:  # the factory checks less than the config: it may build a backend, whose url is redacted too
        backend = remote.create_remote_backend(url, None, timeout_s=0.1)
    except ValueError as e:
        assert SECRET not in str(e)
    else:
        assert SECRET not in backend.url
        backend.close()


def test_secrets_never_in_errors():
    with pytest.raises(ConfigError, match="remote_auth_token.*expected str or None") as ei:
        LMCacheEngineConfig.from_defaults(remote_auth_token=12345678)
    assert "12345678" not in str(ei.value)
    with pytest.raises(ConfigError, match="given twice") as ei:
        LMCacheEngineConfig.load({"lmcache.namespace_secret": SECRET, "namespace_secret": "other"}, environ={})
    assert SECRET not in str(ei.value)


def test_get_extra_config_value():
    assert LMCacheEngineConfig().get_extra_config_value("k", 3) == 3
    c = LMCacheEngineConfig.from_defaults(extra_config={"k": 1})
    assert c.get_extra_config_value("k") == 1
