import json
import struct

import lz4.frame
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load as st_load

from lmcache_triton.storage.memory import MemoryFormat
from lmcache_triton.metadata import LMCacheEngineMetadata
from lmcache_triton.storage.serde import (
    FORMAT_VERSION,
    SerdeError,
    UnsupportedVersionError,
    check_fits,
    deserialize,
    header_span,
    read_header,
    serialize,
)
from lmcache_triton.keys import CacheEngineKey

F = MemoryFormat
SHAPES = [  # odd token counts (7, 1) on purpose
    pytest.param(F.KV_2LTD, (2, 3, 7, 16), id="2LTD"),
    pytest.param(F.KV_T2D, (7, 2, 16), id="T2D"),
    pytest.param(F.KV_MLA, (1, 3, 7, 24), id="MLA4"),
    pytest.param(F.KV_MLA, (1, 24), id="MLA2-1tok"),
]
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.uint8, torch.float8_e4m3fn]
KEY = CacheEngineKey("org/model@rev-ü", 2, 1, "bfloat16", "KV_2LTD", "ab" * 16)


def _random_bytes_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Every bit pattern (NaNs included), so the round trip must be bit-exact, not just close."""
    g = torch.Generator().manual_seed(seed)
    n = torch.Size(shape).numel() * dtype.itemsize
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(dtype).view(shape)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _rewrite_meta(data: bytes, **changes: str) -> bytes:
    """A well-formed chunk with some metadata changed and its header checksum recomputed."""
    from lmcache_triton.storage import serde

    n = struct.unpack_from("<Q", data)[0]
    header = json.loads(data[8:8 + n])
    meta = header["__metadata__"]
    meta.update(changes)
    del meta["header_crc"]
    meta["header_crc"] = serde._crc(serde._canonical(header))
    hb = serde._canonical(header)
    hb += b" " * (-len(hb) % 8)
    return struct.pack("<Q", len(hb)) + hb + data[8 + n:]


@pytest.mark.parametrize("compression", ["naive", "lz4"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize(("fmt", "shape"), SHAPES)
def test_round_trip_is_bit_exact_and_valid_safetensors(tmp_path, fmt, shape, dtype, compression):
    t = _random_bytes_tensor(shape, dtype)
    data = serialize(KEY, t, fmt, compression)

    h = read_header(data)
    assert (h.key, h.fmt, h.dtype, h.shape, h.compression, h.version) == (
        KEY.to_string(), fmt, dtype, shape, compression, FORMAT_VERSION)
    assert h.num_tokens == shape[fmt.token_dim(len(shape))]
    assert h.file_nbytes == len(data)

    out, h2 = deserialize(data, expected_key=KEY.to_string(), expected_dtype=dtype, expected_shape=shape)
    assert h2 == h and _same_bytes(out, t)

    # into a preallocated tensor, in place
    dst = torch.zeros(shape, dtype=torch.uint8).view(dtype) if dtype.itemsize == 1 else torch.empty(shape, dtype=dtype)
    out2, _ = deserialize(data, out=dst)
    assert out2 is dst and _same_bytes(dst, t)

    # a real safetensors file, readable by the library, from disk and from bytes
    path = tmp_path / "chunk.safetensors"
    path.write_bytes(data)
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        assert meta["key"] == KEY.to_string() and meta["compression"] == compression
        assert meta["shape"] == ",".join(map(str, shape)) and meta["dtype"] == str(dtype).removeprefix("torch.")
        if compression == "naive":
            assert list(f.keys()) == ["kv"] and _same_bytes(f.get_tensor("kv"), t)
        else:
            packed = f.get_tensor("kv.lz4")
            assert packed.dtype == torch.uint8
            raw = lz4.frame.decompress(packed.numpy().tobytes())
            assert raw == t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    assert set(st_load(data)) == {"kv" if compression == "naive" else "kv.lz4"}


def test_non_contiguous_input_round_trips():
    base = _random_bytes_tensor((2, 3, 16, 7), torch.bfloat16)
    t = base.transpose(2, 3)  # [2, 3, 7, 16], not contiguous
    out, _ = deserialize(serialize("k", t, F.KV_2LTD))
    assert _same_bytes(out, t)


@pytest.mark.parametrize("compression", ["naive", "lz4"])
def test_every_single_bit_flip_is_rejected(compression):
    """Header length, JSON header, metadata, padding, payload: a flip anywhere is a SerdeError."""
    t = _random_bytes_tensor((2, 2, 3, 8), torch.float16, seed=1)
    data = serialize(KEY, t, F.KV_2LTD, compression)
    h = read_header(data)
    assert 8 < h.data_offset < len(data)
    for pos in range(len(data)):
        for bit in range(8):
            bad = bytearray(data)
            bad[pos] ^= 1 << bit
            with pytest.raises(SerdeError):
                deserialize(bytes(bad))


@pytest.mark.parametrize("compression", ["naive", "lz4"])
def test_bit_flips_in_a_large_payload_are_rejected(compression):
    t = torch.randn(2, 4, 33, 128).to(torch.bfloat16)  # compressible-ish, several lz4 blocks
    data = serialize(KEY, t, F.KV_2LTD, compression)
    h = read_header(data)
    n = len(data)
    for pos in (h.data_offset, h.data_offset + 1, (h.data_offset + n) // 2, n - 5, n - 1):
        for bit in (0, 3, 7):
            bad = bytearray(data)
            bad[pos] ^= 1 << bit
            with pytest.raises(SerdeError):
                deserialize(bytes(bad))


@pytest.mark.parametrize("compression", ["naive", "lz4"])
def test_truncation_and_trailing_bytes_are_rejected(compression):
    t = _random_bytes_tensor((5, 2, 16), torch.bfloat16)
    data = serialize(KEY, t, F.KV_T2D, compression)
    h = read_header(data)
    cuts = [0, 1, 7, 8, 9, h.data_offset // 2, h.data_offset - 1, h.data_offset, h.data_offset + 1, len(data) - 1]
    for cut in cuts:
        with pytest.raises(SerdeError):
            deserialize(data[:cut])
    with pytest.raises(SerdeError):
        deserialize(data + b"\0")
    # the header alone is enough for read_header
    assert read_header(data[:header_span(data[:8])]) == h


@pytest.mark.parametrize("garbage", [b"", b"abc", b"\xff" * 64, struct.pack("<Q", 2) + b"[]",
                                     struct.pack("<Q", 8) + b'{"a":1} ', struct.pack("<Q", 1 << 40) + b"{}"])
def test_garbage_is_rejected(garbage):
    with pytest.raises(SerdeError):
        read_header(garbage)
    with pytest.raises(SerdeError):
        deserialize(garbage)


def test_expectations_and_out_mismatch_are_rejected():
    t = _random_bytes_tensor((2, 3, 7, 16), torch.bfloat16)
    data = serialize(KEY, t, F.KV_2LTD)
    with pytest.raises(SerdeError, match="expected"):
        deserialize(data, expected_key="other")
    with pytest.raises(SerdeError, match="dtype"):
        deserialize(data, expected_dtype=torch.float16)
    with pytest.raises(SerdeError, match="shape"):
        deserialize(data, expected_shape=(2, 3, 8, 16))
    with pytest.raises(SerdeError):
        deserialize(data, out=torch.empty((2, 3, 7, 16), dtype=torch.float16))
    with pytest.raises(SerdeError):
        deserialize(data, out=torch.empty((2, 3, 6, 16), dtype=torch.bfloat16))


def test_corrupt_payload_never_writes_into_out():
    t = _random_bytes_tensor((2, 3, 7, 16), torch.bfloat16)
    data = bytearray(serialize(KEY, t, F.KV_2LTD))
    data[-3] ^= 0x10
    out = torch.full((2, 3, 7, 16), 7.0, dtype=torch.bfloat16)
    with pytest.raises(SerdeError, match="checksum"):
        deserialize(bytes(data), out=out)
    assert bool((out == 7.0).all())


def test_other_version_is_rejected():
    data = serialize(KEY, _random_bytes_tensor((3, 2, 8), torch.float16), F.KV_T2D)
    deserialize(_rewrite_meta(data))  # the rewrite itself keeps the chunk valid
    for version in (str(FORMAT_VERSION + 1), "0", "x"):
        with pytest.raises(UnsupportedVersionError, match="version"):
            deserialize(_rewrite_meta(data, version=version))


def test_inconsistent_metadata_is_rejected_even_with_a_valid_header_crc():
    data = serialize(KEY, _random_bytes_tensor((3, 2, 8), torch.float16), F.KV_T2D)
    for changes in ({"num_tokens": "2"}, {"shape": "3,2,4"}, {"fmt": "KV_2LTD"}, {"dtype": "bfloat16"},
                    {"dtype": "int64"}, {"compression": "zstd"}, {"checksum": "md5:00"}):
        with pytest.raises(SerdeError):
            deserialize(_rewrite_meta(data, **changes))


def test_serialize_rejects_what_is_not_a_chunk():
    with pytest.raises(ValueError, match="KV_2LTD"):
        serialize("k", torch.zeros(3, 3, 7, 16, dtype=torch.float16), F.KV_2LTD)
    with pytest.raises(ValueError, match="dtype"):
        serialize("k", torch.zeros(2, 3, 7, 16, dtype=torch.int64), F.KV_2LTD)
    with pytest.raises(ValueError, match="compression"):
        serialize("k", torch.zeros(2, 3, 7, 16, dtype=torch.float16), F.KV_2LTD, "zstd")


def _meta(**kw) -> LMCacheEngineMetadata:
    args = dict(model_name="org/model@rev-ü", world_size=2, worker_id=1, kv_dtype=torch.bfloat16,
                kv_shape=(3, 2, 8, 2, 8))
    args.update(kw)
    return LMCacheEngineMetadata(**args)


def test_check_fits():
    m = _meta()
    ok = [((2, 3, 8, 16), F.KV_2LTD), ((2, 3, 5, 16), F.KV_2LTD), ((5, 2, 16), F.KV_T2D)]
    for shape, fmt in ok:
        check_fits(read_header(serialize(KEY, torch.zeros(shape, dtype=torch.bfloat16), fmt)), m)
    bad = [((2, 3, 9, 16), F.KV_2LTD), ((2, 4, 8, 16), F.KV_2LTD), ((2, 3, 8, 8), F.KV_2LTD),
           ((1, 3, 8, 16), F.KV_MLA)]
    for shape, fmt in bad:
        with pytest.raises(SerdeError):
            check_fits(read_header(serialize(KEY, torch.zeros(shape, dtype=torch.bfloat16), fmt)), m)
    h = read_header(serialize(KEY, torch.zeros((2, 3, 8, 16), dtype=torch.bfloat16), F.KV_2LTD))
    for other in (_meta(model_name="other"), _meta(worker_id=0), _meta(kv_dtype=torch.float16)):
        with pytest.raises(SerdeError):
            check_fits(h, other)
    with pytest.raises(SerdeError, match="not an lmcache_triton key"):
        check_fits(read_header(serialize("plain", torch.zeros((2, 3, 8, 16), dtype=torch.bfloat16), F.KV_2LTD)), m)
    mla = _meta(kv_shape=(3, 1, 8, 1, 24), use_mla=True)
    for shape in ((1, 3, 8, 24), (8, 24)):
        check_fits(read_header(serialize(KEY, torch.zeros(shape, dtype=torch.bfloat16), F.KV_MLA)), mla)
    with pytest.raises(SerdeError):
        check_fits(read_header(serialize(KEY, torch.zeros((8, 2, 24), dtype=torch.bfloat16), F.KV_T2D)), mla)


def _with_lz4_payload(data: bytes, payload: bytes) -> bytes:
    """An lz4 chunk's valid header (header_crc recomputed) in front of any `payload`: what a
    hostile client of a shared cache could store."""
    from lmcache_triton.storage import serde

    n = struct.unpack_from("<Q", data)[0]
    header = json.loads(data[8:8 + n])
    header["kv.lz4"].update(shape=[len(payload)], data_offsets=[0, len(payload)])
    del header["__metadata__"]["header_crc"]
    header["__metadata__"]["header_crc"] = serde._crc(serde._canonical(header))
    hb = serde._canonical(header)
    hb += b" " * (-len(hb) % 8)
    return struct.pack("<Q", len(hb)) + hb + payload


def _lz4_frame(chunks: list[bytes], *, source_size: int = 0) -> bytes:
    """One lz4 frame of the concatenated chunks, built in pieces (the whole content is never in memory);
    source_size != 0 writes the frame's content-size field."""
    c = lz4.frame.LZ4FrameCompressor()
    return b"".join([c.begin(source_size=source_size), *(c.compress(x) for x in chunks), c.flush()])


_SMALL = torch.arange(2 * 2 * 8 * 32, dtype=torch.int32).to(torch.bfloat16).view(2, 2, 8, 32)  # 2 KiB raw
_SMALL_RAW = _SMALL.view(-1).view(torch.uint8).numpy().tobytes()


def test_lz4_frames_that_do_not_match_the_header_are_rejected():
    data = serialize(KEY, _SMALL, F.KV_2LTD, "lz4")
    assert read_header(data).raw_nbytes == len(_SMALL_RAW) == 2048
    frame = lz4.frame.compress(_SMALL_RAW)
    deserialize(_with_lz4_payload(data, frame))  # the rewrite itself keeps the chunk valid
    bad = {
        "expands-past-header": lz4.frame.compress(_SMALL_RAW + b"\0", store_size=False),
        "declares-other-size": lz4.frame.compress(_SMALL_RAW + b"\0", store_size=True),
        "short": lz4.frame.compress(_SMALL_RAW[:-1]),
        "truncated-frame": frame[:-4],
        "trailing-junk": frame + b"junk",
        "two-frames": lz4.frame.compress(_SMALL_RAW[:1024]) + lz4.frame.compress(_SMALL_RAW[1024:]),
        "not-lz4": b"\0" * 64,
        "empty": b"",
    }
    for name, payload in bad.items():
        with pytest.raises(SerdeError):
            deserialize(_with_lz4_payload(data, payload))
            pytest.fail(f"{name} was accepted")


_BOMB = """
import resource, sys
sys.path.insert(0, sys.argv[1])
from test_serde import F, KEY, _SMALL, _lz4_frame, _with_lz4_payload
from lmcache_triton.storage.serde import SerdeError, deserialize, serialize
n, mib = int(sys.argv[2]), bytes(1 << 20)
header = serialize(KEY, _SMALL, F.KV_2LTD, "lz4")
bombs = [_with_lz4_payload(header, _lz4_frame([mib] * (n >> 20), source_size=size)) for size in (n, 0)]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for bomb in bombs:
    try:
        deserialize(bomb)
    except SerdeError:
        pass
    else:
        sys.exit("the bomb was accepted")
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)  # Linux: KiB
"""


def test_lz4_bomb_is_rejected_without_allocating_its_expansion():
    """A 2 KiB chunk whose ~2 MiB lz4 frame expands to 512 MiB (with and without the frame's
    content-size field): decoding must fail before allocating anything near the expansion."""
    import subprocess
    import sys
    from pathlib import Path

    n = 512 << 20
    out = subprocess.run([sys.executable, "-c", _BOMB, str(Path(__file__).parent), str(n)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    grew = int(out.stdout)
    assert grew < 64 << 20, f"peak RSS grew by {grew >> 20} MiB decoding a 2 KiB chunk"
