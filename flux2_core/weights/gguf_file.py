"""GGUF files read with the ``gguf`` package: tensors as ``tensors.TensorInfo`` and the metadata a loader checks.

GGUF lists dimensions innermost first, so the logical shape is the reverse (unless ComfyUI-GGUF recorded the
original). A quantized tensor is read as uint8 [rows, row_bytes]. A hostile header ends in a Flux2Error, never
another exception: the stock reader trusts every count a header claims.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import math
import struct
import sys
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType

from ..errors import Flux2Error
from ..storage.ggml import check_supported, row_bytes, type_name
from .key_mapping import describe
from .tensors import TensorInfo, element_count, short

GGUF_MAGIC = b"GGUF"
# the metadata fields a loader reads, and the type each must have
KEPT_FIELDS = {"general.architecture": str, "general.name": str, "general.file_type": int,
               "tokenizer.ggml.model": str, "tokenizer.ggml.pre": str, "tokenizer.ggml.tokens": list}
ORIG_SHAPE = "comfy.gguf.orig_shape."
MAX_ENTRIES = 2**16          # fields, and tensors, in one file: Klein 9B and Qwen3-8B have under 500 of each
MAX_ARRAY_VALUES = 2**21     # values of all array fields together: Qwen3's tokenizer has ~455,000 (reading 2**21 ~ 20 s)
# what GGUFReader raises on bad bytes (besides reading short arrays, which _StrictReader refuses)
READER_ERRORS = (ValueError, IndexError, KeyError, OverflowError, TypeError, RecursionError)


class _StrictReader(GGUFReader):
    """No read past the end of the file (the stock reader returns short arrays there); bounded counts."""

    def __init__(self, path: Path):
        self.array_values = 0
        super().__init__(path)

    def _get(self, offset, dtype, count=1, *args, **kwargs):
        end = int(offset) + np.dtype(dtype).itemsize * int(count)
        if end > len(self.data):
            raise ValueError(f"the file ends at byte {len(self.data):,}, but its header points to byte {end:,}")
        return super()._get(offset, dtype, count, *args, **kwargs)

    def _build_fields(self, offs, count):
        _check_count(int(count), MAX_ENTRIES, "metadata fields")
        return super()._build_fields(offs, count)

    def _build_tensor_info(self, offs, count):
        _check_count(int(count), MAX_ENTRIES, "tensors")
        return super()._build_tensor_info(offs, count)

    def _get_field_parts(self, orig_offs, raw_type):
        if raw_type == GGUFValueType.ARRAY:
            count = int(self._get(orig_offs + 4, np.uint64)[0])                  # after the item type (uint32)
            self.array_values += count
            _check_count(self.array_values, MAX_ARRAY_VALUES, "array values")
            if self.byte_order == "I" and sys.byteorder == "little":
                return self._array_parts(orig_offs, int(self._get(orig_offs, np.uint32)[0]), count)
        return super()._get_field_parts(orig_offs, raw_type)

    def _array_parts(self, orig_offs: int, item_type: int, count: int):
        """An array field with the stock reader's ``contents()``, walked in one pass: the stock reader's numpy view
        per item made a Qwen tokenizer's ~455,000 values take 15-30 s to open."""
        parts = [self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)]
        types = [GGUFValueType.ARRAY] + ([GGUFValueType(item_type)] if count else [])
        offs = orig_offs = int(orig_offs)                      # plain ints: numpy scalars make each step ~20x slower
        offs += 12
        nptype = self.gguf_scalar_to_np.get(GGUFValueType(item_type))
        if nptype is not None:                                  # numbers: one part holding them all
            parts.append(self._get(offs, nptype, count))
            return offs + parts[-1].nbytes - orig_offs, parts, [2] if count else [], types
        if item_type != GGUFValueType.STRING:                   # arrays of arrays: the stock reader's way
            return super()._get_field_parts(orig_offs, GGUFValueType.ARRAY)
        view, size, indices = memoryview(self.data), len(self.data), []
        with _no_gc():                              # ~600,000 new objects: the collector would rescan them often
            end = _string_parts(view, size, offs, count, parts, indices)
        return end - orig_offs, parts, indices, types


def _string_parts(view: memoryview, size: int, offs: int, count: int, parts: list, indices: list) -> int:
    """``count`` GGUF strings from ``offs`` appended to ``parts``; returns where they end."""
    for _ in range(count):
        if offs + 8 > size:
            raise ValueError(f"the file ends at byte {size:,}, inside its metadata")
        (length,) = struct.unpack_from("<Q", view, offs)
        end = offs + 8 + length
        if end > size:
            raise ValueError(f"the file ends at byte {size:,}, but its header points to byte {end:,}")
        parts.append(view[offs:offs + 8])               # memoryviews: all ``contents`` asks of a part is tobytes()
        indices.append(len(parts))
        parts.append(view[offs + 8:end])
        offs = end
    return offs


@contextlib.contextmanager
def _no_gc():
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _check_count(count: int, limit: int, what: str) -> None:
    if count > limit:
        raise ValueError(f"it claims {count:,} {what}, more than the {limit:,} any model has")


def is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def read_gguf(path: Path) -> tuple[dict, dict]:
    """({name: TensorInfo}, {key: value} for ``KEPT_FIELDS``)."""
    try:
        reader = _StrictReader(path)
    except READER_ERRORS as e:
        raise Flux2Error(f"{path} is not a readable GGUF file ({str(e)[:200]}): it is corrupt, cut short by an "
                         f"interrupted download, or written by a newer GGUF version; download it again") from None
    size = path.stat().st_size
    metadata = {key: _field(reader, key, kind) for key, kind in KEPT_FIELDS.items() if key in reader.fields}
    shapes = {name[len(ORIG_SHAPE):]: _orig_shape(reader, name) for name in reader.fields if name.startswith(ORIG_SHAPE)}
    tensors, spans = {}, []
    for t in reader.tensors:
        qtype = int(t.tensor_type)
        check_supported(qtype, f"tensor {short(t.name)} of {path}")
        shape = shapes.get(t.name) or tuple(int(n) for n in reversed(t.shape.tolist()))
        count = element_count(shape)
        n_bytes = row_bytes(qtype, shape[-1]) * math.prod(shape[:-1]) if shape and count is not None else 0
        if count is None or count != int(t.n_elements) or n_bytes != int(t.n_bytes):
            raise Flux2Error(f"{path} is corrupt: tensor {short(t.name)} ({type_name(qtype)}, shape {short(list(shape))}) "
                             f"has {int(t.n_elements):,} values in {int(t.n_bytes):,} bytes; download it again")
        if t.data_offset + n_bytes > size:
            raise Flux2Error(f"{path} is truncated: tensor {short(t.name)} ends at byte {t.data_offset + n_bytes:,} but the "
                             f"file has {size:,}; the download was probably interrupted, download it again")
        tensors[t.name] = TensorInfo(path, t.name, type_name(qtype), shape, int(t.data_offset), qtype)
        spans.append((int(t.data_offset), int(t.data_offset) + n_bytes, t.name))
    _check_disjoint(spans, path)
    return tensors, metadata


def _check_disjoint(spans: list[tuple[int, int, str]], path: Path) -> None:
    """Two tensors pointed at the same bytes would give one of them the other's values."""
    spans = sorted(spans)
    for (_, end, first), (start, _, second) in itertools.pairwise(spans):
        if start < end:
            raise Flux2Error(f"{path} is corrupt: tensors {short(first)} and {short(second)} overlap (the second "
                             f"starts at byte {start:,}, before the first ends at {end:,}); download it again")


def _field(reader, key: str, kind: type):
    value = _value(reader, key)
    if isinstance(value, bool) or not isinstance(value, kind) or (kind is list and not all(
            isinstance(v, str) for v in value)):
        raise Flux2Error(f"{reader.data.filename}: the GGUF metadata field {key!r} should be a "
                         f"{'list of strings' if kind is list else kind.__name__}, not {short(value)}; the file is "
                         f"corrupt, download it again")
    return value


def _orig_shape(reader, key: str) -> tuple[int, ...]:
    value = _value(reader, key)
    if not isinstance(value, list) or not all(type(n) is int and n >= 0 for n in value):
        raise Flux2Error(f"{reader.data.filename}: the GGUF metadata field {key!r} should be a tensor shape (whole "
                         f"numbers >= 0), not {short(value)}; the file is corrupt, download it again")
    return tuple(value)


def _value(reader, key: str):
    field = reader.fields[key]
    try:
        return field.contents()
    except (ValueError, IndexError, UnicodeDecodeError) as e:
        raise Flux2Error(f"{reader.data.filename}: the GGUF metadata field {key!r} cannot be read ({e}); the file is "
                         f"corrupt, download it again") from None


def architecture(metadata: dict) -> str:
    """"" when absent, as in stable-diffusion.cpp's files."""
    return str(metadata.get("general.architecture", ""))


ARCH_NAMES = {"flux": "a FLUX transformer (FLUX.1 or FLUX.2)", "sd1": "a Stable Diffusion 1.x UNet",
              "sdxl": "an SDXL UNet", "sd3": "a Stable Diffusion 3 transformer", "aura": "an AuraFlow transformer",
              "hidream": "a HiDream transformer", "wan": "a Wan video transformer", "ltxv": "an LTX-Video transformer",
              "hyvid": "a HunyuanVideo transformer", "cosmos": "a Cosmos transformer", "lumina2": "a Lumina 2 transformer",
              "qwen_image": "a Qwen-Image transformer", "t5": "a T5 text encoder", "t5encoder": "a T5 text encoder",
              "qwen3": "a Qwen3 language model (text encoder)", "qwen2": "a Qwen2 language model",
              "qwen2vl": "a Qwen2-VL language model", "qwen3vl": "a Qwen3-VL language model",
              "llama": "a Llama-architecture language model (Llama, Mistral, ...)", "gemma3": "a Gemma 3 language model"}


def describe_gguf(arch: str, ckpt) -> str:
    if not arch:
        return f"no declared architecture; by its tensors it looks like {describe(ckpt)}"
    return f"{ARCH_NAMES.get(arch, f'a model of architecture {arch!r}')} (general.architecture = {arch!r})"
