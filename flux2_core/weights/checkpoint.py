"""Checkpoints on disk: a model's files found (a file, a folder, shards + index, a diffusers root) and every
safetensors header checked whole before any tensor is read; nothing is unpickled. The checks follow safetensors' own
reader, so a file it refuses is refused here first, with the file, the tensor and the fault named.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import BinaryIO

import torch

from ..errors import Flux2Error
from ..storage.ggml import row_bytes
from ..user_json import read_json_file
from .gguf_file import is_gguf, read_gguf
from .tensors import MAX_COUNT, TORCH_DTYPES, Checkpoint, TensorInfo, element_count, short

# --- safetensors headers ---------------------------------------------------------------------------------------

# bits per element of every dtype code safetensors knows (its ``Dtype::bitsize``)
DTYPE_BITS = {"BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8,
              "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
              "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64}
PICKLE_SUFFIXES = {".ckpt", ".pt", ".pth", ".bin", ".pkl", ".pickle"}
MAX_HEADER = 100_000_000    # safetensors' own limit (MAX_HEADER_SIZE)


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    size, raw = _header_bytes(path)
    header = _parse_header(path, raw)
    metadata = _metadata(path, header.pop("__metadata__", None))
    entries = {name: _entry(path, name, entry) for name, entry in header.items()}
    _check_layout(path, entries, size - 8 - len(raw))
    return {name: TensorInfo(path, name, dtype, shape, 8 + len(raw) + begin)
            for name, (dtype, shape, begin, _) in entries.items()}, metadata


def invalid(path: Path, problem: str) -> Flux2Error:
    return Flux2Error(f"{path} is not a valid .safetensors file ({problem}): it is corrupt or only partly downloaded; "
                      f"download it again")


def unreadable(path: Path, error: OSError) -> Flux2Error:
    return Flux2Error(f"{path} cannot be read ({error.strerror or error}); check that it is a file you may read")


def _header_bytes(path: Path) -> tuple[int, bytes]:
    """(file size, header bytes)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            start = f.read(8)
            length = struct.unpack("<Q", start)[0] if len(start) == 8 else 0
            raw = f.read(length) if length <= min(size - 8, MAX_HEADER) else b""
    except OSError as e:
        raise unreadable(path, e) from None
    if raw[:1] != b"{":
        refuse_other_format(path, start)
        raise invalid(path, _no_header(size, len(start), length))
    return size, raw


def _no_header(size: int, got: int, length: int) -> str:
    if got < 8:
        return f"it has only {size} bytes"
    if length > MAX_HEADER:
        return f"its header length {length:,} is over safetensors' limit of {MAX_HEADER:,}"
    if length > size - 8:
        return f"its header of {length:,} bytes runs past the end of the file"
    return "its header does not start with '{'"


def _parse_header(path: Path, raw: bytes) -> dict:
    """UTF-8 JSON without duplicate keys or NaN / Infinity."""
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:        # JSONDecodeError, UnicodeDecodeError, over-long ints, the hooks
        raise invalid(path, f"its header is not valid JSON: {e}") from None


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    seen = set()
    for key, _ in pairs:
        if key in seen:
            raise ValueError(f"the key {short(key)} appears twice")
        seen.add(key)
    return dict(pairs)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def _metadata(path: Path, metadata) -> dict[str, str]:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise invalid(path, f"its __metadata__ must map strings to strings, not {short(metadata)}")
    return metadata


def _naturals(value) -> bool:
    """JSON true/false and 2.0 are not whole numbers here."""
    return isinstance(value, list) and all(type(n) is int and 0 <= n <= MAX_COUNT for n in value)


def _entry(path: Path, name: str, entry) -> tuple[str, tuple[int, ...], int, int]:
    """(dtype, shape, begin, end), its byte size matching dtype x shape."""
    def bad(problem: str) -> Flux2Error:
        return invalid(path, f"tensor {short(name)} {problem}")

    if not isinstance(entry, dict):
        raise bad(f"is described by {short(entry)}, not by a JSON object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise bad(f"has the dtype {short(dtype)}, which is not a safetensors dtype")
    if not _naturals(shape) or element_count(shape) is None:
        raise bad(f"has the shape {short(shape)}, not a list of whole numbers >= 0 of at most 2**63 elements")
    if not _naturals(offsets) or len(offsets) != 2 or offsets[0] > offsets[1]:
        raise bad(f"has the data_offsets {short(offsets)}, not [begin, end] with 0 <= begin <= end")
    bits, span = element_count(shape) * DTYPE_BITS[dtype], offsets[1] - offsets[0]
    if bits % 8:
        raise bad(f"({dtype} {short(shape)}) takes {bits:,} bits, not a whole number of bytes")
    if span != bits // 8:
        raise bad(f"({dtype} {short(shape)}) takes {bits // 8:,} bytes, but its data_offsets span {span:,}")
    return dtype, tuple(shape), offsets[0], offsets[1]


def _check_layout(path: Path, entries: dict[str, tuple], data_size: int) -> None:
    """No tensor past the end (a cut download), none overlapping, no bytes that belong to no tensor."""
    done, previous = 0, None
    for name, (_, _, begin, end) in sorted(entries.items(), key=lambda item: item[1][2:]):
        if end > data_size:
            raise Flux2Error(f"{path} is truncated: tensor {short(name)} ends at byte {end:,} of the data but the file "
                             f"holds only {data_size:,}; the download was probably interrupted, download it again")
        if begin < done:
            raise invalid(path, f"tensor {short(name)} overlaps tensor {short(previous)}")
        if begin > done:
            raise invalid(path, f"the {begin - done:,} bytes before tensor {short(name)} belong to no tensor")
        done, previous = end, name
    if done != data_size:
        raise invalid(path, f"its last {data_size - done:,} bytes belong to no tensor")


def read_tensor(info: TensorInfo, file: BinaryIO) -> torch.Tensor:
    """A new CPU tensor (GGML blocks as uint8 [rows, row bytes]). Plain reads, not a memory map, so loading takes the
    memory of the weights alone.
    """
    # zeros, not empty: memory touched by torch's fill is faster to read into than memory faulted in page by page
    if info.quantized:
        tensor = torch.zeros(math.prod(info.shape[:-1]), row_bytes(info.ggml, info.shape[-1]), dtype=torch.uint8)
    else:
        tensor = torch.zeros(info.shape, dtype=TORCH_DTYPES[info.dtype])
    target = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
    file.seek(info.offset)
    done = 0
    while done < len(target):
        n = file.readinto(target[done:])
        if not n:
            raise Flux2Error(f"{info.file} ended inside tensor {info.name!r}: the file changed or was cut while "
                             f"loading; download it again")
        done += n
    return tensor


def refuse_other_format(path: Path, start: bytes) -> None:
    if start[:4] == b"GGUF":
        raise Flux2Error(f"{path} is a GGUF file, which is read as a model, not here: use a .safetensors file")
    pickled = start[:1] == b"\x80" and start[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")    # pickle protocol 2-5
    if start[:4] == b"PK\x03\x04" or pickled or path.suffix.lower() in PICKLE_SUFFIXES:     # torch.save is a zip
        raise Flux2Error(f"{path} is a pickle-based checkpoint (.ckpt/.pt/.bin), not a .safetensors file. Pickle files "
                         f"can run arbitrary code when opened, so they are never loaded here: download the "
                         f".safetensors version of these weights (or convert the file once with a tool you trust)")
    text = _text_start(path)
    if text:
        raise Flux2Error(f"{path} is not a valid weights file but text (it begins {text!r}): {_text_fix(text)}")
    if path.suffix.lower() == ".gguf":
        raise Flux2Error(f"{path} is not a valid GGUF file (it does not begin with the letters GGUF that every GGUF "
                         f"file begins with): it is corrupt or only partly downloaded; download it again")


def _text_start(path: Path) -> str:
    """The first line of a file that begins with text (a Git LFS pointer, an error page), else "". Weights never
    do: as a header length, text would be far past safetensors' limit."""
    try:
        with open(path, "rb") as f:
            start = f.read(256)
    except OSError:
        return ""
    text = start.removeprefix(b"\xef\xbb\xbf").decode("utf-8", "replace")     # a BOM, then UTF-8 (a page in any language)
    head = text[:48]
    if not head.strip() or "\ufffd" in head or not all(c.isprintable() or c in "\t\n\r" for c in head):
        return ""
    return text.strip().splitlines()[0][:80]


def _text_fix(text: str) -> str:
    if text.startswith("version https://git-lfs"):
        return ("a Git LFS pointer, left where the file should be by a clone without its large files: run "
                "'git lfs pull' in that repository, or download the file itself")
    if text.startswith("<"):
        return ("a web page saved instead of the file (a login, licence or error page): download the file itself, "
                "logged in and with the model's licence accepted where it asks for that")
    return "not the file itself (perhaps a server's error message): download it again"


# --- finding the files: a single file, a model folder, or a diffusers pipeline root ----------------------------

STANDARD_NAMES = ("diffusion_pytorch_model.safetensors", "model.safetensors")


def open_checkpoint(path: str | Path, subfolder: str) -> Checkpoint:
    path = Path(path).expanduser()
    if not path.exists():
        raise Flux2Error(f"weights not found: {path} does not exist; check the path (or the file name in the model "
                         f"folder)")
    folder = None
    if path.is_file():
        files = [path]
    elif path.is_dir():
        folder = path / subfolder if (path / subfolder).is_dir() else path      # a diffusers pipeline root
        files = _folder_files(folder)
    else:
        raise Flux2Error(f"{path} is neither a file nor a folder; pass a weights file or a model folder")
    tensors, metadata = {}, {}
    for file in files:
        try:
            gguf = is_gguf(file)
        except OSError as e:
            raise unreadable(file, e) from None
        found, meta = read_gguf(file) if gguf else read_header(file)
        tensors.update(found)
        metadata.update(meta)
    role = subfolder.replace("_", " ") or "model"
    config = read_json(folder / "config.json", f"the {role}'s config.json") if folder else {}
    root = next((p for p in ([folder, folder.parent] if folder else [path.parent])
                 if (p / "model_index.json").is_file()), None)
    return Checkpoint(path, files, tensors, metadata, config, root)


def _weight_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith((".safetensors", ".sft", ".gguf")))


def _folder_files(folder: Path) -> list[Path]:
    """Those its index names, else its one .safetensors file."""
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if indexes:
        index = next((i for i in indexes if i.name[: -len(".index.json")] in STANDARD_NAMES), indexes[0])
        files = [folder / name for name in _shard_names(index)]
        missing = [f.name for f in files if not f.is_file()]
        if not files or missing:
            raise Flux2Error(f"{index} names shards that are not in {folder}: {', '.join(missing[:5]) or 'none'}; "
                             f"download the missing files")
        return files
    files = _weight_files(folder)
    standard = [f for f in files if f.name in STANDARD_NAMES]
    if len(standard) == 1 or len(files) == 1:
        return standard or files
    if files:
        raise Flux2Error(f"{folder} holds several .safetensors files ({', '.join(f.name for f in files[:5])}) and no "
                         f"*.safetensors.index.json; pass the path of one file")
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
    if pickles:
        raise Flux2Error(f"{folder} has only pickle-based weights ({', '.join(pickles[:3])}), which are never loaded "
                         f"here because they can run code; download the .safetensors version")
    raise Flux2Error(f"{folder} holds no .safetensors or .gguf weights; pass a weights file or a model folder")


def _shard_names(index: Path) -> list[str]:
    """Plain file names only, so a downloaded index cannot send reads outside its folder."""
    weight_map = read_json(index, "the shard index of the weights").get("weight_map", {})
    names = set(weight_map.values()) if isinstance(weight_map, dict) else {None}
    if not all(isinstance(n, str) and n != ".." and Path(n).name == n for n in names):
        raise Flux2Error(f"{index} is not a valid shard index: its weight_map must map tensor names to the names of "
                         f"files in its folder, not {short(weight_map)}; download it again")
    return sorted(names)


def read_json(path: Path, what: str) -> dict:
    """{} when there is no file; ``what``: what the file is, for messages."""
    if not path.is_file():
        return {}
    return read_json_file(path, dict, "download it again", what)
