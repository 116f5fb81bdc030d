"""Small real pictures for tests that pass images around (a fake ComfyUI's /view answers)."""

from __future__ import annotations

import io

from PIL import Image, PngImagePlugin


def png_bytes(label: str) -> bytes:
    """A 2x2 PNG whose text chunk holds ``label``, so that two of them differ and each says which it is."""
    info = PngImagePlugin.PngInfo()
    info.add_text("label", label)
    out = io.BytesIO()
    Image.new("RGB", (2, 2), (10, 20, 30)).save(out, "PNG", pnginfo=info)
    return out.getvalue()
