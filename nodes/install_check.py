"""What the pack needs from ComfyUI's Python before it can load, said plainly when something is missing.

ComfyUI-Manager and the registry install ``requirements.txt`` into ComfyUI's environment; a manual clone, a failed
install or an old ComfyUI leaves the pack without a package it imports. Python would stop at the first missing
import with a bare ``ModuleNotFoundError`` deep in a traceback; this check runs first and names every missing or
too-old package, the ComfyUI version needed, and the command that fixes it. Only the standard library (and
``packaging`` where present) is used, so the check itself cannot fail for lack of a package.

    problems = install_problems(pack_dir)       # [] when everything is in place
"""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

MIN_COMFYUI = (0, 12, 0)         # the first release with FLUX.2 Klein and the V3 node API we use (pyproject: requires-comfyui)
PACK_NAME = "Klein Engine (FLUX.2 Klein, FLUX 3 Image Klein)"


def read_requirements(path: Path) -> list[str]:
    """The requirement lines of a requirements.txt (comments, blank lines and pip options such as -r dropped)."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text(encoding="utf-8").splitlines())
    return [line for line in lines if line and not line.startswith("-")]


def requirement_problem(line: str) -> str | None:
    """Why the installed distributions do not satisfy one requirement line, or None when they do."""
    try:
        from packaging.requirements import Requirement
    except ImportError:                               # no packaging: check presence only
        name, specifier = re.match(r"[A-Za-z0-9._-]+", line).group(0), None
    else:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate():
            return None                               # not for this platform / Python
        name, specifier = requirement.name, requirement.specifier
    try:
        installed = metadata.version(name)
    except metadata.PackageNotFoundError:
        return f"{line} (not installed)"
    if specifier is not None and not specifier.contains(installed, prereleases=True):
        return f"{line} ({installed} is installed)"
    return None


def comfyui_version() -> tuple[int, ...] | None:
    """The running ComfyUI's version from its comfyui_version module, None outside ComfyUI or when unreadable."""
    try:
        from comfyui_version import __version__
    except ImportError:
        return None
    numbers = re.findall(r"\d+", __version__)[:3]
    return tuple(int(n) for n in numbers) if numbers else None


def install_problems(pack_dir: Path) -> list[str]:
    """One line per problem: each unmet requirement of ``requirements.txt``, and a ComfyUI older than MIN_COMFYUI."""
    problems = [p for p in map(requirement_problem, read_requirements(pack_dir / "requirements.txt")) if p]
    version = comfyui_version()
    if version is not None and version < MIN_COMFYUI:
        needed, found = ".".join(map(str, MIN_COMFYUI)), ".".join(map(str, version))
        problems.append(f"ComfyUI {needed} or newer (this is {found}): update ComfyUI (Manager: 'Update ComfyUI', "
                        "or git pull in the ComfyUI folder)")
    return problems


def problems_message(pack_dir: Path, problems: list[str]) -> str:
    """What ComfyUI's log shows when the pack cannot load: every problem and how to fix it."""
    listed = "\n".join(f"  - {p}" for p in problems)
    return (f"{PACK_NAME} cannot load; it needs:\n{listed}\n"
            f"Install the packages into the Python that runs ComfyUI, then restart ComfyUI:\n"
            f"  {sys.executable} -m pip install -r {pack_dir / 'requirements.txt'}\n"
            f"(ComfyUI-Manager does this when you install the pack from it or press 'Try fix'.)")
