"""Loaders: weight files in every layout users have (BFL, ComfyUI, diffusers; safetensors or GGUF) into our modules.

A load finds the layout from one signature key, builds on the meta device from the tensor shapes, reads every key
straight to the target device and assigns it (``load_state_dict(assign=True)``), so nothing is allocated twice.
Nothing is ever unpickled.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from contextlib import ExitStack, closing
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from .. import families
from ..devices import SIXTEEN_BIT, ComputeDtype, check_model_dtype, compute_dtype, dtype_named, model_dtype
from ..errors import Flux2Error
from ..families import Family, ModelParams
from ..families.flux2.transformer import Flux2Transformer
from ..key_tables import Layout, Recipe, same_names, table_names, table_recipes
from ..models.autoencoder import AutoEncoder, WeightFiles
from ..models.layers import Layers
from ..models.qwen3 import Qwen3Params
from ..models.text_encoder import PromptEncoder, StoredLayer, build_qwen3_encoder, is_used, qwen3_state_dict
from ..models.tokenizer import load_tokenizer
from ..storage import ggml
from ..storage.choices import KEPT, STORED, choose, made_at_load
from ..storage.protocol import FLOAT_KINDS, StoredLinear
from ..storage.quant import DROPPED_SUFFIXES, FP8_DTYPES, SCALE_SUFFIXES, quantize_fp8
from ..storage.request import LayerRequest, StorageAsk
from ..storage.stored_format import SCALE, LayerFormat
from ..variants import AutoEncoderParams, TextEncoderSpec, Variant
from .checkpoint import TORCH_DTYPES, Checkpoint, TensorInfo, open_checkpoint, read_json, read_tensor
from .dequantize import comfy_formats, dequantize
from .gguf_file import architecture, describe_gguf
from .key_mapping import AUTOENCODER_LAYOUTS, OPTIONAL_KEYS, QWEN3_FROM_LLAMA_CPP, describe, find_layout, qwen3_name
from .orbitquant_files import as_stored
from .outcome import StorageOutcome, tally

# ---- 1. reading our state dict: recipes -> tensors on the target device, dequantized, cast, shape-fitted ----

@dataclass
class Source:
    """A checkpoint seen through its prefix and layout: the tensors one of our modules can take from it."""
    ckpt: Checkpoint
    layout: Layout
    prefix: str
    keys: set[str]                       # the file's keys behind the prefix, prefix stripped (scales excluded)
    recipe: Callable[[str], Recipe]
    formats: dict[str, LayerFormat]      # the quantized layers' formats (prefix stripped)

    def has(self, key: str) -> bool:
        return all(s in self.keys for s in self.recipe(key).sources)

    def shape(self, key: str) -> tuple[int, ...] | None:
        """Unpacked if two 4-bit values a byte (nvfp4, W4A4); None when absent."""
        recipe = self.recipe(key)
        if not all(s in self.keys for s in recipe.sources):
            return None
        shapes = [self.info(s).shape for s in recipe.sources]
        rest = list(shapes[0][1:])
        fmt = self.formats.get(recipe.sources[0].removesuffix(".weight"))
        if fmt is not None:
            rest = [fmt.inputs(rest[0])]
        return (sum(s[0] for s in shapes), *rest)

    def stored_format(self, key: str) -> LayerFormat | None:
        """The format a layer is kept in as the file stores it; None where our layout assembles it otherwise (then
        it is dequantized) or the fp8 choice holds it."""
        recipe = self.recipe(key)
        if recipe.swap_halves or not all(s in self.keys for s in recipe.sources):
            return None
        found = [self.formats.get(s.removesuffix(".weight")) for s in recipe.sources]
        fmt = found[0]
        if fmt is None or fmt.format.fp8_choice or any(f != fmt for f in found[1:]):
            return None
        return fmt if len(found) == 1 or fmt.format.joins_rows else None

    def scale_key(self, layer: str) -> str | None:
        return next((self.prefix + layer + s for s in SCALE_SUFFIXES
                     if self.prefix + layer + s in self.ckpt.tensors), None)

    def stores_fp8(self, key: str) -> bool:
        return all(self.is_float8(s) for s in self.recipe(key).sources)

    def is_float8(self, file_key: str) -> bool:
        """ComfyUI's uint8 containers of fp8 count as float8; mxfp8 and 2-D block fp8 (other storage) do not."""
        fmt = self.formats.get(file_key.removesuffix(".weight"))
        if file_key not in self.keys or (fmt is not None and not fmt.format.fp8_choice):
            return False
        return self.info(file_key).dtype in FP8_CODES or (self.info(file_key).dtype == "U8" and fmt is not None)

    def float_dtype(self, key: str) -> torch.dtype | None:
        """The dtype the file stores the key's tensors in, where all are one plain float dtype (bf16, fp16, ...)."""
        sources = self.recipe(key).sources
        if not all(s in self.keys for s in sources) or any(self.is_float8(s) or self.info(s).quantized
                                                           for s in sources):
            return None                               # missing (an error later, naming it), fp8 or GGUF blocks
        dtypes = {TORCH_DTYPES.get(self.info(s).dtype) for s in sources}
        if len(dtypes) != 1:
            return None
        dtype = dtypes.pop()
        return dtype if dtype is not None and dtype.is_floating_point else None

    def ggml_type(self, key: str) -> int | None:
        sources = self.recipe(key).sources
        if len(sources) == 1 and sources[0] in self.keys and self.info(sources[0]).quantized:
            return self.info(sources[0]).ggml
        return None

    def info(self, key: str) -> TensorInfo:
        return self.ckpt.tensors[self.prefix + key]

    def describe(self) -> str:
        where = f" behind the prefix {self.prefix!r}" if self.prefix else ""
        return f"{self.layout.name} layout{where}; the file looks like {describe(self.ckpt)}"


# GGUF architectures each model comes in ("" for stable-diffusion.cpp's files). Qwen3-VL's text tower uses Qwen3's
# tensor names; its M-RoPE sections all take the text position, which is plain RoPE
GGUF_ENCODER_ARCHS = {"qwen3": "qwen3", "qwen3vl": "qwen3-vl"}


def open_source(path, subfolder: str, layouts: list[Layout], what: str, loader: str,
                gguf_archs: tuple[str, ...] = ()) -> Source:
    ckpt = as_stored(open_checkpoint(path, subfolder))
    arch = architecture(ckpt.metadata) if any(i.ggml is not None for i in ckpt.tensors.values()) else None
    if arch is not None and arch not in gguf_archs:
        raise Flux2Error(f"{ckpt.path} is a GGUF of {describe_gguf(arch, ckpt)}, not {what}. {loader}")
    layout, prefix = find_layout(ckpt, layouts, what, loader)
    formats = comfy_formats(ckpt, prefix)
    keys = {k[len(prefix):] for k in ckpt.tensors if k.startswith(prefix)}
    keys = {k for k in keys if not k.endswith(DROPPED_SUFFIXES)}
    keys -= {f"{layer}.{name}" for layer, fmt in formats.items() for name in fmt.tensors if name != "weight"}
    return Source(ckpt, layout, prefix, keys, layout.recipes(keys), formats)


FP8_CODES = {code for code, dtype in TORCH_DTYPES.items() if dtype in FP8_DTYPES}   # safetensors' float8 names
SCALE_NAMES = (".weight_scale", ".weight_scale_2")   # an fp8 / int8 layer's state beside its weight


def beside_weights(model: nn.Module) -> set[str]:
    """The keys of ``model``'s state read with their layer's weight (scales, and a stored format's other tensors)."""
    stored = {name for name, layer in model.named_modules() if keeps_stored(layer)}
    return {k for k in model.state_dict() if k.endswith(SCALE_NAMES)
            or (k.rpartition(".")[0] in stored and not k.endswith(".weight"))}


class TensorReader:
    """Reads file tensors straight to one device, dequantized to float32 (``__call__``) or as stored."""

    def __init__(self, source: Source, device: torch.device):
        self.source, self.device, self.handles, self.files = source, device, {}, ExitStack()
        quantization = config_value(source, "quantization_config", dict, {})
        block = config_value(source, "weight_block_size", "2 ints", None, quantization) or (128, 128)
        self.block = (block[0], block[1])

    def close(self) -> None:
        self.files.close()
        self.handles.clear()

    def raw(self, key: str) -> torch.Tensor:
        """One tensor by its full file key, in memory of its own: safetensors' CPU views of a memory map would be
        unaligned and gone when the file is replaced."""
        info = self.source.ckpt.tensors[key]
        plain = info.ggml is not None or (self.device.type == "cpu" and info.dtype in TORCH_DTYPES)
        if plain:                                   # GGUF tensors too: one tensor at a time through the CPU
            if (info.file, plain) not in self.handles:
                file = self.files.enter_context(open(info.file, "rb", buffering=0))   # noqa: SIM115 (closed by close)
                self.handles[info.file, plain] = file
            return read_tensor(info, self.handles[info.file, plain]).to(self.device)
        try:
            if (info.file, plain) not in self.handles:
                self.handles[info.file, plain] = safe_open(str(info.file), framework="pt", device=str(self.device))
            tensor = self.handles[info.file, plain].get_tensor(info.name)
            if tuple(tensor.shape) != info.shape and tensor.numel() == math.prod(info.shape):
                tensor = tensor.reshape(info.shape)          # a reader gives it another shape (OrbitQuant's codes)
        except SafetensorError as e:    # a valid dtype this safetensors or torch cannot make (F6_*, or newer codes)
            raise Flux2Error(f"{info.file}: tensor {info.name!r} is stored as {info.dtype}, which cannot be read here "
                             f"({e}); update safetensors and torch, or use the bf16 or fp8 release of these "
                             f"weights") from None
        return tensor.clone() if tensor.device.type == "cpu" else tensor

    def __call__(self, key: str) -> torch.Tensor:
        """A quantised weight comes back dequantized (float32)."""
        tensor = self.raw(self.source.prefix + key)
        info = self.source.info(key)
        if info.quantized:
            return ggml.dequantize(tensor, info.ggml, info.shape)
        if not key.endswith(".weight"):
            return tensor
        layer = key[: -len(".weight")]
        fmt = self.source.formats.get(layer)
        if fmt is not None and not fmt.format.fp8_choice:         # a file key: its own shape, not a recipe's
            rows, inputs = info.shape[0], fmt.inputs(info.shape[1])
            like = fmt.linear(inputs, rows, device="meta").state_dict()
            return fmt.format.dequantize(fmt, self.stored(layer, like, tensor), rows, inputs)
        scale = self.source.scale_key(layer)
        tensor = self.as_float8(layer, tensor)
        if tensor.dtype in FP8_DTYPES:
            return dequantize(tensor, self.scale(layer), self.block)
        if scale or not tensor.is_floating_point():
            raise Flux2Error(f"{self.source.ckpt.path}: {self.source.prefix + key} is stored as {tensor.dtype}"
                             f"{' with a scale' if scale else ''}, a quantisation this loader does not know; use the "
                             f"bf16 or fp8 .safetensors release of these weights")
        return tensor

    def scale(self, layer: str) -> torch.Tensor | None:
        """A float8 layer's scale as the file stores it, its values checked (``checked``); None: unscaled."""
        key = self.source.scale_key(layer)
        return None if key is None else self.checked(layer, key.rsplit(".", 1)[1], self.raw(key))

    def checked(self, layer: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``, refused if a scale of its format holds values no quantizer writes."""
        fmt = self.source.formats.get(layer)
        if fmt is None:             # BFL's fp8, Hugging Face's block fp8 and old scaled_fp8 name no format: any scale
            rule, what = (SCALE.scale if name.startswith(("weight_scale", "scale_weight")) else None), "fp8"
        else:
            rule, what = (fmt.tensors[name].scale if name in fmt.tensors else None), fmt.describe()
        bad = rule.count_bad(tensor) if rule is not None else 0
        if bad:
            raise Flux2Error(f"{self.source.ckpt.path}: layer {self.source.prefix + layer} is {what}, and "
                             f"{bad} of the {tensor.numel()} values of its {name} are {rule.bad()}, which no "
                             f"quantizer writes; the file is damaged, download it again")
        return tensor

    def as_float8(self, layer: str, tensor: torch.Tensor) -> torch.Tensor:
        if layer in self.source.formats and tensor.dtype == torch.uint8:
            return tensor.view(self.source.formats[layer].format.weight_dtype)
        return tensor

    def stored(self, layer: str, like: dict[str, torch.Tensor], weight: torch.Tensor | None = None
               ) -> dict[str, torch.Tensor]:
        """A layer's tensors as the file stores them, each in its buffer's shape and dtype ([N, 1] scales as [N]).
        ``weight``: the weight, already read."""
        out, fmt = {}, self.source.formats[layer]
        for name, buffer in like.items():
            key = f"{self.source.prefix}{layer}.{name}"
            if key not in self.source.ckpt.tensors:
                raise Flux2Error(f"{self.source.ckpt.path} has no {key}, which its {fmt.describe()} layer needs beside "
                                 f"its weight; the file is corrupt or was cut, download it again")
            tensor = weight if name == "weight" and weight is not None else self.raw(key)
            if tensor.dtype != buffer.dtype and tensor.dtype.itemsize == buffer.dtype.itemsize:
                tensor = tensor.view(buffer.dtype)     # a dtype its format stores (checked): uint8 <-> float8 bytes
            elif buffer.dtype == torch.float32 and tensor.dtype in SIXTEEN_BIT:
                tensor = tensor.float()                        # a 16-bit scale: widened exactly
            tensor = self.checked(layer, name, tensor)         # as its values read
            if (_without_trailing_ones(tensor.shape) != _without_trailing_ones(buffer.shape)
                    or tensor.dtype != buffer.dtype):
                raise Flux2Error(f"{self.source.ckpt.path}: {key} is {tensor.dtype} "
                                 f"{list(tensor.shape)}; its format ({fmt.describe()}) needs "
                                 f"{buffer.dtype} {list(buffer.shape)}; the file is corrupt, download it again")
            out[name] = tensor.reshape(buffer.shape)
        return out

    def joined(self, layers: list[str], like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``stored`` over one file layer, or several of a format that joins rows (per-row tensors concatenated)."""
        if len(layers) == 1:
            return self.stored(layers[0], like)
        fmt = self.source.formats[layers[0]]
        parts = []
        for layer in layers:
            rows = self.source.info(f"{layer}.weight").shape[0]
            parts.append(self.stored(layer, {n: torch.empty((rows, *t.shape[1:]), dtype=t.dtype, device="meta")
                                             if fmt.tensors[n].rows else t for n, t in like.items()}))
        out = {}
        for name in like:
            if fmt.tensors[name].rows:
                out[name] = torch.cat([p[name] for p in parts])
            elif all(torch.equal(p[name], parts[0][name]) for p in parts[1:]):
                out[name] = parts[0][name]
            else:
                raise Flux2Error(f"{self.source.ckpt.path}: layers {', '.join(layers)} are read as one layer, but "
                                 f"their {name} differ; the file is damaged or mixed from two, download it again")
        return out

    def full(self, recipe: Recipe) -> torch.Tensor:
        parts = [self(s) for s in recipe.sources]
        tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        if recipe.swap_halves:
            first, second = tensor.chunk(2, dim=0)
            tensor = torch.cat([second, first], dim=0)
        return tensor

    def blocks(self, key: str) -> torch.Tensor:
        """uint8 [rows, row bytes], as the file stores them."""
        return self.raw(self.source.prefix + self.source.recipe(key).sources[0])

    def fp8(self, recipe: Recipe) -> tuple[torch.Tensor, torch.Tensor]:
        """float8 [out, in] and a float32 scale [out]: the file's own float8 values (nothing rounded twice), else
        quantized per row."""
        if len(recipe.sources) == 1 and not recipe.swap_halves and self.source.is_float8(recipe.sources[0]):
            layer = recipe.sources[0][: -len(".weight")]
            weight = self.as_float8(layer, self.raw(self.source.prefix + recipe.sources[0]))
            scale = self.scale(layer)
            scale = scale.float() if scale is not None else torch.ones((), device=weight.device)
            rows = weight.shape[0]
            per_row = scale.shape in ((rows,), (rows, 1))
            if weight.ndim == 2 and (scale.numel() == 1 or per_row):
                return weight, scale.reshape(-1).expand(rows).contiguous()
        return quantize_fp8(self.full(recipe), per_row=True)


def read_state_dict(source: Source, model: nn.Module, device: torch.device, dtype: torch.dtype,
                    only: Callable[[str], bool] = lambda key: True) -> dict[str, torch.Tensor]:
    """Every key of ``model``'s (meta) state read in its layer's storage. An unused file key is an error, as is a
    missing one (except ``OPTIONAL_KEYS``). ``only``: the keys to read."""
    expected = {k: like for k, like in model.state_dict().items() if only(k)}
    layers = dict(model.named_modules())
    scales = beside_weights(model)                                           # read with their weights
    wanted = {k: like for k, like in expected.items() if k not in scales}
    missing = [s for k in wanted if k not in OPTIONAL_KEYS or source.has(k)
               for s in source.recipe(k).sources if s not in source.keys]
    used = {s for k in wanted for s in source.recipe(k).sources}
    unexpected = sorted(source.keys - used)
    if missing or unexpected:
        raise Flux2Error(mismatch_message(source, sorted(set(missing)), unexpected))
    state = {}
    with closing(TensorReader(source, device)) as read:
        for key, like in wanted.items():
            layer = layers.get(key.removesuffix(".weight"))
            if not source.has(key):                       # an optional key the file lacks
                state[key] = torch.zeros(like.shape, dtype=like.dtype, device=device)
            elif key.endswith(".weight") and isinstance(layer, StoredLinear):      # each storage reads its own
                name = key.removesuffix(".weight")
                read_here = FileLayer(read, key, dtype, layer)
                state |= {f"{name}.{n}": t for n, t in layer.read_from(read_here).items()}
            elif like.dtype == torch.uint8 and source.ggml_type(key) is not None:    # GGUF blocks (an embedding)
                state[key] = fit(read.blocks(key), like, key, source)
            else:
                tensor = fit(read.full(source.recipe(key)), like, key, source)
                state[key] = tensor.to(like.dtype if like.dtype in SIXTEEN_BIT or not like.is_floating_point()
                                       else dtype)
    return state


@dataclass(frozen=True)
class FileLayer:
    """One linear of the file as its layer reads it (``storage.protocol.LayerSource``): ``key`` is our weight's."""

    read: TensorReader
    key: str
    dtype: torch.dtype
    layer: nn.Module                     # as built, on the meta device

    @property
    def like(self) -> torch.Tensor:
        return self.layer.weight

    @property
    def stored(self) -> bool:
        return self.read.source.stored_format(self.key) is not None

    def as_stored(self) -> dict[str, torch.Tensor]:
        sources = self.read.source.recipe(self.key).sources
        return self.read.joined([s.removesuffix(".weight") for s in sources], self.layer.state_dict())

    def values(self) -> torch.Tensor:
        return fit(self.read.full(self.read.source.recipe(self.key)), self.like, self.key, self.read.source)

    def blocks(self) -> torch.Tensor:
        return fit(self.read.blocks(self.key), self.like, self.key, self.read.source)

    def fp8(self) -> tuple[torch.Tensor, torch.Tensor]:
        weight, scale = self.read.fp8(self.read.source.recipe(self.key))
        return fit(weight, self.like, self.key, self.read.source), scale


def keeps_stored(layer: nn.Module | None) -> bool:
    """A layer a file's format made (``LayerFormat.linear``)."""
    return isinstance(layer, StoredLinear) and layer.kind not in FLOAT_KINDS


def fit(tensor: torch.Tensor, like: torch.Tensor, key: str, source: Source) -> torch.Tensor:
    """Equal shapes, or equal up to trailing 1-dims (Linear [C,C] <-> 1x1 conv [C,C,1,1])."""
    if tensor.shape == like.shape:
        return tensor
    if _without_trailing_ones(tensor.shape) == _without_trailing_ones(like.shape):
        return tensor.reshape(like.shape)
    raise Flux2Error(f"{source.ckpt.path}: {key} has shape {list(tensor.shape)} in the file but the model built from "
                     f"the file's other tensors needs {list(like.shape)}; the file is inconsistent or damaged "
                     f"({source.describe()})")


def _without_trailing_ones(shape) -> list[int]:
    shape = list(shape)
    while shape and shape[-1] == 1:
        shape.pop()
    return shape


def mismatch_message(source: Source, missing: list[str], unexpected: list[str]) -> str:
    lines = [f"{source.ckpt.path} does not fit the model ({source.describe()})."]
    if missing:
        lines.append(f"Missing from the file ({len(missing)}): {', '.join(missing[:5])}"
                     f"{', ...' if len(missing) > 5 else ''}")
    if unexpected:
        lines.append(f"Not expected ({len(unexpected)}): {', '.join(unexpected[:5])}"
                     f"{', ...' if len(unexpected) > 5 else ''}")
    lines.append("Check that the file is complete and is the model this loader is for.")
    return "\n".join(lines)


# ---- 2. building on meta and assigning ----

CONFIG_KINDS = {   # what a config.json value must be, as checked by config_value
    dict: lambda v: isinstance(v, dict),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0,
    "ints": lambda v: isinstance(v, list) and bool(v) and all(CONFIG_KINDS["int"](n) for n in v),
    "2 ints": lambda v: CONFIG_KINDS["ints"](v) and len(v) == 2,
}
CONFIG_NAMES = {dict: "an object", "int": "a positive whole number", "number": "a positive finite number",
                "ints": "a list of positive whole numbers", "2 ints": "a list of two positive whole numbers"}


def config_value(source: Source, key: str, kind, default, within: dict | None = None):
    """``key`` of config.json (or of ``within``), checked to be of ``kind``; ``default`` when absent."""
    config = source.ckpt.config if within is None else within
    if key not in config or config[key] is None:
        return default
    value = config[key]
    if not CONFIG_KINDS[kind](value):
        raise Flux2Error(f"the config.json of {source.ckpt.path} is damaged: {key} is {str(value)[:60]!r}, but must be "
                         f"{CONFIG_NAMES[kind]}; download config.json again")
    return value


def default_device_dtype(device, dtype, fp16: bool = True) -> tuple[torch.device, torch.dtype]:
    """cuda if available, else cpu, and the dtype it computes fast (``fp16``: the model is safe in float16). Raises
    Flux2Error for a device this torch cannot use, before anything is loaded."""
    try:
        device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    except (RuntimeError, TypeError) as e:
        raise Flux2Error(f"device {device!r} is not a device name ({e}); use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise Flux2Error(f"device {device} asked for, but this torch ({torch.__version__}, {build}) sees no CUDA "
                             f"GPU: use --device cpu, or install the CUDA build of torch for your driver")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise Flux2Error(f"device {device} asked for, but there are {torch.cuda.device_count()} CUDA GPU(s) "
                             f"(cuda:0 to cuda:{torch.cuda.device_count() - 1})")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise Flux2Error(f"device {device} asked for, but this torch has no Apple GPU (MPS) available: use cpu")
    return device, dtype_named(dtype) or compute_dtype(device, fp16).dtype


def build_on_meta(make: Callable[[], nn.Module]) -> nn.Module:
    with torch.device("meta"):
        return make()


def assign(model: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    """The parameters become these very tensors."""
    model.load_state_dict(state, strict=True, assign=True)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"{type(model).__name__} kept {left[:5]} on the meta device: tensors that are not in its "
                           f"state dict must be created on first use")
    return model.eval().requires_grad_(False)


def count(source: Source, template: str) -> int:
    n = 0
    while source.has(template.format(n)):
        n += 1
    return n


def need_shape(source: Source, key: str) -> tuple[int, ...]:
    shape = source.shape(key)
    if shape is None:
        raise Flux2Error(mismatch_message(source, list(source.recipe(key).sources), []))
    return shape


# ---- 3. the transformer ----

@dataclass(frozen=True)
class SourceShapes:
    """A file's tensors as a family reads its parameters from them (``families.ShapeReader``)."""

    source: Source

    @property
    def where(self) -> str:
        return str(self.source.ckpt.path)

    def has(self, key: str) -> bool:
        return self.source.has(key)

    def shape(self, key: str) -> tuple[int, ...]:
        return need_shape(self.source, key)

    def count(self, template: str) -> int:
        return count(self.source, template)

    def config(self, key: str, kind: str, default):
        return config_value(self.source, key, kind, default)


def transformer_family(source: Source) -> Family:
    """The family whose naming (layout) the file has: the transformer source is opened with every family's."""
    return next(f for f in families.FAMILIES.values() if source.layout in f.layouts)


def transformer_params(source: Source) -> ModelParams:
    """The architecture the file's shapes give, read by its family."""
    return transformer_family(source).read_params(SourceShapes(source))


def variant_hint(source: Source) -> str:
    """Base / KV / distilled: diffusers' model_index.json, else the file or folder names."""
    root = source.ckpt.root
    index = read_json(root / "model_index.json", "the diffusers folder's model_index.json") if root else {}
    if "KV" in index.get("_class_name", ""):
        return "kv"
    if "is_distilled" in index:
        return "distilled" if index["is_distilled"] else "base"
    path = source.ckpt.path.resolve()
    return path.name if path.is_file() else "/".join(path.parts[-3:])


def inspect_transformer(path: str | Path, params: ModelParams | None = None,
                        variant: str | None = None) -> tuple[ModelParams, Variant]:
    """From the headers alone: no tensor is read."""
    return _transformer_spec(_transformer_source(path), params, variant)


def load_transformer(path: str | Path, device=None, dtype: torch.dtype | None = None, *,
                     params: ModelParams | None = None, variant: str | None = None,
                     fp8: bool | None = None, int8: bool | str = False) -> tuple[Flux2Transformer, Variant]:
    """``params`` overrides the architecture read from shapes; ``variant`` the one detected from it.

    fp8: None keeps an fp8 file's float8 layers; True stores every block layer in fp8, quantized as read (the full
    model is never in memory); False dequantizes all. int8=True stores every block layer in int8 per row, "convrot"
    in ConvRot's basis (more accurate). Other stored formats stay as stored; the compute dtype is ``dtype`` either way.
    """
    ask = StorageAsk(fp8, int8)
    dtype = dtype_named(dtype)
    device, _ = default_device_dtype(device, torch.float32)
    dtype = dtype or transformer_dtype(path, device).dtype
    source, model, chosen = _transformer_on_meta(path, params, variant, ask, dtype)
    return assign(model, read_state_dict(source, model, device, dtype)), chosen


def transformer_family_at(path: str | Path) -> Family:
    """The family of a transformer file, from its header."""
    return transformer_family(_transformer_source(path))


def transformer_dtype(path: str | Path, device, host: torch.dtype | None = None) -> ComputeDtype:
    """The compute dtype a transformer file runs in on ``device``; ``host``: the host's own choice."""
    return model_dtype(device, transformer_family_at(path).dtypes, host)


def stored_dtype(path: str | Path) -> tuple[torch.dtype | None, int]:
    """(the dtype most values are stored in, None for GGUF blocks; the value count), from the header."""
    source = _transformer_source(path)
    counts: dict[torch.dtype | None, int] = {}
    for key in source.keys:
        info = source.info(key)
        dtype = None if info.quantized else TORCH_DTYPES.get(info.dtype)
        counts[dtype] = counts.get(dtype, 0) + math.prod(info.shape)
    return max(counts, key=counts.get, default=None), sum(counts.values())


def transformer_bytes(path: str | Path, dtype: torch.dtype, *, variant: str | None = None,
                      fp8: bool | None = None, int8: bool | str = False) -> int:
    """The weight bytes ``load_transformer`` would make, from the headers alone."""
    _, model, _ = _transformer_on_meta(path, None, variant, StorageAsk(fp8, int8), dtype)
    state = model.state_dict()
    scales = beside_weights(model)
    return sum(t.numel() * (dtype.itemsize if t.is_floating_point() and t.dtype not in (*FP8_DTYPES, *SIXTEEN_BIT)
                            and k not in scales else t.itemsize) for k, t in state.items())


def _transformer_on_meta(path, params: ModelParams | None, variant: str | None, ask: StorageAsk,
                         dtype: torch.dtype = torch.float32,
                         storages: dict[str, str] | None = None) -> tuple[Source, Flux2Transformer, Variant]:
    """``storages``: filled with the storage each linear was made in (``Layers.chosen``)."""
    source = _transformer_source(path)
    family = transformer_family(source)
    check_model_dtype(dtype, family.dtypes, family.title)        # before anything is built or read
    params, chosen = _transformer_spec(source, params, variant)
    layers = Layers(LayerRequest(source, ask, dtype, family.quantizable), chosen=storages)
    model = build_on_meta(lambda: family.build(params, layers))
    return source, model, chosen


def storage_outcome(path: str | Path, *, variant: str | None = None, fp8: bool | None = None,
                    int8: bool | str = False) -> StorageOutcome | None:
    """What ``load_transformer``'s fp8=True or int8 does to the file's layers, from the headers alone; None where
    neither is asked."""
    ask = StorageAsk(fp8, int8)
    if made_at_load(ask) is None:
        return None
    storages: dict[str, str] = {}
    source, _, _ = _transformer_on_meta(path, None, variant, ask, storages=storages)
    request, made = LayerRequest(source, ask, quantizable=transformer_family(source).quantizable), made_at_load(ask)
    return tally(ask.option, made.name, storages, request.quantizable, lambda name: stored_as(source, name + ".weight"),
                 lambda name: made.keeps(request, name))


def stored_as(source: Source, key: str) -> str | None:
    """What the file stores our ``key`` as, as lines name it: its quantized format, its GGUF type or fp8; None: float."""
    fmt = source.stored_format(key)
    if fmt is not None:
        return fmt.describe()
    qtype = source.ggml_type(key)
    if qtype is not None:
        return f"GGUF {ggml.type_name(qtype)}"
    return "fp8" if source.stores_fp8(key) else None


def _transformer_source(path) -> Source:
    known = families.FAMILIES.values()
    titles = " or ".join(f.title for f in known)
    return open_source(path, "transformer", [layout for f in known for layout in f.layouts], f"a {titles} transformer",
                       f"Pass a {titles} diffusion model: {'; '.join(f.files_hint for f in known)}.",
                       tuple(arch for f in known for arch in f.gguf_archs))


def _transformer_spec(source: Source, params: ModelParams | None,
                      variant: str | None) -> tuple[ModelParams, Variant]:
    params = params or transformer_params(source)
    if not variant:
        return params, transformer_family(source).variant_for(params, variant_hint(source))
    chosen = families.get_variant(variant)
    if chosen.params.hidden_size != params.hidden_size or chosen.params.context_in_dim != params.context_in_dim:
        raise Flux2Error(f"variant {variant!r} is {chosen.params.hidden_size} wide with {chosen.params.context_in_dim}"
                         f"-wide text input, but {source.ckpt.path} is {params.hidden_size} / "
                         f"{params.context_in_dim}; leave the variant on auto or pick the matching one")
    return params, chosen


# ---- 4. the autoencoder ----

def autoencoder_params(source: Source) -> AutoEncoderParams:
    """Each half's channels from its own tensors: BFL's small decoder is narrower than the encoder."""
    ch, in_channels = need_shape(source, "encoder.conv_in.weight")[:2]
    levels = count(source, "encoder.down.{}.block.0.conv1.weight")
    params = AutoEncoderParams(
        in_channels=in_channels, ch=ch, out_ch=need_shape(source, "decoder.conv_out.weight")[0],
        ch_mult=tuple(need_shape(source, f"encoder.down.{i}.block.0.conv1.weight")[0] // ch for i in range(levels)),
        num_res_blocks=count(source, "encoder.down.0.block.{}.conv1.weight"),
        z_channels=need_shape(source, "decoder.conv_in.weight")[1],
        num_groups=config_value(source, "norm_num_groups", "int", 32),
        bn_eps=float(config_value(source, "batch_norm_eps", "number", 1e-4)))
    return _with_decoder_of(params, source)


def _with_decoder_of(params: AutoEncoderParams, source: Source) -> AutoEncoderParams:
    channels = tuple(need_shape(source, f"decoder.up.{i}.block.0.conv2.weight")[0]
                     for i in range(len(params.ch_mult)))
    return replace(params, decoder_channels=None if channels == params.encoder_chans else channels)


# A decoder on its own (BFL's small_decoder.safetensors), or behind the prefix "decoder." of an autoencoder file
DECODER_LAYOUTS = [Layout("BFL decoder", "up.0.block.0.conv1.weight",
                          lambda keys: lambda key: Recipe((key.removeprefix("decoder."),)))]
DECODER_HINT = ("A FLUX.2 decoder is BFL's small_decoder.safetensors (or the decoder of an autoencoder file such as "
                "full_encoder_small_decoder.safetensors).")


def load_autoencoder(path: str | Path, device=None, dtype: torch.dtype | None = None, *,
                     decoder: str | Path | None = None) -> AutoEncoder:
    """With ``decoder`` (BFL's ``small_decoder.safetensors``) that decoder replaces the file's; the encoder and latent
    statistics stay. BFL runs the AE in float32: pass it.
    """
    device, dtype = default_device_dtype(device, dtype, fp16=False)
    source = _autoencoder_source(path)
    params = autoencoder_params(source)
    if decoder is None:
        model = build_on_meta(lambda: AutoEncoder(params))
        model = assign(model, read_state_dict(source, model, device, dtype))
        model.files = WeightFiles(str(source.ckpt.path))
        return model
    decoder_source = open_source(decoder, "vae", DECODER_LAYOUTS, "a FLUX.2 decoder", DECODER_HINT)
    takes = need_shape(decoder_source, "decoder.conv_in.weight")[1]
    if takes != params.z_channels or need_shape(decoder_source, "decoder.conv_out.weight")[0] != params.out_ch:
        raise Flux2Error(f"{decoder_source.ckpt.path} decodes {takes}-channel latents but {source.ckpt.path} makes "
                         f"{params.z_channels}-channel ones: they are not a pair. FLUX.2's decoders (the full one and "
                         f"BFL's small one) take 32-channel latents")
    own_decoder = {s for k in build_on_meta(lambda: AutoEncoder(params)).state_dict() if k.startswith("decoder.")
                   for s in source.recipe(k).sources}                  # the file's own decoder: not read
    params = _with_decoder_of(params, decoder_source)
    model = build_on_meta(lambda: AutoEncoder(params))
    state = read_state_dict(replace(source, keys=source.keys - own_decoder), model, device, dtype,
                            lambda key: not key.startswith("decoder."))
    state |= read_state_dict(decoder_source, model, device, dtype, lambda key: key.startswith("decoder."))
    model = assign(model, state)
    model.files = WeightFiles(str(source.ckpt.path), str(decoder_source.ckpt.path))
    return model


def _autoencoder_source(path) -> Source:
    try:
        source = open_source(path, "vae", AUTOENCODER_LAYOUTS, "a FLUX.2 autoencoder",
                             "The FLUX.2 autoencoder is ae.safetensors (FLUX.2-dev repo) or ComfyUI's "
                             "flux2-vae.safetensors.")
    except Flux2Error:
        if _is_decoder_alone(path):
            raise Flux2Error(f"{path} is a FLUX.2 decoder on its own (BFL's small decoder): it holds neither the "
                             f"encoder nor the latent statistics every decode needs. Give it with the autoencoder: "
                             f"--ae flux2-vae.safetensors --decoder {Path(path).name} (in ComfyUI: the autoencoder "
                             f"loader's decoder input)") from None
        raise
    if not source.has("bn.running_mean"):
        raise Flux2Error(f"{source.ckpt.path} is {describe(source.ckpt)}; FLUX.2 needs its own autoencoder with the "
                         f"latent BatchNorm: ae.safetensors from FLUX.2-dev or ComfyUI's flux2-vae.safetensors")
    return source


def _is_decoder_alone(path) -> bool:
    try:
        return open_source(path, "vae", DECODER_LAYOUTS, "a FLUX.2 decoder", DECODER_HINT).prefix == ""
    except Flux2Error:
        return False



# ---- 5. the text encoder ----

TEXT_ENCODER_LAYOUTS = [Layout("Hugging Face Qwen3", "layers.0.self_attn.q_norm.weight", same_names),
                        Layout("llama.cpp GGUF", "blk.0.attn_q_norm.weight",
                               lambda keys: table_recipes(QWEN3_FROM_LLAMA_CPP), table_names(QWEN3_FROM_LLAMA_CPP))]
ENCODER_FILES = {spec.name: spec.wanted for spec in families.text_encoders()}   # the registered families' encoders


@dataclass(frozen=True)
class EncoderIdentity:
    """What a text encoder file says it is, from its headers alone."""
    model: str | None        # "qwen3" or "qwen3-vl" (``TextEncoderSpec.model``); None where the file does not say
    told_by: str             # what says so, for messages ("its config.json", "its name"); "" where nothing does
    hidden: int              # its hidden size (0 where it has no token table)


def inspect_text_encoder(path: str | Path) -> EncoderIdentity:
    """From the headers alone: which model the file says it is (``encoder_model``) and its hidden size."""
    source = _text_encoder_source(path)
    key = next((k for k in map(source.layout.ours, source.keys) if k is not None and k.endswith("embed_tokens.weight")),
               None)
    return replace(encoder_model(source), hidden=need_shape(source, key)[-1] if key else 0)


def text_encoder_spec(path: str | Path) -> TextEncoderSpec:
    """From the headers alone, the spec a file is read with when none is asked (``encoder_spec``)."""
    return encoder_spec(_text_encoder_source(path), None)


def _text_encoder_source(path) -> Source:
    return open_source(path, "text_encoder", TEXT_ENCODER_LAYOUTS, "a Qwen3 text encoder", families.encoder_hint(),
                       tuple(GGUF_ENCODER_ARCHS))


def load_text_encoder(path: str | Path, device=None, dtype: torch.dtype | None = None, *,
                      tokenizer=None, spec: TextEncoderSpec | None = None) -> PromptEncoder:
    """Reads only the embedding and the layers up to the deepest of ``spec.output_layers`` (None: FLUX.2's, by
    width). The tokenizer: ``tokenizer``, else the folder's, else the built-in Qwen3 one."""
    device, dtype = default_device_dtype(device, dtype, fp16=False)
    source = _text_encoder_source(path)
    spec = encoder_spec(source, spec)
    last = max(spec.output_layers)
    keys = sorted(k for k in map(source.layout.ours, source.keys) if k is not None and is_used(k, last))
    ggml_types = {k.removesuffix(".weight"): source.ggml_type(k) for k in keys if source.ggml_type(k) is not None}
    shapes = {k: torch.empty(need_shape(source, k), device="meta") for k in keys}
    linears = [k for k in keys if len(shapes[k].shape) == 2 and not k.endswith("embed_tokens.weight")]
    # each linear's storage, as the transformer's loader asks it (fp8 layers are dequantized: no fp8 encoder layers)
    request = LayerRequest(source, StorageAsk(fp8=False), dtype, quantizable=lambda name: True)
    chosen = {k: choose(request, k.removesuffix(".weight")) for k in linears}
    formats = {k: picked for k, (kind, picked) in chosen.items() if kind is STORED}     # kept as the file has them
    kept = {k: picked for k, (kind, picked) in chosen.items() if kind is KEPT}          # linears of a 16-bit file
    with closing(TensorReader(source, device)) as read:
        state = {key: read.blocks(key) if key.removesuffix(".weight") in ggml_types
                 else _cast(read.full(source.recipe(key)), kept.get(key, dtype)) for key in keys if key not in formats}
        layers = {k: StoredLayer(fmt, read.stored(source.recipe(k).sources[0].removesuffix(".weight"), fmt.linear(
            shapes[k].shape[1], shapes[k].shape[0], device="meta").state_dict())) for k, fmt in formats.items()}
    prefix = next((k for k in keys if k.endswith("embed_tokens.weight")), "")[: -len("embed_tokens.weight")]
    kept = {k[len(prefix):].removesuffix(".weight"): stored for k, stored in kept.items() if k.startswith(prefix)}
    layers = {k[len(prefix):].removesuffix(".weight"): layer for k, layer in layers.items() if k.startswith(prefix)}
    if tokenizer is None and source.ckpt.path.is_dir():
        tokenizer = load_tokenizer(source.ckpt.files[0].parent)
    try:
        config = qwen3_config(source) or Qwen3Params.from_state_dict(qwen3_state_dict(shapes, spec),
                                                                      spec.rope_theta)
        encoder = build_qwen3_encoder(state, config=config, device=device, dtype=dtype, tokenizer=tokenizer,
                                      ggml_types=ggml_types, kept=kept, spec=spec, stored=layers)
    except Flux2Error as e:
        raise Flux2Error(f"{source.ckpt.path}: {e} ({describe_encoder(source)})") from None
    if "tokenizer.ggml.tokens" in source.ckpt.metadata:
        check_vocabulary(source.ckpt.metadata["tokenizer.ggml.tokens"], encoder.tokenizer, source.ckpt.path,
                         encoder.spec)
    return encoder


MODEL_NAMES = {"qwen3": "Qwen3", "qwen3-vl": "Qwen3-VL"}
# the file names of each model; Qwen3.5 is neither. Qwen3-VL's is tried first: its names also start with Qwen3
NAMED = (("qwen3-vl", re.compile(r"qwen_?3[-_.]?vl")), ("qwen3", re.compile(r"qwen_?3[-_]\d+(?:\.\d+)?b")))


def encoder_model(source: Source) -> EncoderIdentity:
    """Which model a file says it is: its GGUF architecture, config.json, tensor names, then file name. Shapes do not
    tell Qwen3-4B from Qwen3-VL-4B's text tower, so where nothing says, the model is None."""
    def said(model: str | None, told_by: str) -> EncoderIdentity:
        return EncoderIdentity(model, told_by if model else "", 0)

    declared = GGUF_ENCODER_ARCHS.get(architecture(source.ckpt.metadata))
    if declared is not None and any(i.ggml is not None for i in source.ckpt.tensors.values()):
        return said(declared, "its GGUF architecture")
    model_type = str((source.ckpt.config or {}).get("model_type", ""))
    if model_type.startswith("qwen3_vl") or model_type == "qwen3":
        return said("qwen3-vl" if model_type.startswith("qwen3_vl") else "qwen3", "its config.json")
    if "language_model." in source.prefix or any(k.startswith("visual.") or ".visual." in k
                                                 for k in source.ckpt.tensors):
        return said("qwen3-vl", "its tensors' names (Qwen3-VL's towers)")
    name = source.ckpt.path.name.lower()
    return said(next((model for model, pattern in NAMED if pattern.search(name)), None), "its name")


def describe_encoder(source: Source) -> str:
    """What messages say of a text encoder file: its layout, and which model it is where it says."""
    found = encoder_model(source)
    where = f" behind the prefix {source.prefix!r}" if source.prefix else ""
    said = f"; a {MODEL_NAMES[found.model]} text encoder, known by {found.told_by}" if found.model else ""
    return f"{source.layout.name} layout{where}{said}"


def encoder_spec(source: Source, spec: TextEncoderSpec | None) -> TextEncoderSpec:
    """The spec to read the file with: ``spec``, refused where the file says it is another model (or says nothing
    and the spec needs it to); else the registry's for what the file says and its width."""
    found = encoder_model(source)
    if spec is None:
        key = next((k for k in map(source.layout.ours, source.keys) if k is not None
                    and k.endswith("embed_tokens.weight")), None)
        return families.encoder_for(found.model, need_shape(source, key)[-1] if key else 0)
    if spec.reads(found.model):
        return spec
    load = f"load the {spec.wanted}, or its Hugging Face folder"
    if found.model is None:
        raise Flux2Error(f"{source.ckpt.path}: cannot tell which text encoder this is: it has no config.json, no "
                         f"Qwen3-VL tower names and no name that says, and Qwen3's and Qwen3-VL's text towers of one "
                         f"size have the same tensors. {spec.reader} reads {spec.title}: {load} (a file that is "
                         f"{spec.title} may be renamed {spec.files[0] if spec.files else spec.title}), not another "
                         f"family's encoder")
    found_reader = families.family_of_encoder(replace(spec, model=found.model)).title
    raise Flux2Error(f"{source.ckpt.path} is a {MODEL_NAMES.get(found.model, found.model)} text encoder (known by "
                     f"{found.told_by}; {found_reader} reads it), but {spec.reader} reads {spec.title}: {load}")


def qwen3_config(source: Source) -> Qwen3Params | None:
    if not source.ckpt.config:
        return None
    try:
        return Qwen3Params.from_config(source.ckpt.config)
    except Flux2Error as e:
        raise Flux2Error(f"the config.json of {source.ckpt.path} does not describe a Qwen3 ({e}); download "
                         f"config.json again") from None


def check_vocabulary(tokens: list[str], tokenizer, path: Path, spec: TextEncoderSpec) -> None:
    """The file may have more rows, as padding: Qwen3's table has 151,936 rows for 151,669 tokens."""
    vocab = tokenizer.get_vocab()
    wrong = next(((i, token) for token, i in sorted(vocab.items(), key=lambda item: item[1])
                  if i >= len(tokens) or tokens[i] != token), None)
    if wrong is not None:
        i, token = wrong
        theirs = repr(tokens[i]) if i < len(tokens) else "missing"
        raise Flux2Error(f"{path}: the file's vocabulary is not Qwen3's (token {i} is {theirs} in the file, {token!r} "
                         f"in Qwen3's tokenizer), so it is another language model or a fine-tune with its own "
                         f"tokenizer; {spec.reader} needs the stock {spec.title} (any quantization)")


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def encoder_wanted(variant: Variant) -> str:
    """The text encoder ``variant`` reads its prompts from, as messages name it."""
    return variant.text_encoder.wanted


def check_embeddings_fit(variant: Variant, embeds) -> None:
    """Prompt embeddings [B, L, C] made elsewhere (a ComfyUI CONDITIONING) against the width the model takes."""
    needed = variant.params.context_in_dim
    if embeds.ndim != 3:
        raise Flux2Error(f"the prompt embeddings have shape {list(embeds.shape)} but this model ({variant.name}) takes "
                         f"[batch, tokens, {needed}]: connect a CONDITIONING made by a prompt encoder")
    if embeds.shape[-1] != needed:
        raise Flux2Error(f"the prompt embeddings are {embeds.shape[-1]} wide but this model ({variant.name}) takes "
                         f"{needed}: encode the prompt with the {encoder_wanted(variant)}")


def check_text_encoder_fits(variant: Variant, encoder: PromptEncoder) -> None:
    hidden = encoder.model.embed_tokens.embedding_dim
    needed = variant.params.context_in_dim
    gives = replace(variant.text_encoder, hidden_size=hidden).width      # the layers the model reads, of this width
    if gives == needed:
        return
    title = variant.title or f"a {families.family_of(variant).title} model taking {needed}-wide text embeddings"
    model = getattr(getattr(encoder, "spec", None), "model", "qwen3")     # what it was read as (Qwen3 by default)
    gave = qwen3_name(hidden) if model == "qwen3" else f"a {MODEL_NAMES.get(model, model)}"
    raise Flux2Error(f"this is {title}; it needs the {encoder_wanted(variant)}, but you gave {gave} "
                     f"encoder (hidden "
                     f"{hidden}, so {gives}-wide embeddings where the model takes {needed}). Load the matching "
                     f"text encoder")
