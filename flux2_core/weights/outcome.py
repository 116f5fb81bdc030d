"""What a storage option (fp8, int8) does to a transformer file's layers. Layers a file already stores quantized stay
as stored, so an option may change nothing: the line says so rather than let the user believe it took effect."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class StorageOutcome:
    option: str                  # as the line names it: "int8", "int8 ConvRot", "fp8"
    quantized: int               # block layers the option quantized as they loaded
    kept: dict[str, int]         # the file's format -> block layers left as the file stores them
    already: int = 0             # of those, layers the file stores as the option would have (int8 ConvRot in ConvRot)

    def line(self) -> str:
        kept = sum(self.kept.values())
        formats = ", ".join(f"{fmt}: {n}" for fmt, n in self.kept.items())
        if not self.quantized:
            said = (f"{self.option} changes nothing here: the file already stores all {kept} block layers quantized "
                    f"({formats}), and they stay as stored")
            if self.already == kept:                      # fp8 over an fp8 file, int8 over int8: what was asked
                return f"{said}, already in {self.option}"
            return f"{said}; leave the option out, or load the file's bf16 release to have them in {self.option}"
        done = f"{self.option}: {self.quantized} block layers quantized at load"
        return f"{done}; {kept} kept as the file stores them ({formats})" if kept else done


def tally(option: str, made: str, chosen: dict[str, str], quantizable: Callable[[str], bool],
          stored_as: Callable[[str], str | None], as_asked: Callable[[str], bool]) -> StorageOutcome:
    """``made``: the storage the option makes; ``chosen``: the storage each linear got; ``stored_as``: the file's
    format of a layer (None: float); ``as_asked``: the file already stores it as the option would."""
    quantized, kept, already = 0, {}, 0
    for name, how in chosen.items():
        if not quantizable(name):
            continue
        if how == made and not as_asked(name):
            quantized += 1
        else:
            file_format = stored_as(name) or "float"
            kept[file_format] = kept.get(file_format, 0) + 1
            already += as_asked(name)
    return StorageOutcome(option, quantized, kept, already)
