"""Checkpoints on disk: safetensors headers read and checked (never unpickled), GGUF files through gguf_file.py, and the
files of a model found (one file, a folder with one file or shards + index, or a diffusers pipeline root)."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from ..errors import Flux2Error
from ..ggml import row_bytes
from .gguf_file import is_gguf, read_gguf

# ---------------------------------------------------------------------------------------------------------------
# 1. safetensors headers: read and check, never unpickle
# ---------------------------------------------------------------------------------------------------------------

# bytes per element of the safetensors dtype codes (sub-byte codes such as F4 are not size-checked)
ITEM_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
              "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}
PICKLE_SUFFIXES = {".ckpt", ".pt", ".pth", ".bin", ".pkl", ".pickle"}
MAX_HEADER = 100 * 2**20


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    name: str                  # the key as stored in the file
    dtype: str                 # safetensors dtype code: "BF16", "F8_E4M3", ...
    shape: tuple[int, ...]     # the logical shape (a GGUF tensor's too, whatever its blocks)
    offset: int                # where its bytes start in the file
    ggml: int | None = None    # GGUF tensors: the GGML type (dtype is its name: "Q4_K", "F16", ...)

    @property
    def quantized(self) -> bool:
        """Whether the tensor is GGML blocks (read as uint8 rows, ``ggml.dequantize`` makes the values)."""
        return self.dtype not in TORCH_DTYPES


# safetensors dtype codes -> torch dtypes (the ones ``read_tensor`` reads itself; F4 and the like go through safetensors)
TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """The tensors of one .safetensors file and its metadata, after checking that the file is whole."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        start = f.read(8)
        length = struct.unpack("<Q", start)[0] if len(start) == 8 else -1
        raw = f.read(length) if 0 < length <= min(size - 8, MAX_HEADER) else b""
    try:
        header = json.loads(raw) if raw[:1] == b"{" else None
    except (UnicodeDecodeError, json.JSONDecodeError):
        header = None
    if not isinstance(header, dict):
        refuse_other_format(path, start)
        raise Flux2Error(f"{path} is not a valid .safetensors file (its header cannot be read): the file is corrupt "
                         f"or only partly downloaded; download it again")
    metadata = header.pop("__metadata__", None) or {}
    data_size = size - 8 - length
    tensors = {}
    for name, entry in header.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(int(n) for n in entry["shape"]), entry["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise Flux2Error(f"{path} is corrupt: the header entry for {name!r} is malformed; download it again") from None
        if end > data_size:
            raise Flux2Error(f"{path} is truncated: tensor {name!r} ends at byte {end:,} of the data but the file holds "
                             f"only {data_size:,}; the download was probably interrupted, download it again")
        if dtype in ITEM_BYTES and end - begin != ITEM_BYTES[dtype] * math.prod(shape):
            raise Flux2Error(f"{path} is corrupt: tensor {name!r} ({dtype} {list(shape)}) has {end - begin:,} bytes")
        tensors[name] = TensorInfo(path, name, dtype, shape, 8 + length + begin)
    return tensors, metadata


def read_tensor(info: TensorInfo, file: BinaryIO) -> torch.Tensor:
    """One tensor's bytes read from the open ``file`` into a new CPU tensor: of ``info.dtype`` (in TORCH_DTYPES), or
    GGML blocks as uint8 rows [rows, row bytes].

    Plain reads, not a memory map: the process never holds the file's pages besides the tensors it keeps, so
    loading takes the memory of the weights alone (and a mapped view would need a copy anyway).
    """
    # zeros, not empty: memory first touched by torch's fill (large pages, both cores) is faster to read into than
    # memory the kernel faults in page by page during the read (2 GB: 0.63 s vs 1.0 s on our 2-core machine)
    if info.ggml is not None and info.quantized:
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
    """Raise a Flux2Error naming the format when a weights file is pickle-based or GGUF (nothing is loaded)."""
    if start[:4] == b"GGUF":
        raise Flux2Error(f"{path} is a GGUF file, which is read as a model, not here: use a .safetensors file")
    pickled = start[:1] == b"\x80" and start[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")    # pickle protocol 2-5
    if start[:4] == b"PK\x03\x04" or pickled or path.suffix.lower() in PICKLE_SUFFIXES:     # torch.save is a zip
        raise Flux2Error(f"{path} is a pickle-based checkpoint (.ckpt/.pt/.bin), not a .safetensors file. Pickle files "
                         f"can run arbitrary code when opened, so they are never loaded here: download the "
                         f".safetensors version of these weights (or convert the file once with a tool you trust)")


# ---------------------------------------------------------------------------------------------------------------
# 2. finding the files: a single file, a model folder, or a diffusers pipeline root
# ---------------------------------------------------------------------------------------------------------------

STANDARD_NAMES = ("diffusion_pytorch_model.safetensors", "model.safetensors")


@dataclass
class Checkpoint:
    path: Path                          # what the caller gave
    files: list[Path]
    tensors: dict[str, TensorInfo]      # every key of every file, as stored
    metadata: dict                      # safetensors metadata (merged over shards), or GGUF fields (gguf_file.py)
    config: dict                        # the folder's config.json ({} for a single file)
    root: Path | None                   # the pipeline root holding model_index.json, if any


def open_checkpoint(path: str | Path, subfolder: str) -> Checkpoint:
    """Find and check the safetensors files at ``path`` (a file, a model folder or a pipeline root)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise Flux2Error(f"weights not found: {path} does not exist; check the path (or the file name in the model "
                         f"folder)")
    folder = None
    if path.is_file():
        files = [path]
    else:
        folder = path / subfolder if (path / subfolder).is_dir() else path      # a diffusers pipeline root
        files = _folder_files(folder)
    tensors, metadata = {}, {}
    for file in files:
        found, meta = read_gguf(file) if is_gguf(file) else read_header(file)
        tensors.update(found)
        metadata.update(meta)
    config = read_json(folder / "config.json") if folder else {}
    root = next((p for p in ([folder, folder.parent] if folder else [path.parent])
                 if (p / "model_index.json").is_file()), None)
    return Checkpoint(path, files, tensors, metadata, config, root)


def _weight_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith((".safetensors", ".sft", ".gguf")))


def _folder_files(folder: Path) -> list[Path]:
    """The files of one model folder: those its index names, else its one .safetensors file."""
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if indexes:
        index = next((i for i in indexes if i.name[: -len(".index.json")] in STANDARD_NAMES), indexes[0])
        weight_map = read_json(index).get("weight_map", {})
        files = [folder / name for name in sorted(set(weight_map.values()))]
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


def read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise Flux2Error(f"{path} is not valid JSON ({e}); download it again") from None
