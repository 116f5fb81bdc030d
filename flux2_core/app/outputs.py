"""Where images are written: the output folder, checked before any work starts, and new files that never replace
an existing one (the CLI's PNGs and the images the queue client downloads)."""

from __future__ import annotations

import io
import itertools
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from PIL import Image

from ..errors import Flux2Error

PICTURE_ERRORS = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)


def check_folder(path: str, option: str = "--out") -> Path:
    """Proved usable (it takes new files, or can be created), but nothing is created here; called before models load
    or a prompt is queued, so a wrong --out costs seconds, not a generation.
    """
    folder = existing = Path(path).expanduser()
    try:
        while not existing.exists() and existing != existing.parent:     # where the missing folders would be made
            existing = existing.parent
        if existing.is_dir():
            # Creating a file is the one sure test: permission bits, read-only mounts and ACLs all show up here.
            with tempfile.TemporaryFile(dir=existing):
                pass
            return folder
    except OSError as e:
        what = "write there" if existing == folder else f"create it in {existing}"
        raise Flux2Error(f"{option} {path}: cannot {what} ({e.strerror or e}); choose a folder you can "
                         "write to") from None
    where = "" if existing == folder else f" ({existing} is a file)"
    raise Flux2Error(f"{option} {path} is a file, not a folder{where}; give a folder for the images "
                     "(it is created if missing)")


def write_new(folder: Path, name: str, write: Callable[[BinaryIO], object]) -> Path:
    """Never replaces a file (name-1, name-2, ... instead); a file whose writing fails is removed."""
    try:
        folder.mkdir(parents=True, exist_ok=True)        # made with the first image (check_folder made nothing)
        file, path = _claim(folder, name)
        try:
            with file:
                write(file)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
    except OSError as e:
        raise Flux2Error(f"cannot write {folder / name}: {e.strerror or e}; check the free space and the "
                         "folder's permissions") from None
    return path


def _claim(folder: Path, name: str) -> tuple[BinaryIO, Path]:
    """Mode "xb" (O_EXCL) takes the name and creates the file in one step: no race with another writer."""
    stem, suffix = os.path.splitext(name)
    for n in itertools.count():
        path = folder / (name if n == 0 else f"{stem}-{n}{suffix}")
        try:
            return open(path, "xb"), path          # write_new's `with` closes it
        except FileExistsError:
            continue


def picture_format(data: bytes) -> str:
    """The format of a whole picture (PIL's name: "PNG"), or one of PICTURE_ERRORS: its chunks checked to the end
    (PNG's CRCs and IEND) and its pixels decoded to the last, so a file cut anywhere is caught."""
    with Image.open(io.BytesIO(data)) as picture:
        found = picture.format
        picture.verify()
    with Image.open(io.BytesIO(data)) as picture:
        picture.load()
    return found
