"""Weight-file headers as a careless or hostile user may hand them over: every malformed safetensors header,
config.json, shard index and GGUF header ends in a Flux2Error that names the file and the fault, never in another
exception, and a header that is accepted describes exactly the bytes safetensors' own reader reads.

Example tests take the rules of ``checkpoint.py`` and ``gguf_file.py`` one by one. Property tests (hypothesis) put
random JSON in each field, random bytes after a valid length, and cut, extend and corrupt valid files; the independent
judge is safetensors' Rust reader (``safe_open``): whatever we accept it accepts, with the same bytes per tensor.
"""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from flux2_core.errors import Flux2Error
from flux2_core.weights.checkpoint import DTYPE_BITS, TORCH_DTYPES, open_checkpoint, read_header, read_tensor
from flux2_core.weights.gguf_file import MAX_ARRAY_VALUES, MAX_ENTRIES, read_gguf

SETTINGS = settings(max_examples=150, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


# ---------------------------------------------------------------------------------------------------------------
# helpers: files written byte by byte, and safetensors' own reading of them
# ---------------------------------------------------------------------------------------------------------------

def write_safetensors(path: Path, header, data: bytes = b"", raw: bytes | None = None) -> Path:
    """A file of an 8-byte length, the header (JSON of ``header``, or ``raw`` as is) and ``data``."""
    raw = json.dumps(header).encode() if raw is None else raw
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def one_tensor(**fields) -> dict:
    """A header of one F32 [2, 3] tensor (24 bytes at 0), with ``fields`` replacing its own."""
    return {"t": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24], **fields}}


def theirs(path: Path) -> dict[str, torch.Tensor] | None:
    """safetensors' reading of the file: every tensor torch can hold, or None when it refuses the header."""
    try:
        with safe_open(str(path), "pt") as f:
            names = f.keys()                      # a safe_open handle is not a dict: no "in f"
            return {k: f.get_tensor(k) for k in names if f.get_slice(k).get_dtype() in TORCH_DTYPES}
    except SafetensorError:
        return None


def ours(path: Path) -> dict[str, torch.Tensor] | None:
    """Our reading of the file (header checked, then each torch-readable tensor read), or None on a Flux2Error."""
    try:
        infos, _ = read_header(path)
    except Flux2Error:
        return None
    size = path.stat().st_size
    with open(path, "rb") as f:
        for info in infos.values():       # every tensor's declared bytes lie inside the file
            assert info.offset + DTYPE_BITS[info.dtype] * int(np.prod(info.shape)) // 8 <= size
        return {name: read_tensor(info, f) for name, info in infos.items() if info.dtype in TORCH_DTYPES}


def assert_ours_within_theirs(path: Path) -> None:
    """We accept only files safetensors accepts, and read the same bytes from them."""
    mine = ours(path)
    if mine is None:
        return
    reference = theirs(path)
    assert reference is not None, "accepted a header safetensors refuses"
    assert mine.keys() == reference.keys()
    for name, tensor in mine.items():
        assert tensor.dtype == reference[name].dtype and tensor.shape == reference[name].shape
        assert tensor.reshape(-1).view(torch.uint8).tolist() == reference[name].reshape(-1).view(torch.uint8).tolist()


@pytest.fixture(scope="module")
def valid_file(tmp_path_factory) -> Path:
    """A file written by safetensors itself: several dtypes, a scalar, an empty tensor, metadata."""
    g = torch.Generator().manual_seed(0)
    state = {"a": torch.randn(3, 4, generator=g), "b": torch.randn(5, generator=g).to(torch.bfloat16),
             "c": torch.arange(6, dtype=torch.int8).reshape(2, 3), "scalar": torch.tensor(1.5, dtype=torch.float16),
             "empty": torch.zeros(0, 3)}
    path = tmp_path_factory.mktemp("valid") / "valid.safetensors"
    save_file(state, str(path), metadata={"format": "pt"})
    return path


# ---------------------------------------------------------------------------------------------------------------
# safetensors: one example per rule
# ---------------------------------------------------------------------------------------------------------------

BAD_HEADERS = {
    "entry not an object": ({"t": [0, 24]}, 24, r"tensor 't' is described by \[0, 24\]"),
    "dtype unknown": (one_tensor(dtype="F17"), 24, r"tensor 't' has the dtype 'F17', which is not a safetensors"),
    "dtype not a string": (one_tensor(dtype=4), 24, "has the dtype 4"),
    "dtype missing": ({"t": {"shape": [2, 3], "data_offsets": [0, 24]}}, 24, "has the dtype None"),
    "shape negative": (one_tensor(shape=[-2, -3]), 24, r"has the shape \[-2, -3\], not a list of whole numbers"),
    "shape of floats": (one_tensor(shape=[2.0, 3]), 24, r"has the shape \[2.0, 3\]"),
    "shape of booleans": (one_tensor(shape=[True, 3], data_offsets=[0, 12]), 12, r"has the shape \[True, 3\]"),
    "shape a string": (one_tensor(shape="2,3"), 24, "has the shape '2,3'"),
    "shape over int64": (one_tensor(shape=[2**40, 2**40, 0], data_offsets=[0, 0]), 0, "at most 2\\*\\*63 elements"),
    "offsets reversed": (one_tensor(data_offsets=[24, 0]), 24, r"data_offsets \[24, 0\], not \[begin, end\]"),
    "offsets one number": (one_tensor(data_offsets=[24]), 24, r"data_offsets \[24\]"),
    "offsets three numbers": (one_tensor(data_offsets=[0, 24, 48]), 48, r"data_offsets \[0, 24, 48\]"),
    "offsets negative": (one_tensor(data_offsets=[-24, 0]), 24, r"data_offsets \[-24, 0\]"),
    "offsets floats": (one_tensor(data_offsets=[0.0, 24.0]), 24, r"data_offsets \[0.0, 24.0\]"),
    "size not dtype x shape": (one_tensor(data_offsets=[0, 20]), 20,
                               r"\(F32 \[2, 3\]\) takes 24 bytes, but its data_offsets span 20"),
    "sub-byte size not whole bytes": (one_tensor(dtype="F4", shape=[3], data_offsets=[0, 2]), 2,
                                      r"\(F4 \[3\]\) takes 12 bits, not a whole number of bytes"),
    "first tensor not at 0": (one_tensor(data_offsets=[8, 32]), 32, "the 8 bytes before tensor 't' belong to no"),
    "hole between tensors": ({**one_tensor(), "u": {"dtype": "U8", "shape": [4], "data_offsets": [28, 32]}}, 32,
                             "the 4 bytes before tensor 'u' belong to no tensor"),
    "overlapping tensors": ({**one_tensor(), "u": {"dtype": "U8", "shape": [4], "data_offsets": [20, 24]}}, 24,
                            "tensor 'u' overlaps tensor 't'"),
    "same bytes twice": ({**one_tensor(), "u": {"dtype": "F32", "shape": [6], "data_offsets": [0, 24]}}, 24,
                         "overlaps tensor"),
    "bytes after the last tensor": (one_tensor(), 30, "its last 6 bytes belong to no tensor"),
    "data cut short": (one_tensor(), 20,
                       r"is truncated: tensor 't' ends at byte 24 of the data but the file holds only 20.*download"),
    "metadata not strings": ({**one_tensor(), "__metadata__": {"format": 1}}, 24,
                             "its __metadata__ must map strings to strings, not {'format': 1}"),
    "metadata a list": ({**one_tensor(), "__metadata__": ["pt"]}, 24, r"its __metadata__ must map.*\['pt'\]"),
}


@pytest.mark.parametrize("case", BAD_HEADERS)
def test_each_bad_header_is_named(tmp_path, case):
    header, data_size, message = BAD_HEADERS[case]
    path = write_safetensors(tmp_path / "bad.safetensors", header, bytes(data_size))
    with pytest.raises(Flux2Error, match=message) as error:
        open_checkpoint(path, "")
    assert str(path) in str(error.value) and "download it again" in str(error.value)
    assert theirs(path) is None, "safetensors accepts it"


def framed(raw: bytes) -> bytes:
    return struct.pack("<Q", len(raw)) + raw


BAD_BYTES = {
    "shorter than the length": (b"\x05\x00\x00", "it has only 3 bytes"),
    "length past the file": (struct.pack("<Q", 1000) + b'{"t": 1}', "its header of 1,000 bytes runs past the end"),
    "length over the limit": (struct.pack("<Q", 100_000_001) + b"{}", "over safetensors' limit of 100,000,000"),
    "not starting with a brace": (framed(b"[{}]"), r"does not start with '\{'"),
    "not UTF-8": (framed(b'{"\xff": 1}'), "not valid JSON: 'utf-8' codec"),
    "not JSON": (framed(b'{"a": broken'), "not valid JSON: Expecting value"),
    "duplicate key": (framed(b'{"a": {}, "a": {}}'), "the key 'a' appears twice"),
    "NaN": (framed(b'{"a": NaN}'), "NaN is not a JSON value"),
    "4,301-digit number": (framed(b'{"a": ' + b"9" * 4301 + b"}"), "not valid JSON"),
    "nested 100,000 deep": (framed(b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"), "not valid JSON"),
}


@pytest.mark.parametrize("case", BAD_BYTES)
def test_each_bad_header_byte_string_is_named(tmp_path, case):
    content, message = BAD_BYTES[case]
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(Flux2Error, match=message) as error:
        read_header(path)
    assert f"{path} is not a valid .safetensors file" in str(error.value)


def test_what_the_format_allows_is_read(tmp_path):
    """Tensors listed out of offset order, sub-byte dtypes of whole bytes, empty tensors and scalars, null metadata,
    whitespace after the JSON, no tensors at all: all valid, and read as safetensors reads them."""
    header = {"late": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]},
              "early": {"dtype": "I16", "shape": [2, 2], "data_offsets": [0, 8]},
              "fp4": {"dtype": "F4", "shape": [2, 4], "data_offsets": [16, 20]},
              "fp6": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [20, 23]},
              "none": {"dtype": "BF16", "shape": [0, 5], "data_offsets": [23, 23]},
              "scalar": {"dtype": "U8", "shape": [], "data_offsets": [23, 24]}, "__metadata__": None}
    data = bytes(range(24))
    path = write_safetensors(tmp_path / "ok.safetensors", None, data, raw=json.dumps(header).encode() + b"   ")
    infos, metadata = read_header(path)
    assert metadata == {} and set(infos) == set(header) - {"__metadata__"}
    assert infos["late"].offset == 8 + len(json.dumps(header)) + 3 + 8
    assert infos["fp4"].shape == (2, 4) and infos["none"].shape == (0, 5) and infos["scalar"].shape == ()
    assert_ours_within_theirs(path)
    with open(path, "rb") as f:
        assert read_tensor(infos["early"], f).tolist() == [[256, 770], [1284, 1798]]     # little-endian pairs
    assert read_header(write_safetensors(tmp_path / "none.safetensors", {}))[0] == {}


# ---------------------------------------------------------------------------------------------------------------
# safetensors: property tests
# ---------------------------------------------------------------------------------------------------------------

JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
                    | st.text(max_size=6) | st.sampled_from(list(DTYPE_BITS)),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                    max_leaves=10)
OFFSETS = st.just([24, 28]) | st.lists(st.integers(22, 30), min_size=1, max_size=3)
SHAPES = st.sampled_from([[4], [2, 2], [1, 4, 1]]) | st.lists(st.integers(0, 4), max_size=3)
# per field: values near the valid ones (so that some files stay valid), or any JSON at all
FIELDS = {"dtype": st.sampled_from(list(DTYPE_BITS)), "shape": SHAPES,
          "data_offsets": OFFSETS, "__metadata__": st.none() | st.dictionaries(st.text(max_size=4), JSON, max_size=2),
          "entry": st.fixed_dictionaries({"dtype": st.sampled_from(["U8", "I8", "F16", "F4"]),
                                          "shape": SHAPES, "data_offsets": OFFSETS}),
          "header": JSON}


@SETTINGS
@given(field=st.sampled_from(list(FIELDS)), data=st.data())
def test_random_json_in_any_field(tmp_path, field, data):
    """A valid two-tensor header with one field (or the whole header) replaced by a value near the valid ones or by
    any JSON: some files stay valid (another 1-byte dtype, shape [2, 2], string metadata), most do not."""
    value = data.draw(FIELDS[field] | JSON)
    header = {**one_tensor(), "u": {"dtype": "U8", "shape": [4], "data_offsets": [24, 28]}}
    if field == "header":
        header = value
    elif field == "entry":
        header["u"] = value
    elif field == "__metadata__":
        header["__metadata__"] = value
    else:
        header["u"][field] = value
    path = write_safetensors(tmp_path / "fuzz.safetensors", header, bytes(range(28)))
    assert_ours_within_theirs(path)


@SETTINGS
@given(raw=st.binary(max_size=120) | st.binary(max_size=120).map(lambda b: b"{" + b), data=st.binary(max_size=64))
def test_random_bytes_after_a_valid_length(tmp_path, raw, data):
    assert_ours_within_theirs(write_safetensors(tmp_path / "fuzz.safetensors", None, data, raw=raw))


# two to four tensors of small shapes (one dimension in eight is 0: empty tensors share their offsets)
TENSORS = st.lists(st.tuples(st.sampled_from([*DTYPE_BITS, "F17"]),
                             st.lists(st.sampled_from([0, 1, 1, 2, 2, 3, 3, 4]), max_size=3)), min_size=2, max_size=4)
FAULTS = ["hole", "overlap", "size", "trailing bytes", "cut", "none", "nudges"]


def layout(tensors, fault: str, at: int, amount: int, nudges: list[int]) -> tuple[dict, int]:
    """Offsets laid out in order, then one fault: a gap or an overlap before tensor ``at``, its end off by ``amount``
    (the rest still contiguous), the data area longer or shorter, or every offset nudged at random."""
    header, end, data_size = {}, 0, None
    for i, (dtype, shape) in enumerate(tensors):
        size = -(-DTYPE_BITS.get(dtype, 8) * int(np.prod(shape)) // 8)
        shift = {"hole": amount, "overlap": -amount}.get(fault, 0) if i == at else 0
        begin = max(0, end + shift + (nudges[2 * i] if fault == "nudges" else 0))
        stop = begin + size + (amount if fault == "size" and i == at else 0)
        header[f"t{i}"] = {"dtype": dtype, "shape": shape,
                           "data_offsets": [begin, max(0, stop + (nudges[2 * i + 1] if fault == "nudges" else 0))]}
        end = stop
    data_size = end + {"trailing bytes": amount, "cut": -amount, "nudges": nudges[8]}.get(fault, 0)
    return header, max(0, data_size)


@settings(SETTINGS, max_examples=300)
@given(tensors=TENSORS, fault=st.sampled_from(FAULTS), at=st.integers(1, 3), amount=st.integers(1, 3),
       nudges=st.lists(st.integers(-3, 3), min_size=9, max_size=9), order=st.randoms())
def test_layouts_agree_with_safetensors(tmp_path, tensors, fault, at, amount, nudges, order):
    """Plausible headers, listed in any order, with one layout fault (at a tensor after the first) or none: we
    accept exactly the files safetensors accepts."""
    header, data_size = layout(tensors, fault, min(at, len(tensors) - 1), amount, nudges)
    names = list(header)
    order.shuffle(names)
    path = write_safetensors(tmp_path / "layout.safetensors", {n: header[n] for n in names},
                             (bytes(range(256)) * 16)[:data_size])
    assert (ours(path) is None) == (theirs(path) is None)
    assert_ours_within_theirs(path)


@SETTINGS
@given(data=st.data())
def test_cut_extended_and_corrupted_files(valid_file, tmp_path, data):
    """Every proper prefix and every extension of a valid file is refused; a file with one byte changed is refused or
    read as safetensors reads it."""
    content = valid_file.read_bytes()
    path = tmp_path / "damaged.safetensors"
    cut = data.draw(st.integers(0, len(content) - 1))
    path.write_bytes(content[:cut])
    with pytest.raises(Flux2Error):
        read_header(path)
    path.write_bytes(content + data.draw(st.binary(min_size=1, max_size=16)))
    with pytest.raises(Flux2Error, match="belong to no tensor"):
        read_header(path)
    at, value = data.draw(st.integers(0, len(content) - 1)), data.draw(st.integers(0, 255))
    path.write_bytes(content[:at] + bytes([value]) + content[at + 1:])
    assert_ours_within_theirs(path)


def test_the_valid_file_reads_as_safetensors_reads_it(valid_file):
    """The properties above compare against a file that does load: ours equals theirs on it."""
    assert ours(valid_file) is not None and read_header(valid_file)[1] == {"format": "pt"}
    assert_ours_within_theirs(valid_file)


# ---------------------------------------------------------------------------------------------------------------
# the JSON files around the weights
# ---------------------------------------------------------------------------------------------------------------

def test_config_json_must_be_an_object(tmp_path, valid_file):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(valid_file.read_bytes())
    (folder / "config.json").write_text("[1, 2, 3]")
    with pytest.raises(Flux2Error, match=r"the model's config.json \(.*config.json\) holds a JSON list, but it must "
                                         r"hold a JSON object"):
        open_checkpoint(folder, "")
    (folder / "config.json").write_text('{"a": ' + "9" * 5000 + "}")
    with pytest.raises(Flux2Error, match=r"config.json\) is not valid JSON.*download it again"):
        open_checkpoint(folder, "")
    (folder / "config.json").write_text('{"axes_dims_rope": [4, 4, 4, 4]}')
    assert open_checkpoint(folder, "").config == {"axes_dims_rope": [4, 4, 4, 4]}


@pytest.mark.parametrize("weight_map", [["model-1.safetensors"], {"a": "../outside.safetensors"},
                                        {"a": "/abs/model.safetensors"}, {"a": ".."}, {"a": 7}])
def test_shard_index_names_only_files_in_its_folder(tmp_path, valid_file, weight_map):
    folder = tmp_path / "sharded"
    folder.mkdir()
    (tmp_path / "outside.safetensors").write_bytes(valid_file.read_bytes())    # what "../" would have read
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(Flux2Error, match="is not a valid shard index: its weight_map must map tensor names to the "
                                         "names of files in its folder"):
        open_checkpoint(folder, "")
    (folder / "model.safetensors.index.json").write_text("[]")
    with pytest.raises(Flux2Error, match="holds a JSON list"):
        open_checkpoint(folder, "")


def test_a_path_that_is_neither_file_nor_folder(tmp_path):
    os.mkfifo(tmp_path / "pipe.safetensors")
    with pytest.raises(Flux2Error, match="is neither a file nor a folder"):
        open_checkpoint(tmp_path / "pipe.safetensors", "")


def comfy_quant_file(path: Path, meta: str | None = None, quant: tuple[str, bytes] | None = None) -> Path:
    """A one-layer fp8 file with ComfyUI's quantisation records: ``meta`` as _quantization_metadata, ``quant`` as
    (dtype, bytes) of the layer's .comfy_quant tensor."""
    header = {"w.weight": {"dtype": "F8_E4M3", "shape": [2, 2], "data_offsets": [0, 4]}}
    data = bytes(4)
    if meta is not None:
        header["__metadata__"] = {"_quantization_metadata": meta}
    if quant is not None:
        dtype, raw = quant
        n = len(raw) // (DTYPE_BITS[dtype] // 8)
        header["w.comfy_quant"] = {"dtype": dtype, "shape": [n], "data_offsets": [4, 4 + len(raw)]}
        data += raw
    return write_safetensors(path, header, data)


@pytest.mark.parametrize("meta,quant,message", [
    ("{not json", None, "its _quantization_metadata is not a JSON object"),
    ('{"layers": ' + "9" * 5000 + "}", None, "its _quantization_metadata is not a JSON object"),
    ("[1, 2]", None, "its _quantization_metadata is not a JSON object"),
    ('{"layers": ["w"]}', None, r"the layers of its _quantization_metadata are \['w'\], not a JSON object"),
    ('{"layers": {"w": {"format": ["float8_e4m3fn"]}}}', None, r"quantisation format \['float8_e4m3fn'\]"),
    (None, ("U8", b'{"format": "float8'), "w.comfy_quant is not a JSON object"),
    (None, ("U8", b"\xff\xfe"), "w.comfy_quant is not a JSON object"),
    (None, ("U8", b'["float8_e4m3fn"]'), "w.comfy_quant is not a JSON object"),
    (None, ("F32", struct.pack("<4f", 1, 2, 3, 4)), r"w.comfy_quant is F32 \[4\], not the bytes of JSON text"),
])
def test_bad_comfyui_quantisation_records(tmp_path, meta, quant, message):
    from flux2_core.storage.formats import stored_format
    from flux2_core.storage.stored_format import LayerFormat
    from flux2_core.weights.dequantize import comfy_formats

    ckpt = open_checkpoint(comfy_quant_file(tmp_path / "fp8.safetensors", meta, quant), "")
    with pytest.raises(Flux2Error, match=message):
        comfy_formats(ckpt, "")
    good = comfy_quant_file(tmp_path / "good.safetensors", quant=("U8", b'{"format": "float8_e4m3fn"}'))
    assert comfy_formats(open_checkpoint(good, ""), "") == {"w": LayerFormat(stored_format("float8_e4m3fn"), "float8_e4m3fn")}


# ---------------------------------------------------------------------------------------------------------------
# GGUF: hostile headers
# ---------------------------------------------------------------------------------------------------------------

def gguf_string(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def write_gguf(path: Path, fields=(), tensors=(), data: bytes = b"", counts: tuple[int, int] | None = None) -> Path:
    """A GGUF v3 file byte by byte: ``fields`` as (key, value type, payload bytes), ``tensors`` as (name, dims,
    GGML type, offset), then padding to 32 and ``data``; ``counts`` overrides the tensor and field counts."""
    n_tensors, n_fields = counts or (len(tensors), len(fields))
    out = b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_fields)
    for key, vtype, payload in fields:
        out += gguf_string(key) + struct.pack("<I", vtype) + payload
    for name, dims, ttype, offset in tensors:
        out += gguf_string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, ttype, offset)
    path.write_bytes(out + bytes(-len(out) % 32) + data)
    return path


V = GGUFValueType
F32 = GGMLQuantizationType.F32
NESTED = struct.pack("<IQ", V.ARRAY, 1) * 5000 + struct.pack("<IQ", V.UINT32, 0)

BAD_GGUF = {
    "garbage after the magic": ({}, "not a readable GGUF file"),
    "unknown value type": ({"fields": [("k", 99, b"")]}, r"99\)? is not a valid GGUFValueType"),
    "key not UTF-8": ({"fields": [(b"\xff\xfe", V.UINT32, struct.pack("<I", 1))]}, "utf-8"),
    "duplicate key": ({"fields": [("k", V.UINT32, struct.pack("<I", 1))] * 2}, "Duplicate k"),
    "array past the end": ({"fields": [("k", V.ARRAY, struct.pack("<IQ", V.UINT8, 1000) + bytes(10))]},
                           "the file ends at byte"),
    "array longer than any": ({"fields": [("k", V.ARRAY, struct.pack("<IQ", V.UINT8, 2**62))]},
                              f"claims 4,611,686,018,427,387,904 array values, more than the {MAX_ARRAY_VALUES:,}"),
    "arrays nested 5,000 deep": ({"fields": [("k", V.ARRAY, NESTED)]}, "recursion"),
    "string past the end": ({"fields": [("k", V.STRING, struct.pack("<Q", 2**63))]}, "the file ends at byte"),
    "more tensors than any": ({"counts": (2**40, 0)}, f"claims 1,099,511,627,776 tensors, more than the {MAX_ENTRIES:,}"),
    "more fields than any": ({"counts": (0, 2**64 - 1)}, "metadata fields, more than"),
    "unknown tensor type": ({"tensors": [("w", [4], 250, 0)], "data": bytes(16)}, r"250\)? is not a valid GGMLQuantizationType"),
    "dims past int64": ({"tensors": [("w", [2**64 - 1], F32, 0)], "data": bytes(16)}, "not a readable|is corrupt"),
    "dims overflowing": ({"tensors": [("w", [0, 2**40, 2**40], F32, 0)], "data": bytes(16)},
                         "not a readable|is corrupt"),
    "many dims": ({"tensors": [("w", [1] * 70, F32, 0)], "data": bytes(16)}, "not a readable"),
    "tensor past the end": ({"tensors": [("w", [64], F32, 0)], "data": bytes(16)}, "the file ends at byte"),
    "offset past the end": ({"tensors": [("w", [4], F32, 2**63)], "data": bytes(16)}, "the file ends at byte"),
    "alignment not a power of two": ({"fields": [("general.alignment", V.UINT32, struct.pack("<I", 3))]},
                                     "alignment"),
    "orig_shape a string": ({"fields": [("comfy.gguf.orig_shape.w", V.STRING, gguf_string("4,4"))],
                             "tensors": [("w", [16], F32, 0)], "data": bytes(64)},
                            "'comfy.gguf.orig_shape.w' should be a tensor shape .*not '4,4'"),
    "orig_shape negative": ({"fields": [("comfy.gguf.orig_shape.w", V.ARRAY,
                                         struct.pack("<IQii", V.INT32, 2, -4, -4))],
                             "tensors": [("w", [16], F32, 0)], "data": bytes(64)}, r"not \[-4, -4\]"),
    "architecture a number": ({"fields": [("general.architecture", V.UINT32, struct.pack("<I", 7))]},
                              "'general.architecture' should be a str, not 7"),
    "tokens not strings": ({"fields": [("tokenizer.ggml.tokens", V.ARRAY, struct.pack("<IQII", V.UINT32, 2, 1, 2))]},
                           r"'tokenizer.ggml.tokens' should be a list of strings, not \[1, 2\]"),
}


@pytest.mark.parametrize("case", BAD_GGUF)
def test_each_bad_gguf_header_is_named(tmp_path, case):
    spec, message = BAD_GGUF[case]
    path = tmp_path / "bad.gguf"
    if case == "garbage after the magic":
        path.write_bytes(b"GGUF" + bytes(range(255, 155, -1)))
    else:
        write_gguf(path, **spec)
    start = time.perf_counter()
    with pytest.raises(Flux2Error, match=message) as error:
        open_checkpoint(path, "")
    assert time.perf_counter() - start < 5, "a hostile count was looped over"
    assert str(path) in str(error.value) and "download it again" in str(error.value)


def test_hand_written_gguf_reads_back(tmp_path):
    """The writer above makes files gguf's own reader and ours read, so the bad cases differ from a good one only
    by their fault."""
    values = np.arange(16, dtype=np.float32)
    path = write_gguf(tmp_path / "ok.gguf", [("general.architecture", V.STRING, gguf_string("flux")),
                                             ("comfy.gguf.orig_shape.w", V.ARRAY, struct.pack("<IQii", V.INT32, 2, 4, 4))],
                      [("w", [16], F32, 0)], values.tobytes())
    tensors, metadata = read_gguf(path)
    assert metadata == {"general.architecture": "flux"} and tensors["w"].shape == (4, 4)
    with open(path, "rb") as f:
        assert read_tensor(tensors["w"], f).reshape(-1).tolist() == values.tolist()


@pytest.fixture(scope="module")
def valid_gguf(tmp_path_factory) -> tuple[Path, dict[str, bytes]]:
    """A small GGUF written by gguf's writer (F32, F16 and Q8_0 tensors, a token list), and each tensor's bytes as
    gguf's reader reads them."""
    path = tmp_path_factory.mktemp("gguf") / "valid.gguf"
    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(path), "flux")
    writer.add_token_list(["a", "b", "c"])
    writer.add_tensor("f32", rng.standard_normal((2, 8)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal(8).astype(np.float16))
    writer.add_tensor("q8", rng.integers(0, 256, (2, 34), dtype=np.uint8), raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, {t.name: t.data.tobytes() for t in GGUFReader(path).tensors}


def assert_gguf_reads_within_the_file(path: Path, expected: dict[str, bytes] | None = None) -> None:
    """read_gguf refuses the file (Flux2Error) or gives tensors whose bytes lie inside it (and equal ``expected``)."""
    try:
        tensors, _ = read_gguf(path)
    except Flux2Error:
        return
    size = path.stat().st_size
    with open(path, "rb") as f:
        for name, info in tensors.items():
            raw = read_tensor(info, f)
            assert info.offset + raw.numel() * raw.element_size() <= size
            if expected is not None and name in expected:
                assert raw.reshape(-1).view(torch.uint8).numpy().tobytes() == expected[name]


@SETTINGS
@given(tail=st.binary(max_size=200), version=st.sampled_from([2, 3, 4, 2**32 - 1]))
def test_random_bytes_after_the_magic(tmp_path, tail, version):
    path = tmp_path / "fuzz.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<I", version) + tail)
    assert_gguf_reads_within_the_file(path)


@SETTINGS
@given(data=st.data())
def test_cut_and_corrupted_gguf(valid_gguf, tmp_path, data):
    """A GGUF cut anywhere, or with one to four bytes changed, is refused or read within its bytes (a cut that keeps
    every tensor whole, in the last padding, reads the same tensors)."""
    source, expected = valid_gguf
    content = source.read_bytes()
    path = tmp_path / "damaged.gguf"
    path.write_bytes(content[: data.draw(st.integers(4, len(content) - 1))])
    assert_gguf_reads_within_the_file(path, expected)
    damaged = bytearray(content)
    for _ in range(data.draw(st.integers(1, 4))):
        damaged[data.draw(st.integers(4, len(content) - 1))] = data.draw(st.integers(0, 255))
    path.write_bytes(bytes(damaged))
    assert_gguf_reads_within_the_file(path)


def test_the_valid_gguf_reads_as_gguf_reads_it(valid_gguf, tmp_path):
    path, expected = valid_gguf
    tensors, metadata = read_gguf(path)
    assert set(tensors) == set(expected) and metadata["tokenizer.ggml.tokens"] == ["a", "b", "c"]
    assert_gguf_reads_within_the_file(path, expected)


def test_a_valid_dtype_torch_cannot_hold_is_named_when_read(tmp_path):
    """F6 is a valid safetensors dtype (accepted in the header) that neither torch nor safetensors' torch backend
    can hold: reading such a tensor is a Flux2Error naming it; an F4 tensor beside it reads."""
    from types import SimpleNamespace

    from flux2_core.weights.loading import TensorReader

    path = write_safetensors(tmp_path / "fp6.safetensors", {
        "fp6": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [0, 3]},
        "fp4": {"dtype": "F4", "shape": [2, 4], "data_offsets": [3, 7]}}, bytes(range(7)))
    reader = TensorReader(SimpleNamespace(ckpt=open_checkpoint(path, "")), torch.device("cpu"))
    assert reader.raw("fp4").view(torch.uint8).tolist() == [[3, 4], [5, 6]]      # two E2M1 values per byte
    with pytest.raises(Flux2Error, match=r"tensor 'fp6' is stored as F6_E2M3, which cannot be read here"):
        reader.raw("fp6")


def test_only_gguf_blocks_count_as_quantized(tmp_path):
    """A safetensors dtype torch cannot hold (F4) is safetensors' to read, never handed to the GGML dequantizer;
    GGUF block types are, GGUF float types are not."""
    from flux2_core.weights.checkpoint import TensorInfo

    assert not TensorInfo(tmp_path, "w", "F4", (2, 4), 0).quantized
    assert TensorInfo(tmp_path, "w", "Q4_K", (2, 256), 0, ggml=12).quantized
    assert not TensorInfo(tmp_path, "w", "F16", (2, 256), 0, ggml=1).quantized


def test_metadata_arrays_read_as_gguf_reads_them(tmp_path):
    """Our one-pass reading of array fields (a tokenizer's strings, its token types, an orig_shape) gives what gguf's
    own reader gives, for every field (gguf's own takes seconds for a large vocabulary: 20,000 tokens here)."""
    from gguf import GGUFReader, GGUFWriter

    from flux2_core.weights.gguf_file import _StrictReader

    path = tmp_path / "vocab.gguf"
    writer = GGUFWriter(str(path), "qwen3")
    tokens = [f"tok{i}é" if i % 7 else "" for i in range(20_000)]             # empty and multi-byte strings too
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([i % 5 for i in range(20_000)])
    writer.add_token_merges([f"a{i} b" for i in range(1000)])
    writer.add_array("comfy.gguf.orig_shape.x", [3, 4])
    writer.add_array("empty", [])
    writer.add_tensor("x", np.zeros((3, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours, theirs = _StrictReader(path), GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        assert ours.fields[key].contents() == field.contents(), key
    tensors, metadata = read_gguf(path)
    assert metadata["tokenizer.ggml.tokens"] == tokens and tensors["x"].shape == (3, 4)
