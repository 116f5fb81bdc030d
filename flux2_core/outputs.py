"""Where images are written: the output folder, checked before any work starts, and new files that never replace
an existing one (the CLI's PNGs and the images the queue client downloads)."""

from __future__ import annotations

import itertools
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from .errors import Flux2Error


def check_folder(path: str, option: str = "--out") -> Path:
    """The output folder, proved usable (it exists and takes new files, or it can be created), else a Flux2Error
    saying why not. Nothing is created here: write_new makes the folder when the first image is ready.

    Called before models load or a prompt is queued, so a wrong --out costs seconds, not a whole generation.
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
    """Create folder/name (else name-1, name-2, ... before the extension) and fill it with ``write(file)``.

    Never replaces a file, whether it was there before or another process makes it meanwhile (see _claim). A file
    whose writing fails is removed. Returns the path written.
    """
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
    """A new file, open for writing: mode "xb" takes the name and creates the file in one step (O_EXCL), so there
    is no moment between a check and the write in which another file of that name could appear and be replaced."""
    stem, suffix = os.path.splitext(name)
    for n in itertools.count():
        path = folder / (name if n == 0 else f"{stem}-{n}{suffix}")
        try:
            return open(path, "xb"), path          # write_new's `with` closes it
        except FileExistsError:
            continue
