"""The one place that talks to ComfyUI: model folders, devices and dtypes, model management, the per-step
progress / preview / interrupt of the denoiser, and the pack's HTTP route. The node files call these few functions and
flux2_core, nothing else.

Our models live under ComfyUI's model management like its own: each core module is wrapped in a ``ModelPatcher``
with a load device (the GPU) and an offload device (usually the CPU), and ``ready`` asks ComfyUI to load it before
use; ComfyUI offloads it again when another model needs the memory, and honours --lowvram / --novram / --cpu.

Partial loading (the model does not fit the free GPU memory): ComfyUI keeps some layers on the offload device and
streams their weights in at each call; it can do that only for layers of its own "castable" classes. So
``manage`` turns our plain ``nn.Linear`` / ``Conv2d`` / ``GroupNorm`` / ``LayerNorm`` / ``Embedding`` layers into
ComfyUI's subclasses of the same layers (same parameters, same maths; they only add the weight streaming), and
makes every other layer that holds parameters (RMS norms) follow its input to the device it runs on. Layers whose
storage copies itself to its input's device (GGUF blocks) get ComfyUI's mark of a castable layer: see ``_host_class``.

Dynamic VRAM (ComfyUI's ``CoreModelPatcher`` made ``ModelPatcherDynamic``, its default on NVIDIA from v0.3x): our
float models' patchers are the host's ``CoreModelPatcher``, so they stream from RAM layer by layer as its own do;
models whose weights are buffers (GGUF, fp8, int8, packed formats), which it would copy whole at every load, keep
the plain patcher (``new_patcher``). Such a host keeps pinned and on-GPU copies of the weights it streams and re-makes
the ones it loads whole at every load, so there the pack never writes a stored weight: LoRAs run beside the weights
(``Managed.use_adapters``), and reference K/V are kept on the offload device between runs; free memory is the
patcher's own count (``free_memory``), which includes what the host gives back on demand.
"""

from __future__ import annotations

import functools
import logging
import os
import weakref
from dataclasses import dataclass

import comfy.model_management as mm
import comfy.model_patcher
import comfy.ops
import comfy.patcher_extension
import comfy.utils
import folder_paths
import latent_preview
import torch
from comfy import latent_formats
from comfy_api import feature_flags
from comfy_api.latest import io
from server import PromptServer
from torch import nn

from ..flux2_core import checks
from ..flux2_core.adapters import patching
from ..flux2_core.adapters.lora import AdapterUse
from ..flux2_core.devices import check_cpu_dtype, cpu_bf16_attention_fails, model_dtype
from ..flux2_core.errors import Flux2Error
from ..flux2_core.models.reference_kv import ReferenceKV
from ..flux2_core.models.run_state import run_state
from ..flux2_core.runtime.cache import fingerprint
from ..flux2_core.runtime.followers import FollowerGroup, TransformerSource
from ..flux2_core.storage.protocol import FLOAT_KINDS, Storage
from ..flux2_core.upsampler.model import upsamplers_under
from ..flux2_core.variants import Variant
from .engine_model import HOLDER_NAME, host_model

log = logging.getLogger("flux2_klein")

WEIGHT_SUFFIXES = (".safetensors", ".sft")
GGUF_SUFFIX = ".gguf"
# The model folders whose loaders take GGUF files, each with ComfyUI-GGUF's folder name for them (registered where that
# pack is installed, with the paths of ComfyUI's folder; extra_model_paths.yaml may add more): listed too
GGUF_FOLDERS = {"diffusion_models": "unet_gguf", "text_encoders": "clip_gguf"}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DTYPE_CHOICES = ["auto", *DTYPES]


# --- model folders ----------------------------------------------------------------------------------------------

def model_choices(folder: str) -> list[str]:
    """What a loader lists for ComfyUI's model folder ``folder``: model folders (a diffusers pipeline or component
    folder: one with model_index.json or config.json) as one entry each, then safetensors files and, for the folders of
    GGUF_FOLDERS, GGUF files, sorted.

    GGUF files are found by our own walk: ComfyUI's file lists filter by each folder's extension set, which has no
    .gguf, and that set is ComfyUI's (other packs read it), so it is not ours to extend."""
    walks = [_walk(base, folder in GGUF_FOLDERS) for base in folder_paths_of(folder)]
    folders, ggufs = {d for found, _ in walks for d in found}, {f for _, found in walks for f in found}
    inside = tuple(os.path.join(d, "") for d in folders)
    files = {f for f in folder_paths.get_filename_list(folder) if f.lower().endswith(WEIGHT_SUFFIXES)} | ggufs
    return sorted(folders) + sorted(f for f in files if not f.startswith(inside))


def folder_paths_of(folder: str) -> list[str]:
    """The paths of ComfyUI's model folder ``folder`` (diffusion_models covers models/unet, text_encoders
    models/clip), then those of ComfyUI-GGUF's folder for it when registered, each once."""
    names = [folder] + [name for name in [GGUF_FOLDERS.get(folder)] if name in folder_paths.folder_names_and_paths]
    return list(dict.fromkeys(path for name in names for path in folder_paths.get_folder_paths(name)))


def _walk(base: str, gguf: bool) -> tuple[set[str], set[str]]:
    """(model folders, .gguf files if ``gguf``) under ``base``, as paths relative to it."""
    folders, ggufs = set(), set()
    for root, dirs, files in os.walk(base, followlinks=True):
        if root != base and ("model_index.json" in files or "config.json" in files):
            folders.add(os.path.relpath(root, base))
            dirs.clear()                      # a pipeline folder's components are not listed on their own
            continue
        ggufs |= {os.path.relpath(os.path.join(root, f), base) for f in files
                  if gguf and f.lower().endswith(GGUF_SUFFIX)}
    return folders, ggufs


def resolve(folder: str, name: str) -> str:
    """The full path of a file or model folder listed by ``model_choices``."""
    for base in folder_paths_of(folder):
        path = os.path.join(base, name)
        if os.path.exists(path):
            return path
    raise Flux2Error(f"{name!r} is not in ComfyUI's models/{folder} folder (or its extra paths); "
                     f"put the file there and refresh the browser")


UPSAMPLER_FOLDER = "prompt_upsamplers"          # models/prompt_upsamplers: one folder per upsampler


def upsampler_folders() -> list[str]:
    """The paths of models/prompt_upsamplers (registered with ComfyUI the first time; extra_model_paths.yaml may add
    more)."""
    if UPSAMPLER_FOLDER not in folder_paths.folder_names_and_paths:
        folder_paths.add_model_folder_path(UPSAMPLER_FOLDER, os.path.join(folder_paths.models_dir, UPSAMPLER_FOLDER))
    return folder_paths.get_folder_paths(UPSAMPLER_FOLDER)


def upsampler_choices() -> list[str]:
    """The folders under models/prompt_upsamplers (or one level deeper) that hold an upsampler's system prompts."""
    return sorted({str(folder.relative_to(base)) for base in upsampler_folders() for folder in upsamplers_under(base)})


def resolve_upsampler(name: str) -> str:
    for base in upsampler_folders():
        if name and os.path.isfile(os.path.join(base, name, "system_prompts.json")):
            return os.path.join(base, name)
    raise Flux2Error(f"no prompt upsampler {name!r} in ComfyUI's models/{UPSAMPLER_FOLDER} folder: put BFL's upsampler "
                     "folder (config.json, system_prompts.json, the weights and tokenizer) there and refresh the "
                     "browser")


def free_for_upsampler() -> torch.device:
    """The device the upsampler runs on, with every model ComfyUI holds unloaded first: a vision-language model of
    several GB does not share the GPU with the image models."""
    mm.unload_all_models()
    mm.soft_empty_cache()
    return mm.get_torch_device()


class TokenReporter:
    """The upsampler's per-token callback: stop if the user cancelled, advance the node's progress bar."""

    def __init__(self, limit: int):
        self.bar = comfy.utils.ProgressBar(limit)

    def __call__(self, count: int) -> None:
        check_interrupt()
        self.bar.update_absolute(count)


# --- devices and dtypes -----------------------------------------------------------------------------------------

def devices(kind: str) -> tuple[torch.device, torch.device]:
    """(load device, offload device) ComfyUI picks for a model of this kind: transformer, text_encoder or ae."""
    if kind == "transformer":
        return mm.get_torch_device(), mm.unet_offload_device()
    if kind == "text_encoder":
        return mm.text_encoder_device(), mm.text_encoder_offload_device()
    return mm.vae_device(), mm.vae_offload_device()


def pick_dtype(choice: str, kind: str, device: torch.device, weight_dtype: torch.dtype | None = None,
               parameters: int = 0, supported: tuple[torch.dtype, ...] = ()) -> torch.dtype:
    """The compute dtype a loader's option names. "auto": for the transformer, the engine's one rule
    (``devices.model_dtype``) among the dtypes its family runs in (``supported``), with ComfyUI's own choice as the
    host's (as its UNETLoader makes it from the file's ``weight_dtype`` and ``parameters``, so --fp16-unet,
    --bf16-unet, --force-fp32 apply; float32 on a CPU, fp16 on a T4); the autoencoder follows ComfyUI's VAE rules
    (--fp32-vae / --bf16-vae); the text encoder bfloat16 where the device runs it well, else float32. A 16-bit file's
    weights stay 16-bit under a wider compute dtype either way (the engine's rule)."""
    if choice != "auto":
        return check_cpu_dtype(DTYPES[choice]) if device.type == "cpu" else DTYPES[choice]
    if kind == "transformer":
        stored = mm.unet_dtype(model_params=parameters, supported_dtypes=list(supported), weight_dtype=weight_dtype)
        return model_dtype(device, supported, mm.unet_manual_cast(stored, device, list(supported)) or stored).dtype
    host = (mm.vae_dtype(device, [torch.bfloat16, torch.float32]) if kind == "ae" else
            torch.bfloat16 if mm.should_use_bf16(device) else torch.float32)
    # ComfyUI's bf16 (--bf16-vae, a CPU it thinks runs bf16) is not taken where torch's bf16 attention cannot run
    return torch.float32 if host == torch.bfloat16 and device.type == "cpu" and cpu_bf16_attention_fails() else host


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def intermediate_device() -> torch.device:
    """Where node outputs (latents, images, conditioning) live between nodes (the CPU unless --gpu-only)."""
    return mm.intermediate_device()


# --- model management -------------------------------------------------------------------------------------------

CASTABLE = {nn.Linear: comfy.ops.disable_weight_init.Linear, nn.Conv2d: comfy.ops.disable_weight_init.Conv2d,
            nn.GroupNorm: comfy.ops.disable_weight_init.GroupNorm, nn.LayerNorm: comfy.ops.disable_weight_init.LayerNorm,
            nn.Embedding: comfy.ops.disable_weight_init.Embedding}


MANUAL_CAST = {nn.Linear: comfy.ops.manual_cast.Linear}


class _Streamed(comfy.ops.CastWeightBiasOp):
    """ComfyUI's mark of a layer whose weights it may leave on the offload device (``comfy_cast_weights``)."""

    bias = None            # ComfyUI reads ``<layer>.bias`` of every marked layer (model_patcher.get_key_weight)


@functools.cache
def _host_class(ours: type, base: type | None) -> type:
    """Our layer class as ComfyUI's model management sees it, state and maths unchanged.

    A storage that follows its input (GGUF blocks: ``follows_input``) holds its weights in a buffer, and ComfyUI's
    ModelPatcher.load handles only the modules that have parameters of their own or the castable mark
    (model_patcher._load_list): unmarked, such a layer would be neither moved nor counted by any load but a full one,
    and load_models_gpu asks for a full load only when forced or on the CPU, so on a GPU every GGUF layer would stay
    in CPU memory and be copied in at each call, uncounted. Marked, ComfyUI moves it to the GPU when it fits, else
    leaves it on the offload device (a "lowvram" weight), and counts it by its state dict; no cast function is
    needed, as the layer copies its blocks to its input's device itself.

    A layer of one of ComfyUI's castable torch classes (``base``: our float Linear is an nn.Linear) becomes a
    subclass of ComfyUI's class and of ours, with torch's own forward between the two: ComfyUI's forward streams the
    weight when it left it on the offload device and otherwise runs torch's, as for its own layers (so a layer
    computes the same loaded whole or streamed, whatever kernel our class would pick), and the storage protocol
    (adapters, census) stays. A storage that casts its weight to the compute dtype (``casts_weight``: a 16-bit weight
    under a float32 compute dtype) takes ComfyUI's manual-cast class, whose forward always casts."""
    if base is None:
        return type(ours.__name__, (ours, _Streamed), {})
    if ours is base:
        return CASTABLE[base]
    torch_forward = type(f"Torch{base.__name__}Forward", (), {"forward": base.forward})
    # a weight kept in another dtype than the compute one: ComfyUI's manual-cast class casts it at each call, as it
    # does for its own models' weights
    comfy_class = MANUAL_CAST[base] if getattr(ours, "casts_weight", False) else CASTABLE[base]
    return type(ours.__name__, (comfy_class, torch_forward, ours), {})


class Holder(nn.Module):
    """What the ModelPatcher manages: the core module as its only child (ComfyUI sets ``.device`` on the module it
    manages, and some core modules define ``device`` as a read-only property)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module


# One holder class per kind, so ComfyUI's log says "Requested to load Flux2KleinTextEncoder"; a transformer's holder
# is ComfyUI's own model of its family around it where ComfyUI has one (engine_model.py), which ComfyUI's samplers
# can drive too, else a plain holder.
HOLDERS = {kind: type(name, (Holder,), {}) for kind, name in [
    ("text_encoder", "Flux2KleinTextEncoder"), ("ae", "Flux2KleinAE"), ("transformer", HOLDER_NAME)]}


@dataclass
class Managed:
    """A core model under ComfyUI's model management; what our model types carry between nodes."""

    core: object                       # Flux2Transformer, PromptEncoder or AutoEncoder
    patcher: comfy.model_patcher.ModelPatcher
    dtype: torch.dtype
    variant: Variant | None = None     # transformers only
    full_load: bool = False            # never load partially (layers ComfyUI cannot stream, e.g. fp8 ones; GGUF
                                       # ones stream: _host_class)
    fingerprint: str = ""              # cache.fingerprint of the weights as loaded
    compiled: bool = False             # transformers: run the blocks torch.compiled (Klein Compile)
    adapters: tuple[AdapterUse, ...] = ()   # transformers and text encoders: one per Klein LoRA node, in
                                            # chain order
    recipe: TransformerSource | None = None   # transformers: its file as loaded, for follower processes (Parallel)
    ranks: int = 1                     # transformers: the processes (devices) its denoising is spread over

    def ready(self, memory: int = 0) -> torch.device:
        """Load (or keep) the model on its device with ``memory`` bytes to spare for activations; the device."""
        mm.load_models_gpu([self.patcher], memory_required=memory, force_full_load=self.full_load)
        return self.patcher.load_device

    @property
    def key(self) -> tuple:
        """What our caches key this model's results by: its weights as loaded, its dtype and ComfyUI's patches (by
        their id, when there are any: every new ModelPatcher gets a new id, so the same file loaded again by another
        graph keeps its key). Unlike a fingerprint of the weights where they are now, it stays the same as ComfyUI
        loads and offloads."""
        return (self.fingerprint, str(self.dtype), str(self.patcher.patches_uuid) if self.patcher.patches else "",
                self.adapter_key)

    def use_adapters(self, module: nn.Module, patches_of) -> None:
        """Apply the LoRAs this model came with (Klein LoRA nodes) to ``module``, its transformer or its
        Qwen3, with ``patches_of(adapter)`` picking their patches for it; the weights as loaded when there are none.
        The module is shared by every branch using the loader's output, so each user sets the LoRAs it needs;
        flux2_core.adapters.patching restores the original weights bit for bit in between. Under dynamic VRAM nothing
        merges (a merged weight would go stale in the host's copies): every LoRA runs beside the weights."""
        if run_state(module).adapter_key != self.adapter_key:
            merge = patching.merge_asked(a.merge for a in self.adapters if a.strength)
            if is_dynamic(self.patcher):
                if merge:
                    log.warning("Klein LoRA: merge is not taken under ComfyUI's dynamic VRAM, which streams the "
                                "weights as stored; the LoRA runs beside them")
                merge = False
            patching.set_adapters(module, [(patch, a.strength) for a in self.adapters
                                           for patch in patches_of(a.adapter)], self.adapter_key, merge)

    @property
    def adapter_key(self) -> tuple:
        """The LoRAs this model runs with: (file, content digest, strength, merge) each (flux2_core.adapters.patching's key)."""
        return tuple((a.file, a.digest, a.strength, a.merge) for a in self.adapters if a.strength != 0)


def partially_loaded(model: Managed) -> bool:
    """Whether ComfyUI keeps some of the model's layers on the offload device, streaming their weights at each call
    (its "lowvram" loading, when the model does not fit the free memory, and every load under dynamic VRAM)."""
    return is_dynamic(model.patcher) or bool(getattr(model.patcher.model, "model_lowvram", False))


def is_dynamic(patcher) -> bool:
    """Whether ComfyUI streams this patcher's weights from RAM (a ``ModelPatcherDynamic``)."""
    return patcher.is_dynamic()


def new_patcher(model: nn.Module, kind: str, streams: bool = True) -> comfy.model_patcher.ModelPatcher:
    """A patcher of the class the host makes its own models with (``CoreModelPatcher``: dynamic where dynamic VRAM
    is on; a plain ``ModelPatcher`` on a CPU load device and on hosts without it), on the devices of ``kind``.

    Dynamic only where it can stream the model (``streams``): it streams parameters alone and loads buffers whole at
    every load, so a model whose weights are buffers (GGUF blocks, fp8, int8, packed formats) keeps the plain
    patcher, which loads them once and streams GGUF blocks by their mark. The first dynamic patchers (opt-in before
    v0.3x) kept every weight they do not stream on the CPU, where our encoders, which run where their anchor layer
    is, would then compute; there too the plain patcher. The later design loads those weights whole
    (``restore_loaded_backups`` puts them back)."""
    load_device, offload_device = devices(kind)
    plain = comfy.model_patcher.ModelPatcher
    patcher_class = getattr(comfy.model_patcher, "CoreModelPatcher", plain)
    if not streams or not hasattr(patcher_class, "restore_loaded_backups"):
        patcher_class = plain
    patcher = patcher_class(model, load_device=load_device, offload_device=offload_device)
    if is_dynamic(patcher):
        patcher.cached_patcher_init = (_no_plain_copy, ())
    return patcher


def _no_plain_copy(*args, **kwargs):
    """What a dynamic patcher calls for a fresh copy of its model (ComfyUI's TorchCompileModel node, conditioning
    with hooks, its device selectors): ComfyUI reloads its own models' files for one; ours are refused with what to
    do instead."""
    raise Flux2Error("this ComfyUI node needs a fresh copy of the model (TorchCompileModel, conditioning with hooks, "
                     "a device selector under dynamic VRAM), which a Klein model does not make: use Klein Compile "
                     "before Klein to MODEL and Klein Parallel for several GPUs, or start ComfyUI with "
                     "--disable-dynamic-vram")


def streams_whole(module: nn.Module) -> bool:
    """Whether every weight storage of ``module`` holds plain float weights (parameters a dynamic host streams)."""
    return all(layer.kind in FLOAT_KINDS for layer in module.modules() if isinstance(layer, Storage))


def manage(core, module: nn.Module, kind: str, dtype: torch.dtype, anchor: str = "", variant=None,
           full_load: bool = False) -> Managed:
    """Put ``module`` (the nn.Module inside ``core``) under ComfyUI's model management.

    anchor: the layer whose device the core reads to decide where to run (PromptEncoder, AutoEncoder); it stays a
    plain layer that ComfyUI loads whole or not at all, so the model runs where that layer is. A GGUF anchor (a GGUF
    encoder's embedding) is marked all the same: ComfyUI moves a marked layer whole or not at all too, and an
    unmarked one never (``_host_class``).
    """
    holder = host_model(module, variant, dtype, devices(kind)[1]) if kind == "transformer" else None
    patcher = new_patcher(holder if holder is not None else HOLDERS[kind](module), kind, streams_whole(module))
    for name, layer in module.named_modules():
        castable = _castable(layer, name == anchor)
        if castable is not None:
            layer.__class__ = castable                   # a subclass with the same state: see the module docstring
        elif next(layer.children(), None) is None and next(layer.parameters(recurse=False), None) is not None:
            layer.register_forward_pre_hook(_follow_input)   # a leaf layer with parameters, e.g. an RMS norm
    return Managed(core, patcher, dtype, variant, full_load, fingerprint(module))


class Flux2KleinReferenceKV(nn.Module):
    """9B-KV reference keys and values as a model of their own for ComfyUI's model management ("Flux2KleinReferenceKV"
    in its log): counted in its memory, moved to the offload device when ComfyUI needs the memory or the user frees
    it, and freed with the last reference to it. The tensors are parameters of this one leaf module, which ComfyUI
    loads whole (force_full_load)."""

    def __init__(self, kv: ReferenceKV):
        super().__init__()
        self.num_tokens, self.count = kv.num_tokens, len(kv.blocks)
        for i, (k, v) in enumerate(kv.blocks):
            self.register_parameter(f"k{i}", nn.Parameter(k, requires_grad=False))
            self.register_parameter(f"v{i}", nn.Parameter(v, requires_grad=False))

    def kv(self) -> ReferenceKV:
        """The keys and values where they are now (ComfyUI moves the parameters, so read them after loading)."""
        return ReferenceKV([(getattr(self, f"k{i}").detach(), getattr(self, f"v{i}").detach())
                            for i in range(self.count)], self.num_tokens)


def manage_reference_kv(kv: ReferenceKV) -> comfy.model_patcher.ModelPatcher:
    """Reference K/V (freshly computed, on the transformer's device) under ComfyUI's model management; ComfyUI
    counts them as loaded from the first ``reference_kv_ready``. A dynamic host loads them whole at each load and
    frees them by putting back what it had before, so there they start on the offload device."""
    patcher = new_patcher(Flux2KleinReferenceKV(kv), "transformer")
    if is_dynamic(patcher):
        patcher.model.to(patcher.offload_device)
    return patcher


def reference_kv_ready(patcher: comfy.model_patcher.ModelPatcher, model: Managed, memory: int) -> ReferenceKV:
    """Managed reference K/V on the device (loaded there if ComfyUI had offloaded them), with the transformer still
    loaded beside them (``memory``: its activation memory, as for ``Managed.ready``)."""
    mm.load_models_gpu([patcher], force_full_load=True)
    device = model.ready(memory)            # making room for the K/V may have pushed (part of) the transformer out
    return patcher.model.kv().to(device)     # no copy unless ComfyUI had to give their memory to the transformer


def _castable(layer: nn.Module, anchor: bool) -> type | None:
    """The class ComfyUI can stream a layer as (``_host_class``): marked when its storage follows its input (anchor or
    not; such a model keeps the plain patcher: ``new_patcher``), ComfyUI's castable class for a layer of a castable
    torch class (ours included); None for anything else and for a plain anchor."""
    if hasattr(layer, "comfy_cast_weights"):
        return None                                      # already ComfyUI's
    if getattr(layer, "follows_input", False):
        return _host_class(type(layer), None)
    base = next((base for base in CASTABLE if isinstance(layer, base)), None)
    return None if anchor or base is None else _host_class(type(layer), base)


def free_memory(model: Managed, device: torch.device) -> int:
    """What ComfyUI counts as free for ``model`` on ``device`` once it has offloaded what it could
    (``Managed.ready``): the GPU's free and cached memory, or the RAM available on the CPU, and under dynamic VRAM
    what streamed weights it would give back on demand (the patcher's own count, as its samplers ask it)."""
    return model.patcher.get_free_memory(device)


def _follow_input(layer: nn.Module, args) -> None:
    """Move a small non-castable layer (a norm) to its input's device when ComfyUI left it on the offload device."""
    x = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if x is not None and any(p.device != x.device for p in layer.parameters(recurse=False)):
        layer.to(x.device)


# --- the denoiser's steps ---------------------------------------------------------------------------------------

class StepReporter:
    """The denoiser's per-step callback: stop if the user cancelled, advance the node's progress bar, and send a
    latent preview of the model's clean-image estimate (ComfyUI's previewer for FLUX.2 latents: latent2rgb or TAESD,
    as --preview-method or the browser's setting asks; none by default)."""

    def __init__(self, steps: int, device: torch.device):
        self.bar = comfy.utils.ProgressBar(steps)
        self.previewer = latent_preview.get_previewer(device, latent_formats.Flux2())

    def __call__(self, step) -> None:          # step: flux2_core.sampling.euler.Step
        check_interrupt()
        preview = None
        if self.previewer is not None:
            preview = self.previewer.decode_latent_to_preview_image("JPEG", step.denoised.float())
        self.bar.update_absolute(step.index + 1, step.total, preview)


def check_interrupt() -> None:
    mm.throw_exception_if_processing_interrupted()


# --- several devices (Klein Parallel) -----------------------------------------------------------------------

FOLLOWERS: dict[tuple, FollowerGroup] = {}       # the running follower group by (recipe, devices); at most one


def parallel_devices(model: Managed) -> list[str]:
    """The devices of ``model.ranks`` ranks: ComfyUI's device for this process (rank 0), then the other GPUs in
    order; on the CPU (--cpu), processes sharing it."""
    device = model.patcher.load_device
    if device.type == "cpu":
        return [str(device)] * model.ranks
    if device.type != "cuda":
        raise Flux2Error(f"Klein Parallel spreads the work over NVIDIA GPUs (CUDA), but ComfyUI computes on "
                         f"{device.type} here: bypass the Parallel node")
    others = [f"cuda:{i}" for i in range(torch.cuda.device_count()) if i != device.index]
    if len(others) + 1 < model.ranks:
        raise Flux2Error(f"Klein Parallel asks for {model.ranks} GPUs but this machine shows "
                         f"{len(others) + 1}: set its gpus to {len(others) + 1} or fewer")
    return [str(device), *others[:model.ranks - 1]]


def followers(model: Managed) -> FollowerGroup:
    """The follower processes for ``model``'s parallel denoise, started on first use (each loads the transformer
    file): one group at a time. They stop when ComfyUI unloads the model between prompts ("Unload models", or
    another workflow's models taking the memory) or drops it; unloaded while a prompt runs (ComfyUI making room on
    this GPU for the text encoder, say: their GPUs are not involved), they stay for the next denoise."""
    key = (model.recipe, tuple(parallel_devices(model)))
    group = FOLLOWERS.get(key)
    if group is not None and group.usable():
        return group
    close_followers()
    log.info("Klein Parallel: starting %d follower processes on %s", model.ranks - 1, ", ".join(key[1][1:]))
    FOLLOWERS[key] = FollowerGroup.start(model.recipe, list(key[1]), cancel=check_interrupt)
    detach = comfy.patcher_extension.CallbacksMP.ON_DETACH
    model.patcher.remove_callbacks_with_key(detach, "flux2_followers")          # one, however often they restart
    model.patcher.add_callback_with_key(detach, "flux2_followers",
                                        lambda *_: None if prompt_running() else close_followers(key))
    weakref.finalize(model.patcher, close_followers, key)
    return FOLLOWERS[key]


def prompt_running() -> bool:
    """Whether ComfyUI is executing a prompt now (its "Unload models" runs between prompts)."""
    running, _ = PromptServer.instance.prompt_queue.get_current_queue_volatile()
    return bool(running)


def close_broken_followers() -> None:
    """Close the follower group if one of its processes has stopped, or a pass was cut short (cancelled, failed):
    the next run starts new ones."""
    if any(not group.usable() for group in FOLLOWERS.values()):
        close_followers()


def close_followers(key: tuple | None = None) -> None:
    """Stop the follower processes (those of ``key`` only, if given) and free their memory."""
    groups = [FOLLOWERS.pop(k) for k in list(FOLLOWERS) if key is None or k == key]
    for group in groups:
        group.close()


# --- validation when a prompt is queued ---------------------------------------------------------------------------

# The default of an optional input in a node's validate_inputs: ComfyUI passes a linked input as None there (its
# value exists only once the graph runs) and leaves an unconnected one out, so this default means "not connected".
UNCONNECTED = object()


def validate(node: type, values: dict, rule=None) -> bool | str:
    """What a node's ``validate_inputs`` returns: True, or the message ComfyUI answers POST /prompt with (400,
    node_errors naming the inputs), before any node of the graph runs.

    ComfyUI leaves the inputs a validate_inputs names to it (execution.validate_inputs skips its own min / max and
    option checks for them), so ``values`` (input name -> widget value) are checked here against the node's schema
    again, and for being finite: NaN passes ComfyUI's comparisons. Then ``rule`` (flux2_core checks raising
    Flux2Error: the ones execute applies) runs, unless a value is None: fed by a link, checked when the node runs."""
    specs = {spec.id: spec for spec in node.define_schema().inputs}
    try:
        for name, value in values.items():
            spec = specs[name]
            if value is None:
                continue
            if isinstance(spec, io.Combo.Input):
                if value not in spec.options:
                    raise Flux2Error(f"{name} must be one of {', '.join(map(str, spec.options))}, got {value!r}")
            elif isinstance(spec, io.Int.Input | io.Float.Input):
                checks.number(name, value, spec.min, spec.max)
        if rule is not None and None not in values.values():
            rule()
    except Flux2Error as e:
        return str(e)
    return True


# --- the server -------------------------------------------------------------------------------------------------

def add_route(method: str, path: str, handler, feature: str) -> None:
    """Serve ``handler`` (an aiohttp handler) at ``path`` on ComfyUI's server, also under /api like every route, and
    announce it to browsers with the server feature flag ``feature``. Call before the server starts (from the pack's
    comfy_entrypoint); a second call for the same feature does nothing."""
    if feature_flags.SERVER_FEATURE_FLAGS.get(feature):
        return
    PromptServer.instance.routes.route(method, path)(handler)
    feature_flags.SERVER_FEATURE_FLAGS[feature] = True
