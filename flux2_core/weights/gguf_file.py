"""GGUF files read with the ``gguf`` package: their tensors as ``checkpoint.TensorInfo`` (the logical shape, where the
bytes start, the GGML type) and the metadata a loader checks (architecture, tokenizer). Nothing else about GGUF lives
here: the block maths is ``ggml.py``, the layers keeping blocks are ``ggml_layers.py``.

Shapes: GGUF lists dimensions innermost first, so a Linear weight [out, in] is stored as (in, out); the logical shape
is the reverse, unless ComfyUI-GGUF's converter recorded the original one (``comfy.gguf.orig_shape.<name>``).
A quantized tensor is rows of whole blocks along its last (innermost) dimension, read as uint8 [rows, row_bytes].
"""

from __future__ import annotations

import math
from pathlib import Path

from ..errors import Flux2Error
from ..ggml import check_supported, row_bytes, type_name

GGUF_MAGIC = b"GGUF"
KEPT_FIELDS = ("general.architecture", "general.name", "general.file_type", "tokenizer.ggml.model",
               "tokenizer.ggml.pre", "tokenizer.ggml.tokens")
ORIG_SHAPE = "comfy.gguf.orig_shape."


def is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def read_gguf(path: Path) -> tuple[dict, dict]:
    """The tensors of a GGUF file ({name: TensorInfo}) and its metadata ({key: value} for ``KEPT_FIELDS``), after
    checking that every tensor's bytes are in the file and its type is one we dequantize."""
    from gguf import GGUFReader

    from .checkpoint import TensorInfo

    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, OverflowError) as e:
        raise Flux2Error(f"{path} is not a readable GGUF file ({e}): it is corrupt, cut short by an interrupted "
                         f"download, or written by a newer GGUF version; download it again") from None
    size = path.stat().st_size
    metadata = {key: _value(reader, key) for key in KEPT_FIELDS if key in reader.fields}
    shapes = {name[len(ORIG_SHAPE):]: tuple(int(n) for n in _value(reader, name))
              for name in reader.fields if name.startswith(ORIG_SHAPE)}
    tensors = {}
    for t in reader.tensors:
        qtype = int(t.tensor_type)
        check_supported(qtype, f"tensor {t.name!r} of {path}")
        shape = shapes.get(t.name) or tuple(int(n) for n in reversed(t.shape.tolist()))
        n_bytes = row_bytes(qtype, shape[-1]) * math.prod(shape[:-1]) if shape else 0
        if math.prod(shape) != int(t.n_elements) or n_bytes != int(t.n_bytes):
            raise Flux2Error(f"{path} is corrupt: tensor {t.name!r} ({type_name(qtype)}, shape {list(shape)}) has "
                             f"{int(t.n_elements):,} values in {int(t.n_bytes):,} bytes; download it again")
        if t.data_offset + n_bytes > size:
            raise Flux2Error(f"{path} is truncated: tensor {t.name!r} ends at byte {t.data_offset + n_bytes:,} but the "
                             f"file has {size:,}; the download was probably interrupted, download it again")
        tensors[t.name] = TensorInfo(path, t.name, type_name(qtype), shape, int(t.data_offset), qtype)
    return tensors, metadata


def _value(reader, key: str):
    """A metadata field's value: a str, a number, or a list of them."""
    field = reader.fields[key]
    try:
        return field.contents()
    except (ValueError, IndexError, UnicodeDecodeError) as e:
        raise Flux2Error(f"{reader.data.filename}: the GGUF metadata field {key!r} cannot be read ({e}); the file is "
                         f"corrupt, download it again") from None


def architecture(metadata: dict) -> str:
    """The file's ``general.architecture`` ("" when absent, as in stable-diffusion.cpp's files)."""
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
    """What a GGUF file holds, by its architecture field and its keys (for error messages)."""
    from .key_mapping import describe

    if not arch:
        return f"no declared architecture; by its tensors it looks like {describe(ckpt)}"
    return f"{ARCH_NAMES.get(arch, f'a model of architecture {arch!r}')} (general.architecture = {arch!r})"
