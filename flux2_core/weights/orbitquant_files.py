"""OrbitQuant artifacts as downloaded: a folder with ``model.safetensors``, its codebooks and rotations, the
quantization settings, a manifest (layers, widths, the files' SHA-256) and ``SHA256SUMS``.

``read_artifact`` checks all of it and hands the loaders a ``Checkpoint`` in the stored formats' terms
(``storage.orbitquant``), specs in ``_quantization_metadata`` as ComfyUI's files give them. No byte is copied: each
tensor is read from where the artifact has it.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import replace
from pathlib import Path

import torch

from ..errors import Flux2Error
from ..storage.orbitquant import ORBITQUANT_FORMAT, ORBITQUANT_INT4_FORMAT, SETTINGS
from ..user_json import read_json_file
from .checkpoint import read_header, read_tensor
from .tensors import Checkpoint, TensorInfo, short

MANIFEST = "orbitquant_manifest.json"
CONFIG = "quantization_config.json"
CODEBOOKS = "orbitquant_codebooks.safetensors"
ROTATIONS = "orbitquant_rotations.safetensors"
MODEL = "model.safetensors"
FORMAT = "orbitquant-v1"
CODES, NORMS = ".packed_weight_indices", ".row_norms"           # an OrbitQuant layer's tensors in model.safetensors
INT4_CODES, INT4_SCALES = ".packed_weight", ".scales"            # a modulation layer's (int4, round to nearest)
FUSED = ".oq_fused."                  # a layer group of a fused checkpoint (orbitquant's own fused blocks' layout)
CODEBOOK_NAME = re.compile(r"dim(\d+)_bits(\d+)\.centroids", re.ASCII)
ROTATION_NAME = re.compile(r"dim(\d+)_seed(\d+)_block(\d+)\.permutation", re.ASCII)
_VERIFIED: dict[tuple[str, int, int], str] = {}      # (file, size, mtime) -> its SHA-256, checked once a process


def as_stored(ckpt: Checkpoint) -> Checkpoint:
    """An OrbitQuant artifact's checkpoint in the stored formats' terms (``read_artifact``); any other as it is."""
    folder = ckpt.files[0].parent
    if (folder / MANIFEST).is_file():
        return read_artifact(folder, ckpt)
    if not any(k.endswith(CODES) or FUSED in k for k in ckpt.tensors):
        return ckpt
    where = ckpt.files[0]
    settings = (ckpt.config or {}).get("quantization_config")
    if isinstance(settings, dict) and settings.get("quant_method") == "orbitquant":
        raise Flux2Error(f"{where} is a diffusers model quantized through orbitquant's Hugging Face integration (its "
                         f"settings in config.json, without an artifact manifest), which this pack does not read: use "
                         f"the model's OrbitQuant artifact (a folder with {MANIFEST}) or its bf16 release")
    bundle = _json(folder.parent / "manifest.json", "") if (folder.parent / "manifest.json").is_file() else {}
    if str(bundle.get("format", "")).endswith("-orbitquant"):
        raise Flux2Error(f"{where} is part of a {bundle['format']} release bundle, made for orbitquant's own runner "
                         f"(the script shipped in it), which this pack does not read: use the model's OrbitQuant "
                         f"artifact (a folder with {MANIFEST}) or its bf16 release")
    raise Flux2Error(f"{where} holds OrbitQuant codes but has no {MANIFEST} beside it: an OrbitQuant model is a whole "
                     f"folder (its manifest, {CONFIG}, {CODEBOOKS} and {ROTATIONS} beside {MODEL}). Download the "
                     f"whole artifact folder and give the folder, or its {MODEL}")


def read_artifact(folder: Path, ckpt: Checkpoint) -> Checkpoint:
    """``ckpt`` (``model.safetensors`` as read) in the stored formats' terms, everything checked first."""
    manifest = _json(folder / MANIFEST, "its manifest")
    config = _json(folder / CONFIG, "its quantization settings")
    if manifest.get("artifact_format") != FORMAT or manifest.get("quant_method") != "orbitquant":
        raise Flux2Error(f"{folder / MANIFEST} is not an OrbitQuant manifest of the {FORMAT} format (it says "
                         f"{short(manifest.get('artifact_format'))}); this pack reads {FORMAT} artifacts")
    if ckpt.files != [folder / MODEL]:
        chosen = ", ".join(f.name for f in ckpt.files)
        raise Flux2Error(f"{folder} is an OrbitQuant artifact, whose model is {MODEL}, not {chosen}: give the folder "
                         f"or its {MODEL}")
    if config.get("fused_layout"):
        raise Flux2Error(f"{folder} is an OrbitQuant fused checkpoint (its layers regrouped for orbitquant's own "
                         f"fused blocks: {short(config['fused_layout'])}), which this pack does not run: download the "
                         f"unfused artifact of the same model (the one whose {CONFIG} has no fused_layout)")
    _check_sums(folder, manifest)
    codebooks = _codebooks(folder)
    rotations = _rotations(folder, config.get("rotation_seed", 0))
    tensors = dict(ckpt.tensors)
    specs: dict[str, dict] = {}
    where = f"{folder}: its"
    bits = _whole(manifest, "weight_bits", where)
    overrides = manifest.get("module_bits") or {}
    if not isinstance(overrides, dict):
        raise Flux2Error(f"{where} manifest's module_bits is {short(overrides)}, not an object; download it again")
    settings = {k: config[k] for k in SETTINGS if k in config}       # what orbitquant's own layer is made with
    for name in _names(manifest, "quantized_modules", where):
        layer_bits = _whole(overrides, name, where, bits) if name in overrides else bits
        codes, norms = _pop(tensors, name, CODES, folder), _pop(tensors, name, NORMS, folder)
        _no_float_beside(tensors, name, folder)
        rows = norms.shape[0] if len(norms.shape) == 1 else 0
        count = math.prod(codes.shape) * 8
        if not rows or len(codes.shape) not in (1, 2) or count % (rows * layer_bits):
            raise Flux2Error(f"{folder}: layer {name} has {math.prod(codes.shape)} bytes of codes and "
                             f"{list(norms.shape)} row norms, which are not {layer_bits}-bit codes of whole rows "
                             f"(the manifest's width for it); the artifact is damaged, download it again")
        inputs = count // (rows * layer_bits)
        levels = codebooks.get((inputs, layer_bits))
        rotation = rotations.get(inputs)
        if levels is None or rotation is None:
            raise Flux2Error(f"{folder}: layer {name} reads as {layer_bits}-bit codes of {inputs} inputs (its "
                             f"manifest's width), but the artifact has no {'codebook' if levels is None else 'rotation'}"
                             f" for {inputs} inputs at {layer_bits} bits: its manifest and its tensors disagree; the "
                             f"artifact is damaged, download it again")
        block, order, signs = rotation
        tensors[f"{name}.weight"] = replace(codes, shape=(rows, inputs * layer_bits // 8))
        tensors |= {f"{name}.weight_norms": norms, f"{name}.weight_levels": levels,
                    f"{name}.weight_order": order, f"{name}.weight_signs": signs}
        specs[name] = {"format": ORBITQUANT_FORMAT.names[0], "bits": layer_bits, "block": block,
                       "settings": settings}
    group = _whole(manifest, "adaln_group_size", where, 64)
    for name in _names(manifest, "adaln_modules", where):
        codes, scales = _pop(tensors, name, INT4_CODES, folder), _pop(tensors, name, INT4_SCALES, folder)
        _no_float_beside(tensors, name, folder)
        rows = scales.shape[0] if len(scales.shape) == 2 else 0
        if not rows or math.prod(codes.shape) != rows * scales.shape[1] * group // 2:
            raise Flux2Error(f"{folder}: layer {name} has {math.prod(codes.shape)} bytes of int4 codes and scales "
                             f"{list(scales.shape)}, which are not groups of {group} (its manifest's); the artifact "
                             f"is damaged, download it again")
        tensors[f"{name}.weight"] = replace(codes, shape=(rows, scales.shape[1] * group // 2))
        tensors[f"{name}.weight_scale"] = scales
        specs[name] = {"format": ORBITQUANT_INT4_FORMAT.names[0], "group_size": group}
    stray = sorted(k for k in tensors if k.endswith((CODES, NORMS, INT4_CODES, INT4_SCALES)))
    if stray:
        raise Flux2Error(f"{folder}: {MODEL} holds {stray[0]}, of a layer its manifest does not list; the artifact "
                         f"is damaged or mixed from two, download it again")
    metadata = dict(ckpt.metadata) | {"_quantization_metadata": json.dumps({"layers": specs})}
    return replace(ckpt, tensors=tensors, metadata=metadata)


def _json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise Flux2Error(f"{path.parent} is an OrbitQuant artifact without {path.name} ({what}); download the whole "
                         f"folder again")
    return read_json_file(path, dict, "download the artifact again", f"the OrbitQuant artifact's {path.name}")


def _whole(values: dict, key: str, where: str, default: int | None = None) -> int:
    value = values.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise Flux2Error(f"{where} {key} is {short(value)}, not a positive whole number; the artifact is damaged, "
                         f"download it again")
    return value


def _names(manifest: dict, key: str, where: str) -> list[str]:
    names = manifest.get(key, [])
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise Flux2Error(f"{where} manifest's {key} is {short(names)}, not a list of layer names; download it again")
    return names


def _pop(tensors: dict[str, TensorInfo], name: str, suffix: str, folder: Path) -> TensorInfo:
    info = tensors.pop(name + suffix, None)
    if info is None:
        raise Flux2Error(f"{folder}: its manifest lists the quantized layer {name}, but {MODEL} has no "
                         f"{name}{suffix}; the artifact is incomplete or damaged, download it again")
    return info


def _no_float_beside(tensors: dict[str, TensorInfo], name: str, folder: Path) -> None:
    if f"{name}.weight" in tensors:
        raise Flux2Error(f"{folder}: {MODEL} holds both codes and a float weight of layer {name}; the artifact is "
                         f"damaged or mixed from two, download it again")


def _sha256(path: Path) -> str:
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _VERIFIED:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
        _VERIFIED[key] = digest.hexdigest()
    return _VERIFIED[key]


def _check_sums(folder: Path, manifest: dict) -> None:
    """Every file the manifest gives a SHA-256 of has it, and so has the manifest, by SHA256SUMS."""
    sums = manifest.get("checksums", {})
    if not isinstance(sums, dict) or not all(isinstance(v, str) for v in sums.values()):
        raise Flux2Error(f"{folder / MANIFEST}: its checksums are {short(sums)}, not file names with their SHA-256; "
                         f"download it again")
    missing = [name for name in (MODEL, CODEBOOKS, ROTATIONS, CONFIG) if name not in sums]
    if missing:
        raise Flux2Error(f"{folder / MANIFEST} gives no checksum of {missing[0]}, which every OrbitQuant artifact's "
                         f"manifest gives; it is damaged, download the artifact again")
    listed = folder / "SHA256SUMS"
    lines = listed.read_text(encoding="utf-8", errors="replace").splitlines() if listed.is_file() else []
    # "<digest>  <name>", or "<digest> *<name>" (sha256sum's binary mode)
    found = {name.strip().removeprefix("*"): digest for digest, _, name in (line.strip().partition(" ") for line in lines)}
    if MANIFEST not in found:
        raise Flux2Error(f"{folder} has no SHA256SUMS listing {MANIFEST}, which every OrbitQuant artifact has; "
                         f"download the whole artifact folder again")
    sums = {**sums, MANIFEST: found[MANIFEST]}
    for name, digest in sums.items():
        path = folder / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise Flux2Error(f"{folder / MANIFEST} gives a checksum for {short(name)}, outside its folder; download "
                             f"it again")
        if not path.is_file():
            raise Flux2Error(f"{folder} lacks {name}, which its manifest lists; download the whole artifact again")
        if _sha256(path) != digest.lower():
            raise Flux2Error(f"{path} is not the file the artifact's manifest lists (its SHA-256 differs): it is "
                             f"damaged, cut or from another artifact; download it again")


def _small_tensors(path: Path) -> dict[str, tuple[TensorInfo, torch.Tensor]]:
    """A codebook or rotation file read whole (kilobytes), through our header checks."""
    if not path.is_file():
        raise Flux2Error(f"{path.parent} is an OrbitQuant artifact without {path.name}; download the whole folder "
                         f"again")
    infos, _ = read_header(path)
    with open(path, "rb") as f:
        return {name: (info, read_tensor(info, f)) for name, info in infos.items()}


def _codebooks(folder: Path) -> dict[tuple[int, int], TensorInfo]:
    """(inputs, bits) -> the levels' tensor: 2^bits float32 levels, finite and rising."""
    found = {}
    for name, (info, values) in _small_tensors(folder / CODEBOOKS).items():
        match = CODEBOOK_NAME.fullmatch(name)
        if match is None:
            continue
        key = (int(match[1]), int(match[2]))
        if not 1 <= key[1] <= 8 or (values.dtype != torch.float32 or values.shape != (1 << key[1],)
                                    or not torch.isfinite(values).all() or (values.diff() <= 0).any()):
            raise Flux2Error(f"{folder / CODEBOOKS}: {name} is not {1 << min(key[1], 8)} rising float32 levels; the "
                             f"artifact is damaged, download it again")
        if key in found:
            raise Flux2Error(f"{folder / CODEBOOKS} holds two codebooks of {key[0]} inputs at {key[1]} bits; the "
                             f"artifact is damaged, download it again")
        found[key] = info
    return found


def _rotations(folder: Path, seed: object) -> dict[int, tuple[int, TensorInfo, TensorInfo]]:
    """inputs -> (block, permutation tensor, signs tensor) of the settings' seed, each checked."""
    read = _small_tensors(folder / ROTATIONS)
    found = {}
    for name, (info, values) in read.items():
        match = ROTATION_NAME.fullmatch(name)
        if match is None:
            continue
        head, dim, block = name.removesuffix(".permutation"), int(match[1]), int(match[3])
        if int(match[2]) != seed:
            raise Flux2Error(f"{folder / ROTATIONS} holds the rotation {head}, of seed {match[2]}, but the artifact's "
                             f"settings give seed {short(seed)}; the artifact is damaged or mixed, download it again")
        signs, norm = read.get(f"{head}.signs"), read.get(f"{head}.normalization")
        ok = (values.dtype == torch.int64 and values.shape == (dim,) and signs is not None
              and signs[1].dtype == torch.int8 and signs[1].shape == (dim,)
              and block > 0 and not block & (block - 1) and dim % block == 0
              and torch.equal(values.sort().values, torch.arange(dim))
              and bool(((signs[1] == 1) | (signs[1] == -1)).all())
              and norm is not None and norm[1].numel() == 1 and abs(float(norm[1].reshape(())) - block ** -0.5) < 1e-6)
        if not ok:
            raise Flux2Error(f"{folder / ROTATIONS}: the rotation {head} is not a permutation of {dim} inputs with "
                             f"signs of ±1 over blocks of {block}; the artifact is damaged, download it again")
        if dim in found:
            raise Flux2Error(f"{folder / ROTATIONS} holds two rotations of {dim} inputs; the artifact is damaged, "
                             f"download it again")
        found[dim] = (block, info, signs[0])
    return found
