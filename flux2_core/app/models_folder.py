"""A ComfyUI models folder (``--models``): which models it holds and the one a run takes. A file is known by its
usual name, else by its headers (no tensor is read). Without ``--variant`` the first model in the registry's order
is taken."""

from __future__ import annotations

import argparse
import errno
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import Flux2Error
from ..families import runnable_variant, runnable_variants
from ..listing import bounded_notes
from ..variants import TextEncoderSpec, Variant

# ComfyUI model folders (and their legacy names) and the usual autoencoder names in them
TRANSFORMER_FOLDERS = ("diffusion_models", "unet")
TEXT_ENCODER_FOLDERS = ("text_encoders", "clip")
AE_FOLDERS = ("vae",)
AE_FILES = ("flux2-vae.safetensors", "ae.safetensors", "full_encoder_small_decoder.safetensors")
WEIGHT_SUFFIXES = (".safetensors", ".gguf")


def variant_option(text: str) -> str:
    """--variant: a variant this engine runs (argparse's type: a refusal is a usage error listing them)."""
    try:
        return runnable_variant(text).name
    except Flux2Error as e:
        raise argparse.ArgumentTypeError(str(e)) from None


@dataclass
class FolderSearch:
    """The files a run takes, the variant they are for, and the notes the run prints."""
    transformer: Path
    text_encoder: Path
    ae: Path
    variant: Variant | None            # what the files were looked up for (None: only explicit paths were given)
    notes: list[str] = field(default_factory=list)

    @property
    def paths(self) -> tuple[Path, Path, Path]:
        return self.transformer, self.text_encoder, self.ae


@dataclass
class Survey:
    """The models folder's transformers by the variant each is, and what was passed over with a word."""
    folder: Path
    models: dict[str, list[Path]] = field(default_factory=dict)   # variant name -> its files, usual names first
    passed: list[str] = field(default_factory=list)               # notes on files that could not be taken

    def present(self, exclude: Variant | None = None) -> list[Variant]:
        return [v for v in runnable_variants() if self.models.get(v.name) and v != exclude]


def _files(models: Path, folders: tuple[str, ...], passed: list[str] | None = None) -> Iterator[Path]:
    """The readable weight files of the folders, by name; other entries named like one are noted in ``passed``."""
    for folder in folders:
        for path in sorted(p for p in (models / folder).glob("*") if p.suffix.lower() in WEIGHT_SUFFIXES):
            why = unusable(path)
            if not why:
                yield path
            elif passed is not None and (note := f"passed over {path.relative_to(models)}: it is {why}") not in passed:
                passed.append(note)


def _artifact_folders(models: Path) -> list[Path]:
    """The transformer folders' artifact folders (OrbitQuant's: a manifest beside model.safetensors)."""
    from ..weights.orbitquant_files import MANIFEST

    return sorted(p.parent for folder in TRANSFORMER_FOLDERS for p in (models / folder).glob(f"*/{MANIFEST}"))


def unusable(path: Path) -> str:
    """What an entry named like a weights file is when it cannot be read as one, or "" where it can."""
    if not path.exists():                             # a link whose target cannot be reached, or nothing
        if not path.is_symlink():
            return "not there"
        try:
            path.resolve(strict=True)
        except RuntimeError:                          # Python before 3.13 says a loop so
            return "a symbolic link that loops back on itself"
        except OSError as e:
            if e.errno == errno.ELOOP:
                return "a symbolic link that loops back on itself"
            return f"a link to {os.readlink(path)}, which does not exist"
    if path.is_dir():
        return "a folder, not a weights file"
    if not path.is_file():
        return "not a regular file (a device, a pipe or a socket)"
    try:
        with open(path, "rb"):
            return ""
    except OSError as e:
        return f"a file that cannot be read ({e.strerror or e})"


# a GGUF quantization's name: Q4_K_M, IQ3_XS, Q8_0, BF16, F16, F32
GGUF_QUANT = re.compile(r"(?:I?Q\d\w*|BF16|F16|F32)\.gguf", re.IGNORECASE)


def _usual(path: Path, names: tuple[str, ...], gguf_stem: str) -> bool:
    """One of ``names``, or exactly ``<gguf_stem>-<quant>.gguf`` (so a -kv or -base GGUF is not taken for another)."""
    if path.name in names:
        return True
    stem = f"{gguf_stem}-"
    return bool(gguf_stem) and path.name.startswith(stem) and GGUF_QUANT.fullmatch(path.name[len(stem):]) is not None


def _rank(path: Path, names: tuple[str, ...]) -> int:
    """Files of one model in the order of its usual names (bf16 before fp8), then the rest."""
    return names.index(path.name) if path.name in names else len(names)


def _passed_note(path: Path, folder: Path) -> str | None:
    """Why a file was passed over (unreadable, or the upsampler's); None for another model's file."""
    from ..weights.checkpoint import open_checkpoint
    from ..weights.key_mapping import PROMPT_UPSAMPLER, is_prompt_upsampler

    try:
        ckpt = open_checkpoint(path, "")
    except Flux2Error as e:
        return f"passed over {path.relative_to(folder)}, which cannot be read: {e}"
    if is_prompt_upsampler(ckpt):
        return f"passed over {path.relative_to(folder)}: it is {PROMPT_UPSAMPLER}"
    return None


def _survey(folder: Path) -> Survey:
    """Every transformer file, by its usual name, else by its headers."""
    from ..weights import inspect_transformer

    survey, runnable = Survey(folder), runnable_variants()
    for path in [*_files(folder, TRANSFORMER_FOLDERS, survey.passed), *_artifact_folders(folder)]:
        variant = next((v for v in runnable if _usual(path, v.files, v.gguf_stem)), None)
        if variant is None:
            try:
                found = inspect_transformer(path)[1].name
            except Flux2Error:
                if (note := _passed_note(path, folder)) is not None:
                    survey.passed.append(note)
                continue
            variant = next((v for v in runnable if v.name == found), None)
        if variant is not None:
            survey.models.setdefault(variant.name, []).append(path)
    for variant in runnable:
        survey.models.get(variant.name, []).sort(key=lambda p, names=variant.files: _rank(p, names))
    return survey


def _usual_file(folder: Path, folders: tuple[str, ...], names: tuple[str, ...], gguf_stem: str = "") -> Path | None:
    """The first of ``names`` found in the folders (in their order), else the first GGUF of the stem."""
    for name in names:
        for sub in folders:
            if not unusable(folder / sub / name):
                return folder / sub / name
    return next((p for p in _files(folder, folders) if gguf_stem and _usual(p, (), gguf_stem)), None)


def _text_encoder(folder: Path, spec: TextEncoderSpec, passed: list[str]) -> Path | None:
    """By its usual names, else the first file whose headers say it is the encoder ``spec`` reads."""
    from ..weights import inspect_text_encoder

    found = _usual_file(folder, TEXT_ENCODER_FOLDERS, spec.files, spec.gguf_stem)
    if found is not None:
        return found
    for path in _files(folder, TEXT_ENCODER_FOLDERS, passed):
        try:
            identity = inspect_text_encoder(path)
        except Flux2Error:
            if (note := _passed_note(path, folder)) is not None:
                passed.append(note)
            continue
        if spec.reads(identity.model) and identity.hidden == spec.hidden_size:
            return path
    return None


def _needed(variant: Variant) -> list[str]:
    """The files ``variant`` is run from, by their usual names, a line each."""
    def line(folder: str, names: tuple[str, ...], gguf_stem: str) -> str:
        gguf = f" (or {gguf_stem}-<quant>.gguf)" if gguf_stem else ""
        return f"  {folder}/{' or '.join(names)}{gguf}"
    spec = variant.text_encoder
    return [line(TRANSFORMER_FOLDERS[0], variant.files, variant.gguf_stem),
            line(TEXT_ENCODER_FOLDERS[0], spec.files, spec.gguf_stem), line(AE_FOLDERS[0], AE_FILES, "")]


def _choose(survey: Survey | None, asked: Variant | None, transformer: str | None) -> Variant | None:
    """The one asked, else the explicit transformer's, else the first present in the registry's order."""
    if asked is not None:
        return asked
    if transformer is not None:
        from ..weights import inspect_transformer

        try:
            found = inspect_transformer(transformer)[1].name
        except Flux2Error:               # the load says what is wrong with it
            return None
        return next((v for v in runnable_variants() if v.name == found), None)
    present = survey.present() if survey is not None else []
    return present[0] if present else None


def _others(survey: Survey, chosen: Variant) -> str:
    """The other models present, each with a file, and the option that picks one."""
    others = survey.present(exclude=chosen)
    if not others:
        return ""
    listed = ", ".join(f"{v.name} ({survey.models[v.name][0].name})" for v in others)
    return f"{survey.folder} also holds {listed}: run one with --variant NAME"


def search_models(models: str | None, variant: str | None, transformer: str | None = None,
                  text_encoder: str | None = None, ae: str | None = None) -> FolderSearch:
    """Explicit paths, the rest from the models folder. Flux2Error where a file is missing, naming what it lacks."""
    asked = runnable_variant(variant) if variant is not None else None
    folder = Path(models).expanduser() if models else None
    if folder is not None and not folder.is_dir():
        raise Flux2Error(f"--models {models}: no such folder; pass ComfyUI's models folder (the one holding "
                         "diffusion_models/, text_encoders/ and vae/)")
    survey = _survey(folder) if folder is not None else None
    chosen, given_transformer = _choose(survey, asked, transformer), transformer is not None
    notes = list(survey.passed) if survey is not None else []
    if folder is not None and chosen is not None:
        transformer = transformer or next(iter(survey.models.get(chosen.name, [])), None)
        text_encoder = text_encoder or _text_encoder(folder, chosen.text_encoder, notes)
    if folder is not None:
        ae = ae or _usual_file(folder, AE_FOLDERS, AE_FILES)
    missing = [what for what, path in (("--transformer", transformer), ("--text-encoder", text_encoder),
                                       ("--ae", ae)) if path is None]
    others = _others(survey, chosen) if survey is not None and chosen is not None else ""
    if missing:
        how = "--variant" if asked is not None else "--transformer" if given_transformer else "the first model found"
        raise Flux2Error(_missing_message(folder, chosen, how, missing, others,
                                          bounded_notes(notes, "files passed over")))
    notes = bounded_notes(notes, "files passed over")
    if others and asked is None and not given_transformer:      # --variant cannot replace an explicit --transformer
        order = ", ".join(v.name for v in runnable_variants())
        notes.insert(0, f"this run takes {chosen.name} ({Path(transformer).name}), the first model found in the "
                        f"order {order}; {others}")
    return FolderSearch(Path(transformer), Path(text_encoder), Path(ae), chosen, notes)


def _missing_message(folder: Path | None, chosen: Variant | None, how: str, missing: list[str],
                     others: str, notes: list[str]) -> str:
    """``how``: what chose ``chosen`` (--variant, --transformer, the first model found)."""
    where = f"in {folder}" if folder else "(no --models folder given)"
    head = (f"no weights found {where} for {', '.join(missing)}. Either pass --models with the path of a ComfyUI "
            f"models folder that holds the files below (each in the subfolder shown), or give each file with "
            f"--transformer, --text-encoder and --ae. No weights at hand? --demo runs with random ones.")
    if chosen is None:                  # no model at all: what each one needs
        needs = "\n".join(f"for {v.name}:\n" + "\n".join(_needed(v)) for v in runnable_variants())
        return "\n".join([head, needs, *notes])
    lacking = dict(zip(("--transformer", "--text-encoder", "--ae"), _needed(chosen)))
    lines = [f"for {chosen.name}: {chosen.title} ({how}) lacks", *(lacking[what] for what in missing)]
    return "\n".join([head, *lines, *([others] if others else []), *notes])


def find_weights(models: str | None, variant: str | None, transformer: str | None = None,
                 text_encoder: str | None = None, ae: str | None = None) -> tuple[Path, Path, Path]:
    """The (transformer, text encoder, autoencoder) paths of ``search_models``."""
    return search_models(models, variant, transformer, text_encoder, ae).paths
