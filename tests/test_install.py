"""Installing the pack as ComfyUI users do: requirements.txt, registry metadata, and the message of a pack that
cannot load. (The install itself, into a bare ComfyUI environment, is tests/comfyui/test_manager_install.py.)"""

from __future__ import annotations

import ast
import subprocess
import sys
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

from nodes import install_check

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# ComfyUI installs and pins these (comfy-kitchen: its kernel library); the pack must not
HOST_OWNED = {"torch", "comfyui-frontend-package", "comfy-kitchen"}
# modules the ComfyUI process provides: its own source tree and torch. (aiohttp is ComfyUI's too, but the queue
# client imports it outside ComfyUI, so requirements.txt names it and the import check below covers it.)
HOST_MODULES = {"comfy", "comfy_api", "comfy_extras", "server", "folder_paths", "latent_preview", "node_helpers",
                "comfyui_version", "torch"}


def names(lines) -> dict[str, str]:
    return {Requirement(line).name.lower(): str(Requirement(line).specifier) for line in lines}


def test_requirements_txt_is_pyproject_without_what_comfyui_owns():
    required = names(install_check.read_requirements(ROOT / "requirements.txt"))
    declared = names(PYPROJECT["project"]["dependencies"])
    assert not HOST_OWNED & set(required), "requirements.txt must not install torch or the frontend (ComfyUI's own)"
    assert required == {k: v for k, v in declared.items() if k not in HOST_OWNED}


def optional_imports(tree: ast.AST) -> set[ast.AST]:
    """The import statements of ``tree`` inside a ``try`` that handles ImportError (used where installed, e.g. psutil
    and tqdm): not requirements."""
    guarded = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
                h.type is not None and {n.id for n in ast.walk(h.type) if isinstance(n, ast.Name)}
                & {"ImportError", "ModuleNotFoundError"} for h in node.handlers):
            guarded |= {n for stmt in node.body for n in ast.walk(stmt) if isinstance(n, ast.Import | ast.ImportFrom)}
    return guarded


def third_party_imports(optional: bool = False) -> dict[str, set[str]]:
    """Top-level modules imported anywhere in the pack's code (engine, nodes, entry point) -> the files importing them,
    stdlib and relative imports left out; only the ones ``optional_imports`` finds with ``optional``, else the others."""
    found: dict[str, set[str]] = {}
    files = [ROOT / "__init__.py", *sorted((ROOT / "flux2_core").rglob("*.py")), *sorted((ROOT / "nodes").glob("*.py"))]
    for path in files:
        tree = ast.parse(path.read_text())
        guarded = optional_imports(tree)
        for node in ast.walk(tree):
            if (node in guarded) != optional:
                continue
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top not in sys.stdlib_module_names and top != "__future__":
                    found.setdefault(top, set()).add(path.name)
    return found


def test_every_import_of_the_pack_is_installed_by_requirements_or_comes_with_comfyui():
    required = set(names(install_check.read_requirements(ROOT / "requirements.txt")))
    distributions = metadata.packages_distributions()              # module -> distributions providing it (this venv)
    # what the required distributions pull in themselves (transformers -> huggingface_hub, packaging, ...)
    installed_by_them = set(required)
    for name in required:
        installed_by_them |= {Requirement(r).name.lower() for r in metadata.requires(name) or []
                              if "extra ==" not in r}
    imports = third_party_imports()
    assert {"torch", "safetensors", "einops", "numpy", "PIL", "comfy_api"} <= set(imports)   # the scan sees them
    unmet = {module: sorted(files) for module, files in imports.items() if module not in HOST_MODULES
             and not {d.lower() for d in distributions.get(module, [])} & installed_by_them}
    assert not unmet, f"imported by the pack but not installed by requirements.txt: {unmet}"
    # imported only where installed, with a fallback (checks.available_memory: psutil, else /proc/meminfo)
    assert "psutil" in third_party_imports(optional=True) and "psutil" not in imports


def test_install_check_passes_here_and_names_what_is_missing_or_too_old(tmp_path):
    assert install_check.install_problems(ROOT) == []                # this venv has every requirement
    (tmp_path / "requirements.txt").write_text("# comment\nnumpy>=1.0  # fine\nnot-a-real-package-xyz>=1\n"
                                               "einops>=999\n-r other.txt\n"
                                               "also-not-real; sys_platform == 'nonexistent-os'\n")
    problems = install_check.install_problems(tmp_path)
    assert problems == ["not-a-real-package-xyz>=1 (not installed)",
                        f"einops>=999 ({metadata.version('einops')} is installed)"]
    message = install_check.problems_message(tmp_path, problems)
    assert "not-a-real-package-xyz" in message and "einops>=999" in message
    assert f"{sys.executable} -m pip install -r {tmp_path / 'requirements.txt'}" in message


@pytest.mark.parametrize("version, too_old", [("0.3.40", True), ("0.11.9", True), ("0.12.0", False),
                                              ("0.12.1", False), ("1.0.0", False)])
def test_install_check_refuses_a_comfyui_older_than_pyproject_requires(tmp_path, monkeypatch, version, too_old):
    floor = PYPROJECT["tool"]["comfy"]["requires-comfyui"].removeprefix(">=")
    assert ".".join(map(str, install_check.MIN_COMFYUI)) == floor
    module = type(sys)("comfyui_version")
    module.__version__ = version
    monkeypatch.setitem(sys.modules, "comfyui_version", module)
    (tmp_path / "requirements.txt").write_text("numpy\n")
    problems = install_check.install_problems(tmp_path)
    assert bool(problems) == too_old
    if too_old:
        assert f"ComfyUI {floor} or newer (this is {version})" in problems[0]


def test_registry_metadata_is_complete_for_the_registrys_own_parser(monkeypatch):
    parser = pytest.importorskip("comfy_cli.registry.config_parser", reason="comfy-cli (test extra) is not installed")
    config = parser.extract_node_configuration(str(ROOT / "pyproject.toml"))
    project, comfy = config.project, config.tool_comfy
    assert project.name == PYPROJECT["project"]["name"] and project.version and project.description
    assert project.license.text == "Apache-2.0" and (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")
    assert project.urls.repository.startswith("https://github.com/")
    assert project.supported_comfyui_version == ">=0.12.0" and project.supported_comfyui_frontend_version
    assert comfy.publisher_id and comfy.display_name
    assert sorted(comfy.includes) == ["web", "workflows"] and all((ROOT / d).is_dir() for d in comfy.includes)
    # the icon is a file of this repository, served from its main branch, within the registry's 800x400 limit
    prefix = project.urls.repository.replace("https://github.com/", "https://raw.githubusercontent.com/") + "/main/"
    assert comfy.icon.startswith(prefix)
    icon = ROOT / comfy.icon.removeprefix(prefix)
    svg = ET.parse(icon).getroot()
    assert svg.tag.endswith("svg") and int(svg.get("width")) <= 800 and int(svg.get("height")) <= 400


def test_comfy_node_validate_passes_without_warnings():
    comfy = Path(sys.executable).parent / "comfy"
    if not comfy.exists():
        pytest.skip("comfy-cli (test extra) is not installed")
    result = subprocess.run([str(comfy), "--skip-prompt", "--no-enable-telemetry", "node", "validate"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "All validation checks passed" in output and "Warning" not in output and "Error" not in output, output


@pytest.mark.slow
def test_the_engine_wheel_holds_every_package_of_the_engine(tmp_path):
    """pip install of the engine (the CLI without ComfyUI) gets every subpackage, not only flux2_core's own files."""
    import zipfile

    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(ROOT)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("*.whl")
    packed = {name.rsplit("/", 1)[0] for name in zipfile.ZipFile(wheel).namelist() if name.endswith("/__init__.py")}
    on_disk = {str(p.parent.relative_to(ROOT)) for p in (ROOT / "flux2_core").rglob("__init__.py")}
    assert packed == on_disk and {"flux2_core/weights", "flux2_core/storage"} <= packed
