"""Pictures from the user's disk for a workflow on a ComfyUI server: checked, named by their content, uploaded.

A picture is uploaded as flux2-<sha256>.png with overwrite off, so a re-run finds it and ComfyUI keeps one copy. A
mask is joined to its picture here, not through /upload/mask, which would store another copy each run.
"""

from __future__ import annotations

import hashlib
import io
import os
import sys
from dataclasses import dataclass

from PIL import Image

from ..errors import Flux2Error
from ..sampling.inpaint import mask_levels
from ..sampling.references import decoded
from .queue_client import ComfyClient, ServerError, parse_json, shown, size

UPLOAD_LIMIT = 100 << 20          # bytes: ComfyUI's default --max-upload-size is 100 MB
PIXEL_LIMIT = 64 << 20            # pixels: 64 megapixels, far past any size FLUX.2 Klein is run at
SUFFIXES = {"PNG": ".png", "JPEG": ".jpg", "MPO": ".jpg", "WEBP": ".webp", "BMP": ".bmp", "GIF": ".gif",
            "TIFF": ".tif"}       # formats Load Image reads (through PIL), and the suffix their upload gets


@dataclass(frozen=True)
class Picture:
    """Its bytes are read again (checked against `digest`) at upload, so a batch holds no picture in memory."""

    path: str                     # the local file
    name: str                     # the name it is uploaded as: flux2-<digest><suffix>
    digest: str                   # sha256 of the bytes uploaded
    width: int
    height: int
    mask: str | None = None       # the mask file whose alpha it carries (then the bytes are a PNG made here)
    mask_reading: str = "auto"    # how the mask was read (``inpaint.mask_levels``)

    def data(self) -> bytes:
        data = (_masked_bytes(self.path, self.mask, "upload", self.mask_reading) if self.mask else
                _read(self.path, "upload"))
        if hashlib.sha256(data).hexdigest() != self.digest:
            raise Flux2Error(f"the picture {self.path} on this machine changed after it was checked (its bytes are "
                             "no longer the ones checked), so it was not sent; put the original back, or run again to "
                             "send it as it is now")
        return data


def _read(path: str, what: str) -> bytes:
    try:
        length = os.path.getsize(path)
        if length > UPLOAD_LIMIT:
            raise Flux2Error(f"{what}: {path} is {size(length)}, over the {size(UPLOAD_LIMIT)} ComfyUI takes by "
                             "default (its --max-upload-size); make the picture smaller, e.g. save it as JPEG")
        with open(path, "rb") as f:
            return f.read()
    except IsADirectoryError:
        raise Flux2Error(f"{what}: {path} is a folder; give a picture file") from None
    except OSError as e:
        raise Flux2Error(f"{what}: cannot read {path} ({e.strerror or e}); check the path") from None


def _open(path: str, data: bytes, what: str) -> Image.Image:
    """Decoded to the last pixel: a cut file is caught here, not in ComfyUI."""
    try:
        picture = Image.open(io.BytesIO(data))
        if picture.width * picture.height > PIXEL_LIMIT:
            raise Flux2Error(f"{what}: {path} is {picture.width}x{picture.height} pixels, over the "
                             f"{PIXEL_LIMIT >> 20} megapixels this client sends; scale it down first")
        picture.load()
    except Flux2Error:
        raise
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise Flux2Error(f"{what}: {path} is not a readable picture ({shown(str(e), 120)}); give a PNG, JPEG or "
                         "WEBP file") from None
    if picture.format not in SUFFIXES:
        raise Flux2Error(f"{what}: {path} is a {picture.format} picture, which Load Image may not read; save it as "
                         "PNG or JPEG")
    return picture


def read_picture(path: str, what: str, mask: str | None = None, mask_reading: str = "auto") -> Picture:
    """Within UPLOAD_LIMIT and PIXEL_LIMIT; with `mask`, a PNG with the mask's alpha. `what`: the option, for
    messages."""
    path = os.fspath(path)
    if mask is not None:
        data = _masked_bytes(path, os.fspath(mask), what, mask_reading)
        suffix = ".png"
    else:
        data = _read(path, what)
        suffix = SUFFIXES[_open(path, data, what).format]
    with Image.open(io.BytesIO(data)) as picture:
        width, height = picture.size
    digest = hashlib.sha256(data).hexdigest()
    return Picture(path, f"flux2-{digest[:32]}{suffix}", digest, width, height, os.fspath(mask) if mask else None,
                   mask_reading)


def mask_alpha(mask: Image.Image, name: str = "the mask", reading: str = "auto") -> Image.Image:
    """The alpha Load Image reads the mask from (transparent = repaint): the engine's mask reading turned over."""
    reading = mask_levels(mask, name, reading)
    if reading.note:
        print(f"note: {reading.note}", file=sys.stderr)
    return Image.eval(reading.levels, lambda v: 255 - v)


def _masked_bytes(path: str, mask_path: str, what: str, reading: str = "auto") -> bytes:
    """PNG bytes, the same each time for the same two files."""
    # both upright, as Load Image turns a picture, before they are joined
    picture = decoded(_open(path, _read(path, what), what), f"{what}: {path}")
    mask = decoded(_open(mask_path, _read(mask_path, what), what), f"{what}: {mask_path}")
    if mask.size != picture.size:
        raise Flux2Error(f"{what}: the mask {mask_path} is {mask.width}x{mask.height} pixels and the picture {path} "
                         f"{picture.width}x{picture.height}; a mask must be the size of its picture")
    joined = picture.convert("RGB")
    joined.putalpha(mask_alpha(mask, f"{what}: the mask {mask_path}", reading))
    out = io.BytesIO()
    joined.save(out, "PNG")
    return out.getvalue()


def parse_upload(server: str, body: bytes) -> str:
    """{"name", "subfolder", "type": "input"} -> Load Image's input ("subfolder/name" in a subfolder)."""
    answer = parse_json(server, "the answer to POST /upload/image", body)
    name = answer.get("name") if isinstance(answer, dict) else None
    subfolder = answer.get("subfolder", "") if isinstance(answer, dict) else None
    if not (isinstance(name, str) and isinstance(subfolder, str) and answer.get("type", "input") == "input"):
        raise ServerError(server, f'the answer to POST /upload/image is not {{"name", "subfolder", "type": "input"}}'
                                  f": {shown(body)}")
    parts = [p for p in subfolder.replace("\\", "/").split("/") if p] + [name]
    if (not name or any(p in (".", "..") or "/" in p or "\\" in p or not p.isprintable() for p in parts)
            or len(name) > 255):
        raise ServerError(server, f"the answer to POST /upload/image names no usable file: {shown(body)}")
    return "/".join(parts)


def upload(client: ComfyClient, picture: Picture) -> str:
    what, status, body = client.post_file("/upload/image", "image", picture.name, picture.data(),
                                          {"type": "input", "overwrite": "false"})
    if status == 413:
        raise ServerError(client.server, f"{what} refused {picture.path} as too large (HTTP 413); start ComfyUI with "
                                         "a larger --max-upload-size, or send a smaller picture")
    if status != 200:
        raise ServerError(client.server, f"{what} refused {picture.path} (HTTP {status}): {shown(body)}; is it a "
                                         "picture ComfyUI reads, and does its input folder take new files?")
    return parse_upload(client.server, body)


def set_picture(workflow: dict, node: str, name: str, what: str) -> None:
    check_picture_node(workflow, node, what)
    workflow[node]["inputs"]["image"] = name


def check_picture_node(workflow: dict, node: str, what: str) -> None:
    if node not in workflow:
        raise Flux2Error(f"{what}: the workflow has no node {node!r}; its Load Image nodes are "
                         f"{image_nodes(workflow) or 'none'}")
    if not isinstance(workflow[node]["inputs"].get("image"), str):
        raise Flux2Error(f"{what}: node {node} ({workflow[node]['class_type']}) has no image file input; its Load "
                         f"Image nodes are {image_nodes(workflow) or 'none'}")


def image_nodes(workflow: dict) -> list[str]:
    return [nid for nid, node in workflow.items() if isinstance(node["inputs"].get("image"), str)]


def parse_pairs(items, option: str) -> dict[str, str]:
    pairs = {}
    for item in items:
        node, eq, path = str(item).partition("=")
        if not eq or not node or not path:
            raise Flux2Error(f"{option} {item!r} is not NODE=PATH (e.g. {option} 10=photo.png, 10 being the id of a "
                             "Load Image node in the API workflow)")
        if node in pairs:
            raise Flux2Error(f"{option} names node {node} twice ({pairs[node]} and {path}); give one file a node")
        pairs[node] = path
    return pairs


def plan_pictures(workflow: dict, images: dict[str, str], masks: dict[str, str], where: str = "",
                  mask_reading: str = "auto") -> dict:
    """{node: Picture}, all checked before anything is uploaded; `where` prefixes messages (a batch line)."""
    pictures = {}
    for node, mask in masks.items():
        if node not in images:
            raise Flux2Error(f"{where}--mask {node}={mask} needs --image {node}=PATH too: a mask is the alpha of the "
                             "picture that node loads")
    for node, path in images.items():
        what = f"{where}--image {node}={path}"
        check_picture_node(workflow, node, what)
        pictures[node] = read_picture(path, what, masks.get(node), mask_reading)
    return pictures
