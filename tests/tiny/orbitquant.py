"""Tiny OrbitQuant artifacts written by orbitquant itself: a tiny FLUX.2 transformer in diffusers' module names (as
orbitquant quantizes FLUX.2 Klein) or a tiny FLUX 3 one in BFL's (its native names), quantized by ``quantize_model``
and saved by ``save_orbitquant_artifact``; and ``rewrite``, which changes an artifact's files the way a tool that
rewrote it would (its checksums made true again), so that what a loader refuses is what was changed.

8-bit weights use orbitquant's version-1 codebooks: its version-2 ones take minutes to make at 8 bits (per input
width), version 1 under two seconds, and older artifacts carry them. Activations are 4-bit (codebooks in
milliseconds): our dequantized path does not read them.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

os.environ.setdefault("ORBITQUANT_KERNELS_AUTOFETCH", "0")        # never reach for a kernel download

oq = __import__("pytest").importorskip("orbitquant", reason="orbitquant (the format's own library) is not installed")
from orbitquant.artifacts import save_orbitquant_artifact


def config(bits: int, policy: str, **changes):
    version = 1 if bits == 8 else 2
    return oq.OrbitQuantConfig(weight_bits=bits, activation_bits=4, target_policy=policy, codebook_version=version,
                               runtime_mode="dequant_bf16", **changes)


def quantize(model: torch.nn.Module, folder: Path, bits: int, policy: str, **changes) -> Path:
    """``model`` quantized in place (its linears become orbitquant's layers) and saved as an artifact in ``folder``."""
    settings = config(bits, policy, **changes)
    summary = oq.quantize_model(model, settings, quantization_device="cpu")
    save_orbitquant_artifact(model, folder, config=settings, source_model_id="tests/tiny", source_revision="0" * 40,
                             source_license="apache-2.0", summary=summary)
    return folder


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def rewrite(folder: Path, tensors=None, manifest=None, config_changes=None) -> Path:
    """The artifact with ``tensors(state) -> state`` applied to model.safetensors, ``manifest(dict)`` to its
    manifest and ``config_changes`` merged into its settings; every checksum made true again."""
    if tensors is not None:
        save_file(tensors(load_file(folder / "model.safetensors")), folder / "model.safetensors")
    if config_changes:
        settings = json.loads((folder / "quantization_config.json").read_text()) | config_changes
        (folder / "quantization_config.json").write_text(json.dumps(settings))
    data = json.loads((folder / "orbitquant_manifest.json").read_text())
    data = manifest(data) if manifest is not None else data
    data["checksums"] = {name: sha256(folder / name) for name in data["checksums"]}
    (folder / "orbitquant_manifest.json").write_text(json.dumps(data))
    names = [line.split("  ", 1)[1] for line in (folder / "SHA256SUMS").read_text().splitlines() if line]
    (folder / "SHA256SUMS").write_text("".join(f"{sha256(folder / n)}  {n}\n" for n in names))
    return folder


def dequantized(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """orbitquant's own dequantized weight of one of its layers: (in its rotated basis, turned back by its own
    rotation) for an OrbitQuantLinear; (the weight, the weight) for its int4 modulation layer."""
    weight = layer._dequantize_weight(device=torch.device("cpu"), dtype=torch.float32, **(
        {"remember": False} if isinstance(layer, oq.OrbitQuantLinear) else {}))
    if isinstance(layer, oq.OrbitQuantLinear):
        return weight, layer.rotation.apply_inverse_to_weight(weight)
    return weight, weight
