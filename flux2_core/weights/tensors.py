"""What a weight file holds, as the readers describe it (``checkpoint.py`` for safetensors, ``gguf_file.py`` for
GGUF): each tensor's place and type, and a checkpoint's tensors, metadata and config. Data only: both readers and the
key mapping build on it, so it imports none of them."""

from __future__ import annotations

import reprlib
from dataclasses import dataclass
from pathlib import Path

import torch

MAX_COUNT = 2**63 - 1       # torch sizes are int64: every dimension and every running product of them must fit


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
        """Whether the tensor is GGML blocks (read as uint8 rows, ``ggml.dequantize`` makes the values); a
        safetensors dtype torch cannot hold (F4, F6) is not, it stays safetensors' to read."""
        return self.ggml is not None and self.dtype not in TORCH_DTYPES


# safetensors dtype codes -> torch dtypes (the ones ``read_tensor`` reads itself; F4 and the like go through safetensors)
TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


@dataclass
class Checkpoint:
    path: Path                          # what the caller gave
    files: list[Path]
    tensors: dict[str, TensorInfo]      # every key of every file, as stored
    metadata: dict                      # safetensors metadata (merged over shards), or GGUF fields (gguf_file.py)
    config: dict                        # the folder's config.json ({} for a single file)
    root: Path | None                   # the pipeline root holding model_index.json, if any


def short(value) -> str:
    """repr() cut short in length and depth: a hostile header's values can be megabytes long or nested deep."""
    return _SHORT.repr(value)


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = 3, 80, 80, 40


def element_count(shape) -> int | None:
    """The number of elements of ``shape`` (whole numbers >= 0), or None when a running product passes MAX_COUNT
    (multiplied in order, as safetensors and torch do, so [2**40, 2**40, 0] overflows although it holds nothing)."""
    count = 1
    for n in shape:
        count *= n
        if count > MAX_COUNT:
            return None
    return count
