"""The safetensors reader trusts nothing in a file: one test per rule of the format, each with a
small hand-made file (header bytes + data) breaking exactly that rule; index files may only name
files inside their directory; valid files (hand-made, ours, the fixtures) load bit-exactly."""

import json
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from moebalance import hf
from moebalance import safetensors_io as st

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
TMP_OK = [HealthCheck.function_scoped_fixture]  # each example rewrites its own file
F32 = np.arange(4, dtype=np.float32).reshape(2, 2)
W = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}  # F32's bytes


def _file(tmp_path, header=None, data=b"", *, raw=None, length=None, name="x.safetensors"):
    """A file by hand: the 8-byte header length (`length`, else the header's), header, data."""
    blob = raw if raw is not None else json.dumps(header).encode()
    path = tmp_path / name
    path.write_bytes(struct.pack("<Q", len(blob) if length is None else length) + blob + data)
    return path


def _rejected(path, *words, reader=st.load):
    """`reader(path)` raises SafetensorsError (nothing else): one line naming the file and
    holding `words`."""
    with pytest.raises(st.SafetensorsError) as info:
        reader(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message, message
    for word in words:
        assert word in message, message
    return message


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert np.asarray(a[name]).tobytes() == np.asarray(b[name]).tobytes(), name


# --- valid files ------------------------------------------------------------------------------


def test_hand_made_file_round_trips(tmp_path):
    ids = np.array([7, -1, 2**40], np.int64)
    half = np.array([1.5, -2.0], ml_dtypes.bfloat16)
    header = {  # not in data order; metadata anywhere; padding after the JSON
        "ids": {"dtype": "I64", "shape": [3], "data_offsets": [16, 40]},
        "__metadata__": {"format": "pt"},
        "w": W,
        "empty": {"dtype": "F16", "shape": [0, 5], "data_offsets": [40, 40]},
        "half": {"dtype": "BF16", "shape": [2], "data_offsets": [40, 44]},
        "scalar": {"dtype": "F8_E8M0", "shape": [], "data_offsets": [44, 45]},
    }
    raw = json.dumps(header).encode() + b"   "
    path = _file(tmp_path, raw=raw, data=F32.tobytes() + ids.tobytes() + half.tobytes() + b"\x7f")
    got = st.load(path)
    _same(got, {"ids": ids, "w": F32, "empty": np.zeros((0, 5), np.float16), "half": half,
                "scalar": np.array(1.0, ml_dtypes.float8_e8m0fnu)})


def test_empty_file_of_no_tensors_loads(tmp_path):
    assert st.load(_file(tmp_path, {})) == {}
    assert st.load(_file(tmp_path, {"__metadata__": {}})) == {}


def test_writer_output_loads_back(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {name: rng.normal(size=(3, 2)).astype(dtype) for name, dtype in st.DTYPES.items()}
    tensors["empty"] = np.zeros((2, 0), np.float32)
    st.save(tensors, tmp_path / "x.safetensors", metadata={"format": "pt", "n": 3})
    _same(st.load(tmp_path / "x.safetensors"), tensors)


def test_writer_refuses_the_metadata_name(tmp_path):
    with pytest.raises(st.SafetensorsError, match="reserved"):
        st.save({"__metadata__": F32}, tmp_path / "x.safetensors")


def test_fixtures_written_by_the_safetensors_library_load(tmp_path):
    paths = sorted(FIXTURES.glob("**/*.safetensors"))
    assert len(paths) >= 4
    for path in paths:
        tensors = st.load(path)
        assert tensors
        copy = tmp_path / path.name
        st.save(tensors, copy)  # and our own writer's copy reads back the same
        _same(st.load(copy), tensors)


@settings(max_examples=60, deadline=None, suppress_health_check=TMP_OK)
@given(hs.lists(hs.tuples(hs.sampled_from(sorted(st.DTYPES)),
                          hs.lists(hs.integers(0, 3), max_size=3)), max_size=6),
       hs.randoms(use_true_random=False), hs.integers(0, 16))
def test_random_valid_layouts_load_back_equal(tmp_path, specs, rnd, pad):
    header, data, expected, offset = {}, b"", {}, 0
    for i, (dtype, shape) in enumerate(specs):
        nbytes = int(np.prod(shape, dtype=np.int64)) * st.DTYPES[dtype].itemsize
        chunk = rnd.randbytes(nbytes)
        if dtype == "BOOL":  # NumPy's bools are one byte of 0 or 1
            chunk = bytes(b & 1 for b in chunk)
        offsets = [offset, offset + nbytes]
        header[f"t{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": offsets}
        expected[f"t{i}"] = np.frombuffer(chunk, st.DTYPES[dtype]).reshape(shape)
        data, offset = data + chunk, offset + nbytes
    items = list(header.items())
    rnd.shuffle(items)
    raw = json.dumps(dict(items)).encode() + b" " * pad
    _same(st.load(_file(tmp_path, raw=raw, data=data)), expected)


# --- the header length ------------------------------------------------------------------------


def test_file_shorter_than_8_bytes(tmp_path):
    (tmp_path / "x.safetensors").write_bytes(b"\x02\x00\x00")
    _rejected(tmp_path / "x.safetensors", "shorter than the 8-byte header length")


def test_header_length_over_the_limit(tmp_path):
    path = _file(tmp_path, raw=b"{}", length=st.MAX_HEADER_BYTES + 1)
    _rejected(path, "corrupt header", "exceeds the limit of 100000000 bytes")


def test_header_length_past_the_end_of_the_file(tmp_path):
    _rejected(_file(tmp_path, raw=b"{}", length=64), "corrupt header", "runs past the end")
    _rejected(_file(tmp_path, raw=b"{}", length=2**64 - 1), "corrupt header")


# --- the header's JSON ------------------------------------------------------------------------


@pytest.mark.parametrize("raw,words", [
    (b'{"\xff":1}', "not valid UTF-8"),
    (b"{bad", "invalid JSON"),
    (b"", "invalid JSON"),
    (b'[{"dtype":"F32"}]', "top level is a list, not an object"),
    (b'"w"', "top level is a string, not an object"),
    (b' {}', "does not start with '{'"),
    (b'{"w":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "JSON nested too deeply"),
    (b'{"a":' * 50_000 + b"1" + b"}" * 50_000, "JSON nested too deeply"),
    (b'{"w":{"dtype":"F32","shape":[NaN],"data_offsets":[0,16]}}', "NaN is not valid JSON"),
    (b'{"w":{"dtype":"F32","shape":[1' + b"0" * 5000 + b'],"data_offsets":[0,16]}}',
     "invalid JSON"),
], ids=["utf8", "json", "empty", "list", "string", "start", "deep-list", "deep-object", "nan",
        "bigint"])
def test_header_must_be_a_json_object(tmp_path, raw, words):
    _rejected(_file(tmp_path, raw=raw, data=F32.tobytes()), "corrupt header", words)


def test_duplicate_tensor_names(tmp_path):
    entry = json.dumps(W)
    raw = f'{{"w":{entry},"w":{entry}}}'.encode()
    _rejected(_file(tmp_path, raw=raw, data=F32.tobytes()), "duplicate key 'w'")


# --- __metadata__ -----------------------------------------------------------------------------


@pytest.mark.parametrize("metadata,words", [
    ([["format", "pt"]], "got a list"), ("pt", "got a string"), (None, "got null"),
    ({"format": 1}, "'format' is an integer"), ({"a": {"b": "c"}}, "'a' is an object"),
])
def test_metadata_is_an_object_of_strings(tmp_path, metadata, words):
    path = _file(tmp_path, {"__metadata__": metadata, "w": W}, F32.tobytes())
    _rejected(path, "__metadata__ must be an object of string -> string", words)


# --- the entries ------------------------------------------------------------------------------


@pytest.mark.parametrize("entry", [[W], "F32", 16, None])
def test_entry_is_an_object(tmp_path, entry):
    _rejected(_file(tmp_path, {"w": entry}), "tensor 'w'", "not an object with dtype, shape")


@pytest.mark.parametrize("field", ["dtype", "shape", "data_offsets"])
def test_entry_has_every_field(tmp_path, field):
    entry = {k: v for k, v in W.items() if k != field}
    _rejected(_file(tmp_path, {"w": entry}, F32.tobytes()), f"tensor 'w': entry lacks '{field}'")


@pytest.mark.parametrize("dtype", ["F7", "f32", "", 4, None, ["F32"]])
def test_dtype_is_known(tmp_path, dtype):
    path = _file(tmp_path, {"w": {**W, "dtype": dtype}}, F32.tobytes())
    _rejected(path, "tensor 'w': unknown dtype", "known: F64, F32")


@pytest.mark.parametrize("shape", [[-2, -2], [2.0, 2], [2, "2"], [True, 4], [[2, 2]], "4", 4,
                                   None, {"0": 4}])
def test_shape_is_a_list_of_non_negative_ints(tmp_path, shape):
    path = _file(tmp_path, {"w": {**W, "shape": shape}}, F32.tobytes())
    _rejected(path, "tensor 'w': shape must be a list of non-negative integers")


@pytest.mark.parametrize("offsets", [[0], [0, 16, 32], [], ["0", "16"], [-16, 0], [0, 16.0],
                                     [-10**30, 16], [False, 16], None, 16, {"0": 16}])
def test_data_offsets_are_two_non_negative_ints(tmp_path, offsets):
    path = _file(tmp_path, {"w": {**W, "data_offsets": offsets}}, F32.tobytes())
    _rejected(path, "tensor 'w': data_offsets must be a list of two non-negative integers")


def test_data_offsets_begin_after_end(tmp_path):
    path = _file(tmp_path, {"w": {**W, "data_offsets": [16, 0]}}, F32.tobytes())
    _rejected(path, "tensor 'w': data_offsets [16, 0] begin after end")


def test_span_matches_shape_and_dtype(tmp_path):
    entry = {**W, "data_offsets": [0, 12]}
    path = _file(tmp_path, {"layers.0.w": entry}, F32.tobytes()[:12])
    message = _rejected(path)
    assert message == (f"{path}: tensor 'layers.0.w': data_offsets [0, 12] span 12 bytes, but "
                       "shape [2, 2] x F32 needs 16")
    huge = {**W, "shape": [10**18, 10**18, 10**18]}  # no giant product, no overflow
    _rejected(_file(tmp_path, {"w": huge}, F32.tobytes()), f"x F32 needs more than {2**64}")


# --- the layout of the data section -----------------------------------------------------------


def test_spans_must_not_overlap(tmp_path):
    header = {"a": W, "b": {**W, "data_offsets": [8, 24]}}
    _rejected(_file(tmp_path, header, bytes(24)), "tensor 'b': data_offsets [8, 24] overlap "
              "tensor 'a', which ends at 16")
    twice = {"a": W, "b": W}  # both views of the same bytes
    _rejected(_file(tmp_path, twice, F32.tobytes()), "overlap tensor 'a'")


def test_spans_start_at_zero(tmp_path):
    header = {"w": {**W, "data_offsets": [8, 24]}}
    _rejected(_file(tmp_path, header, bytes(24)), "tensor 'w': data_offsets [8, 24] leave a "
              "gap: the data starts at 0")


def test_spans_are_contiguous(tmp_path):
    header = {"a": W, "b": {**W, "data_offsets": [24, 40]}}
    _rejected(_file(tmp_path, header, bytes(40)), "tensor 'b'", "leave a gap: tensor 'a' ends "
              "at 16")


@pytest.mark.parametrize("data,holds", [(F32.tobytes()[:8], 8), (F32.tobytes() + b"xx", 18),
                                        (b"", 0)])
def test_spans_cover_the_data_section(tmp_path, data, holds):
    _rejected(_file(tmp_path, {"w": W}, data), f"cover 16 bytes of data, but the data section "
              f"holds {holds}")
    if holds:
        _rejected(_file(tmp_path, {}, data), f"cover 0 bytes of data, but the data section "
                  f"holds {holds}")


# --- random corruption ------------------------------------------------------------------------

JSON = hs.recursive(hs.none() | hs.booleans() | hs.integers(-2**70, 2**70) | hs.text(max_size=4)
                    | hs.floats(allow_nan=False), lambda inner: hs.lists(inner, max_size=3)
                    | hs.dictionaries(hs.text(max_size=3), inner, max_size=3), max_leaves=6)


def _loads_or_raises_one_line(path):
    """A damaged file either loads consistently or raises SafetensorsError in one line."""
    try:
        tensors = st.load(path)
    except st.SafetensorsError as err:
        assert "\n" not in str(err)
        return
    _consistent(path, tensors)


def _consistent(path, tensors):
    """What loaded tiles the data section exactly."""
    size = os.path.getsize(path) - 8 - struct.unpack("<Q", path.read_bytes()[:8])[0]
    assert sum(t.nbytes for t in tensors.values()) == size


@settings(max_examples=150, deadline=None, suppress_health_check=TMP_OK)
@given(hs.sampled_from(["a", "b", "__metadata__"]),
       hs.sampled_from([None, "dtype", "shape", "data_offsets"]), JSON)
def test_random_field_values_load_or_raise_safetensors_error(tmp_path, name, field, value):
    header = {"__metadata__": {"format": "pt"}, "a": W,
              "b": {"dtype": "I8", "shape": [4], "data_offsets": [16, 20]}}
    if field is None or name == "__metadata__":
        header[name] = value
    else:
        header[name] = {**header[name], field: value}
    path = _file(tmp_path, header, F32.tobytes() + b"\x01\x02\x03\x04")
    _loads_or_raises_one_line(path)


@settings(max_examples=200, deadline=None, suppress_health_check=TMP_OK)
@given(hs.lists(hs.tuples(hs.integers(0, 10**6), hs.integers(0, 255),
                          hs.sampled_from(["set", "insert", "delete"])), min_size=1, max_size=4),
       hs.booleans())
def test_random_header_bytes_load_or_raise_safetensors_error(tmp_path, edits, fix_length):
    header = {"__metadata__": {"format": "pt"}, "a": W,
              "b": {"dtype": "I8", "shape": [4], "data_offsets": [16, 20]}}
    raw = bytearray(json.dumps(header).encode())
    for at, byte, kind in edits:
        at %= len(raw) + 1
        if kind == "insert":
            raw.insert(at, byte)
        elif raw and kind == "delete":
            del raw[at % len(raw)]
        elif raw:
            raw[at % len(raw)] = byte
    path = _file(tmp_path, raw=bytes(raw), data=F32.tobytes() + b"\x01\x02\x03\x04",
                 length=None if fix_length else len(json.dumps(header)))
    _loads_or_raises_one_line(path)


# --- index files ------------------------------------------------------------------------------


def _checkpoint(tmp_path, weight_map, *, index_text=None):
    """A checkpoint directory: config.json, two shards, an index with `weight_map`."""
    folder = tmp_path / "ckpt"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text("{}")
    st.save({"a": F32}, folder / "model-00001-of-00002.safetensors")
    st.save({"b": F32}, folder / "model-00002-of-00002.safetensors")
    index = folder / "model.safetensors.index.json"
    index.write_text(index_text if index_text is not None else
                     json.dumps({"metadata": {"total_size": 32}, "weight_map": weight_map}))
    return index


GOOD = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}


def test_index_lists_its_files(tmp_path):
    index = _checkpoint(tmp_path, GOOD)
    assert st.read_index(index) == sorted(GOOD.values())
    (tmp_path / "blob").write_bytes((index.parent / GOOD["b"]).read_bytes())
    (index.parent / GOOD["b"]).unlink()  # a symlink out, as in the Hugging Face cache: fine
    (index.parent / GOOD["b"]).symlink_to(tmp_path / "blob")
    assert st.read_index(index) == sorted(GOOD.values())


@pytest.mark.parametrize("file", ["../../etc/passwd", "/etc/passwd", "../x.safetensors",
                                  "sub/model.safetensors", "..", ".", "./" + GOOD["b"],
                                  "a\\..\\..\\x"])
def test_index_entries_stay_inside_the_directory(tmp_path, file):
    (tmp_path / "x.safetensors").write_bytes(b"")
    index = _checkpoint(tmp_path, {**GOOD, "b": file})
    _rejected(index, "weight_map entry 'b'", "must be a plain file name inside",
              reader=st.read_index)
    _rejected(index, "weight_map entry 'b'", reader=lambda _: hf.load(index.parent))


def test_index_entries_exist(tmp_path):
    index = _checkpoint(tmp_path, {**GOOD, "b": "model-00003-of-00002.safetensors"})
    _rejected(index, "weight_map entry 'b' -> 'model-00003-of-00002.safetensors'",
              "does not exist", reader=st.read_index)


@pytest.mark.parametrize("text,words", [
    ('{"weight_map": ', "invalid JSON"), ("[]", "top level is a list"),
    ('{"metadata": {}}', "needs a 'weight_map' object"),
    ('{"weight_map": ["a"]}', "needs a 'weight_map' object"),
    ('{"weight_map": {"a": 3}}', "non-empty string"), ('{"weight_map": {"a": ""}}', "non-empty"),
    ('{"weight_map":' * 10_000 + "1" + "}" * 10_000, "nested too deeply"),
])
def test_index_is_a_weight_map(tmp_path, text, words):
    _rejected(_checkpoint(tmp_path, None, index_text=text), words, reader=st.read_index)


def test_a_tensor_in_two_shards_is_refused(tmp_path):
    index = _checkpoint(tmp_path, GOOD)
    st.save({"a": F32}, index.parent / GOOD["b"])
    with pytest.raises(st.SafetensorsError, match="tensor 'a' is in both"):
        hf.load(index.parent)


def test_cli_shows_a_bad_file_as_one_line(tmp_path, capsys):
    from moebalance.cli import main

    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    _file(folder, {"w": {**W, "data_offsets": [-8, 8]}}, F32.tobytes(), name="model.safetensors")
    assert main(["convert", str(folder), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "data_offsets must be a list of two non-negative" in err, err
