"""The engine's layout (docs/architecture.md): each package imports only from the packages below it, lazy imports
inside functions included, and no module reaches itself again through its module-level imports."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "flux2_core"

# lowest first; a top-level file is its own layer: the base modules, then pipeline.py (the public API)
LAYERS = [
    {"errors"}, {"variants", "prompt_padding", "checks", "user_json", "latents", "digests", "kitchen", "devices", "key_tables",
                 "listing"}, {"storage"}, {"models"}, {"families"}, {"weights"},
    {"adapters"}, {"runtime"}, {"sampling"}, {"upsampler"}, {"stages"}, {"pipeline"}, {"app", "__main__", "__init__"},
]


def layer_of(module: str) -> int:
    """``module``: dotted below flux2_core ("models.transformer", "errors", "" for the package itself)."""
    head = module.split(".")[0] or "__init__"
    layer = next((i for i, names in enumerate(LAYERS) if head in names), None)
    assert layer is not None, f"flux2_core.{module} is in no layer: add {head!r} to LAYERS and to docs/architecture.md"
    return layer


def module_of(path: Path, core: Path = CORE) -> str:
    parts = path.relative_to(core).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def imports(path: Path, top_level_only: bool = False, core: Path = CORE) -> set[str]:
    """The flux2_core modules ``path`` imports (a package's own name where a name is not a module)."""
    module, is_package = module_of(path, core), path.name == "__init__.py"
    body = ast.parse(path.read_text()).body if top_level_only else list(ast.walk(ast.parse(path.read_text())))
    found = set()
    for node in body:
        if isinstance(node, ast.ImportFrom) and node.level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = [p for p in base[:len(base) - node.level + 1] if p and p != "__init__"]
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{target}.{alias.name}" if target else alias.name
                where = core / sub.replace(".", "/")
                is_module = where.with_suffix(".py").exists() or where.is_dir()
                found.add(sub if is_module else target)
    return found


def test_every_module_has_a_layer():
    for path in CORE.rglob("*.py"):
        layer_of(module_of(path))


def test_no_package_imports_from_a_package_above_it():
    upward = []
    for path in sorted(CORE.rglob("*.py")):
        module = module_of(path)
        for target in imports(path):
            if layer_of(target) > layer_of(module):
                upward.append(f"{module} imports {target}")
    assert not upward, "imports running up the layers:\n" + "\n".join(upward)


def test_each_family_is_a_wing_of_its_own():
    """A family's package holds its network; no family imports another's package, and models/ (the pieces families
    share) imports none: what two families share lives below them."""
    crossing = {}
    for path in sorted(CORE.rglob("*.py")):
        module = module_of(path)
        parts = module.split(".")
        own = parts[1] if parts[0] == "families" and len(parts) > 1 and (CORE / "families" / parts[1]).is_dir() else None
        wings = {target.split(".")[1] for target in imports(path) if target.startswith("families.")
                 and len(target.split(".")) > 1 and (CORE / "families" / target.split(".")[1]).is_dir()}
        if (own is not None or parts[0] == "models") and wings - {own}:
            crossing[module] = sorted(wings - {own})
    assert not crossing, f"a family's (or a shared model's) module imports another family's package: {crossing}"
    assert (CORE / "families" / "flux2" / "transformer.py").exists()
    assert (CORE / "families" / "flux3" / "transformer.py").exists()


def test_no_import_cycles_between_modules():
    graph = {module_of(p): imports(p, top_level_only=True) for p in CORE.rglob("*.py")}
    state: dict[str, str] = {}

    def visit(module: str, trail: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                raise AssertionError("import cycle: " + " -> ".join([*trail, module, target]))
            if target not in state:
                visit(target, [*trail, module])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [])


def test_the_check_sees_a_lazy_upward_import(tmp_path):
    core = tmp_path / "flux2_core"
    (core / "storage").mkdir(parents=True)
    (core / "models").mkdir()
    (core / "models" / "transformer.py").write_text("")
    (core / "storage" / "bad.py").write_text("def f():\n    from ..models import transformer\n")
    assert imports(core / "storage" / "bad.py", core=core) == {"models.transformer"}
    assert imports(core / "storage" / "bad.py", top_level_only=True, core=core) == set()
    assert layer_of("models.transformer") > layer_of(module_of(core / "storage" / "bad.py", core))


# FLUX.2's module names: only its model and its family entry spell them, so that a second family meets none of them in
# the shared code (loaders, storage, memory, offload, sampling, nodes)
FLUX2_NAMES = re.compile(r"\b(img_in|txt_in|time_in|guidance_in|double_blocks|single_blocks|double_stream_modulation"
                         r"|single_stream_modulation|final_layer)\b")
FLUX2_HOME = {"flux2_core/families/flux2/transformer.py",
              *(p.relative_to(ROOT).as_posix() for p in (CORE / "families" / "flux2").rglob("*.py"))}
# another family's model and package spell its own modules, some of which BFL named as FLUX.2's (txt_in, single_blocks)
OWN_NAMES = {"flux2_core/families/flux3/transformer.py": "flux3",
             **{p.relative_to(ROOT).as_posix(): "flux3" for p in (CORE / "families" / "flux3").rglob("*.py")}}


def module_names(family: str) -> set[str]:
    """The top-level and block-list names of a family's model, read off the model built on the meta device."""
    import torch

    from flux2_core.families import get_family
    from flux2_core.models.layers import Layers

    entry = get_family(family)
    params = entry.variants[0].params
    with torch.device("meta"):
        model = entry.build(params, Layers())
    return {name.split(".")[0] for name, _ in model.named_parameters()}


def test_flux2_module_names_stay_in_the_flux2_model_and_its_family_entry():
    found = {}
    for path in sorted([*CORE.rglob("*.py"), *(ROOT / "nodes").rglob("*.py")]):
        name = path.relative_to(ROOT).as_posix()
        hits = set(FLUX2_NAMES.findall(path.read_text()))
        if name in OWN_NAMES:
            hits -= module_names(OWN_NAMES[name])
        hits = sorted(hits)
        if hits and name not in FLUX2_HOME:
            found[name] = hits
    assert not found, ("FLUX.2's module names outside its model and family entry (ask the model or its family "
                       f"instead): {found}")


# every fact of a stored format lives in its format object (flux2_core/storage/): the code around it asks the object,
# so no module elsewhere spells a name a file gives a format
FORMAT_HOME = "storage"


def docstrings(tree: ast.AST) -> set[int]:
    """The ids of the string constants that are a module's, class's or function's docstring."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value,
                                                                                                     str):
                found.add(id(first.value))
    return found


def format_names_outside_storage(names: set[str], core: Path = CORE) -> dict[str, list[str]]:
    """Module (relative to ``core``) -> the format names it holds as string constants (docstrings and comments
    aside), for every module outside ``core/storage``."""
    found = {}
    for path in sorted(core.rglob("*.py")):
        if path.relative_to(core).parts[0] == FORMAT_HOME:
            continue
        tree = ast.parse(path.read_text())
        skip = docstrings(tree)
        hits = sorted({node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
                       and isinstance(node.value, str) and node.value in names and id(node) not in skip})
        if hits:
            found[path.relative_to(core).as_posix()] = hits
    return found


def registered_names() -> set[str]:
    from flux2_core.storage import formats

    return {name for fmt in formats.formats() for name in fmt.names}


def test_no_stored_format_name_outside_storage():
    found = format_names_outside_storage(registered_names())
    assert not found, ("format names spelled outside flux2_core/storage/ (ask the format object instead: "
                       f"storage.formats): {found}")


def test_the_format_name_check_sees_a_literal_and_not_a_docstring(tmp_path):
    core = tmp_path / "flux2_core"
    (core / "storage").mkdir(parents=True)
    (core / "weights").mkdir()
    (core / "storage" / "own.py").write_text('NAME = "int8_tensorwise"\n')
    (core / "weights" / "told.py").write_text('def f():\n    """reads int8_tensorwise files"""\n    # "nvfp4"\n')
    (core / "weights" / "keyed.py").write_text('def f(fmt):\n    return fmt.name == "nvfp4"\n')
    names = registered_names()
    assert {"int8_tensorwise", "nvfp4"} <= names
    assert format_names_outside_storage(names, core) == {"weights/keyed.py": ["nvfp4"]}


# --- no family told apart by its name outside families/ ------------------------------------------------------------
# What the code around the models may not do: compare with, look up by or key on a family's name ("flux2"), its title
# ("FLUX.2"), a variant's name ("klein-4b") or title. Prose (messages, docstrings) may name them; only string constants
# in comparisons (==, !=, in, is; str.startswith / endswith), in subscripts (VARIANTS["klein-4b"]) and as dict keys
# count. Known places another engineer is turning into questions to the family record, each with its constants; the
# list only shrinks (a place that no longer tests a name must leave it).
KNOWN_NAME_TESTS: dict[str, set[str]] = {}
SCANNED = [CORE, ROOT / "nodes"]


def family_words() -> set[str]:
    from flux2_core.families import FAMILIES

    words = set()
    for family in FAMILIES.values():
        words |= {family.name, family.title, family.schedule_name}
        words |= {w for v in family.variants for w in (v.name, v.title) if w}
    return words


def name_tests(source: str, words: set[str]) -> list[tuple[int, str]]:
    """(line, constant) of each string in ``words`` that ``source`` compares with, subscripts by or keys a dict on."""
    found = []

    def constants(node: ast.AST) -> list[ast.Constant]:
        return [c for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)]

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            places = [node.left, *node.comparators]
        elif isinstance(node, ast.Subscript):
            places = [node.slice]
        elif isinstance(node, ast.Dict):
            places = [k for k in node.keys if k is not None]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("startswith", "endswith")):
            places = node.args
        else:
            continue
        found += [(c.lineno, c.value) for place in places for c in constants(place) if c.value in words]
    return found


def test_no_family_is_told_apart_by_its_name_outside_families():
    words = family_words()
    found, stale = {}, {}
    for path in sorted(p for root in SCANNED for p in root.rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        if name.startswith("flux2_core/families/"):
            continue
        hits = name_tests(path.read_text(), words)
        unknown = [(line, word) for line, word in hits if word not in KNOWN_NAME_TESTS.get(name, set())]
        if unknown:
            found[name] = unknown
        gone = KNOWN_NAME_TESTS.get(name, set()) - {word for _, word in hits}
        if gone:
            stale[name] = sorted(gone)
    assert not found, ("a family told apart by its name (ask its record instead; prose may name it): "
                       + "; ".join(f"{n}: {hits}" for n, hits in found.items()))
    assert not stale, f"KNOWN_NAME_TESTS lists names these files no longer test (drop them): {stale}"


def test_the_name_check_sees_comparisons_keys_and_prefixes_but_not_prose():
    words = {"flux2", "FLUX.2", "klein-4b"}
    source = """
def f(variant, table):
    \"\"\"FLUX.2 and klein-4b in prose.\"\"\"
    if variant.family == "flux2":
        raise ValueError("FLUX.2 is named here in a message, flux2 too")
    x = table["klein-4b"], {"FLUX.2": 1}, variant.name.startswith("flux2"), variant.title in ("FLUX.2", "other")
    return f"the {'FLUX.2'} model"
"""
    assert sorted(name_tests(source, words)) == [(4, "flux2"), (6, "FLUX.2"), (6, "FLUX.2"), (6, "flux2"),
                                                 (6, "klein-4b")]


# What differs between families is read where its rule lives: a family's record and model (families/, models/), and
# the one module that applies each of its data; everywhere else asks those (a flag read elsewhere is a second rule).
FLAG_HOMES = {
    "padded": {"flux2_core/sampling/references.py"},          # ReferenceFit: how references are sized
    "max_side": {"flux2_core/sampling/references.py"},
    "pad_min": {"flux2_core/sampling/references.py"},
    "takes_layout": {"flux2_core/sampling/request.py"},         # whether prompts may carry layout boxes
    "use_kv_cache": {"flux2_core/sampling/run.py", "flux2_core/variants.py"},   # references_as_kv, the one rule
    "pad_multiple": {"flux2_core/prompt_padding.py"},        # how prompts are padded
    "pad_position": {"flux2_core/prompt_padding.py"},
    "flow_map": set(),                                       # FLUX 3's distilled model: its family and model alone
    "latent_dtype": {"flux2_core/sampling/euler.py"},         # the latent between steps: the loop
}
FLAG_FREE = ("flux2_core/families/", "flux2_core/models/")


def flag_reads(source: str, flags: set[str]) -> list[tuple[int, str]]:
    """(line, attribute) of every read of an attribute named in ``flags``."""
    return sorted((node.lineno, node.attr) for node in ast.walk(ast.parse(source))
                  if isinstance(node, ast.Attribute) and node.attr in flags)


def test_no_family_flag_is_read_outside_its_home():
    found = {}
    for path in sorted(p for root in SCANNED for p in root.rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        if name.startswith(FLAG_FREE):
            continue
        hits = [(line, flag) for line, flag in flag_reads(path.read_text(), set(FLAG_HOMES))
                if name not in FLAG_HOMES[flag]]
        if hits:
            found[name] = hits
    assert not found, ("a family's flag read outside its home (ask the family, or the module that applies it): "
                       + "; ".join(f"{n}: {hits}" for n, hits in found.items()))


def test_the_flag_check_sees_an_attribute_read():
    source = "def f(family, fit):\n    return fit.padded or family.takes_layout or fit.padded_box\n"
    assert flag_reads(source, set(FLAG_HOMES)) == [(2, "padded"), (2, "takes_layout")]


def test_the_denoise_node_is_a_thin_adapter():
    """The Denoise node names at most six engine names: the run (``sampling.run``), the memory check, the
    reference K/V cache, parallel runs, the LoRAs for followers and the error type."""
    tree = ast.parse((ROOT / "nodes" / "denoise.py").read_text())
    names = [alias.asname or alias.name for node in tree.body if isinstance(node, ast.ImportFrom)
             and node.level == 2 and (node.module or "").startswith("flux2_core") for alias in node.names]
    assert 0 < len(names) <= 6, names
