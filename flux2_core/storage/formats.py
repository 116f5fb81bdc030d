"""The registry of stored formats, by each name files give them. Formats are defined beside the classes that hold
them; a new one needs only ``register``. ``read_layer`` is the one entry for a file's spec of a layer.
"""

from __future__ import annotations

from ..errors import Flux2Error
from .int8 import INT8_FORMAT
from .orbitquant import ORBITQUANT_FORMAT, ORBITQUANT_INT4_FORMAT
from .packed import (
    FP8_BLOCKS_FORMAT,
    INT8_BLOCKS_FORMAT,
    MXFP8_FORMAT,
    NVFP4_FORMAT,
    NVFP4_PLAIN_FORMAT,
    W4A4_FORMAT,
)
from .quant import FP8_E4M3_FORMAT, FP8_E5M2_FORMAT
from .request import LayerStorage
from .stored_format import LayerFile, LayerFormat, StoredFormat
from .w4 import AWQ_FORMAT, SVDQUANT_FORMAT, W4A8_FORMAT

# name -> format; a format of several names is in it under each
STORED_FORMATS: dict[str, StoredFormat] = {}


def register(fmt: StoredFormat) -> StoredFormat:
    """Adds ``fmt`` under each of its names; a name another format has is refused (one name, one layout)."""
    taken = [n for n in fmt.names if STORED_FORMATS.get(n, fmt) is not fmt]
    if taken:
        raise ValueError(f"stored format names already registered for another format: {', '.join(taken)}")
    for name in fmt.names:
        STORED_FORMATS[name] = fmt
    return fmt


def unregister(fmt: StoredFormat) -> None:
    for name in fmt.names:
        if STORED_FORMATS.get(name) is fmt:
            del STORED_FORMATS[name]


for _format in (FP8_E4M3_FORMAT, FP8_E5M2_FORMAT, INT8_FORMAT, INT8_BLOCKS_FORMAT, FP8_BLOCKS_FORMAT, NVFP4_FORMAT,
                NVFP4_PLAIN_FORMAT, MXFP8_FORMAT, W4A4_FORMAT, W4A8_FORMAT, SVDQUANT_FORMAT, AWQ_FORMAT,
                ORBITQUANT_FORMAT, ORBITQUANT_INT4_FORMAT):
    register(_format)


def stored_format(name: object) -> StoredFormat | None:
    """The format files name ``name``; None for a name (or a value that is no name) no format has."""
    return STORED_FORMATS.get(name) if isinstance(name, str) else None


def formats() -> list[StoredFormat]:
    """Each registered format once, in the order registered."""
    return list(dict.fromkeys(STORED_FORMATS.values()))


def read_layer(file: LayerFile) -> LayerFormat:
    """A file's spec of one layer (``file.name``: the name it gives) -> its format, checked."""
    fmt = stored_format(file.name)
    if fmt is None:
        raise Flux2Error(f"{file.where} uses the quantisation format {file.show(file.name)}, which cannot be loaded "
                         f"here; supported are bf16/fp16/fp32 files and these formats: "
                         f"{', '.join(sorted(STORED_FORMATS))}")
    if file.spec.get("convrot") and not fmt.rotates:
        titles = list(dict.fromkeys(f.title for f in formats() if f.rotates))
        turned = " and ".join([", ".join(titles[:-1]), titles[-1]] if len(titles) > 1 else titles)
        raise Flux2Error(f"{file.where} is {file.name} with ConvRot, which this pack runs for {turned} only")
    return fmt.layer(file)


def known_by() -> dict[str, StoredFormat]:
    """Tensor name -> the format it marks in files that name no format."""
    return {f.known_by: f for f in formats() if f.known_by}


# the storage kind of a layer kept in the format its file stores it in (any registered one)
STORED = LayerStorage("stored", lambda request, name: request.file.stored_format(name + ".weight"),
                      lambda i, o, per_item, fmt: fmt.linear(i, o, per_item))
