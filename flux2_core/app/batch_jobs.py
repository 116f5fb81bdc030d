"""The jobs of a batch (no network): ``BatchJob``s read from a JSON Lines file (``read_batch``: one a line, {"prompt",
"seed", "size", "images", "masks", "set", "id"}) and planned against the workflow (``plan_jobs``: every input
checked and picture read before anything is queued, each job keyed by what it sends, so a re-run can skip it).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..checks import parse_number
from ..errors import Flux2Error
from ..listing import bounded_notes
from .queue_client import apply_overrides, parse_value, shown
from .uploads import Picture, plan_pictures, set_picture

KEYS = ("id", "prompt", "seed", "size", "images", "masks", "set")
EXAMPLE = '{"prompt": "a red fox", "seed": 1, "size": "768x1024", "images": {"10": "photo.png"}}'
ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
MAX_SEED = 2 ** 64 - 1           # ComfyUI's seed inputs take 0 to 2^64 - 1
MAX_ERRORS = 20                  # bad lines listed in one message


@dataclass
class BatchJob:
    """Every field is optional; `sets` maps "NODE.INPUT" to a value."""

    prompt: str | None = None
    seed: int | None = None
    size: tuple[int, int] | None = None              # width, height: set on every node with both inputs
    images: dict[str, str] = field(default_factory=dict)     # Load Image node -> a picture on this machine
    masks: dict[str, str] = field(default_factory=dict)      # Load Image node -> a mask for its picture
    sets: dict[str, object] = field(default_factory=dict)
    id: str | None = None                            # names its files; default: its place in the batch (0001)
    source: str = ""                                 # where it came from, for messages ("jobs.jsonl line 3")


@dataclass
class PlannedJob:
    """`key`: a hash of the prompt it sends, pictures by content."""

    job: BatchJob
    id: str
    key: str
    pictures: dict[str, Picture]

    @property
    def where(self) -> str:
        return f"job {self.id}" + (f" ({self.job.source})" if self.job.source else "")

    def workflow(self, base: dict, names: dict[str, str] | None = None) -> dict:
        """`names` {node: name}: the pictures as the server named them (default: as uploaded)."""
        return resolve(base, self.job, self.pictures, names)


def quoted(value) -> str:
    """A value of the user's as JSON writes it (strings in quotes), cut short."""
    try:
        return shown(json.dumps(value, ensure_ascii=False), 60)
    except (TypeError, ValueError):
        return shown(repr(value), 60)


def parse_size(value, where: str) -> tuple[int, int]:
    if isinstance(value, str) and re.fullmatch(r"[0-9]{1,5}x[0-9]{1,5}", value):
        value = [parse_number(v, f'{where}: "size"', whole=True) for v in value.split("x")]
    if not (isinstance(value, (list, tuple)) and len(value) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and 16 <= v <= 16384 for v in value)):
        raise Flux2Error(f'{where}: "size" {quoted(value)} is not WIDTHxHEIGHT (e.g. "768x1024", each 16 to 16384)')
    return value[0], value[1]


def job_from_line(value, where: str, folder: Path) -> BatchJob:
    """One parsed line -> a BatchJob; picture paths relative to `folder` (the batch file's)."""
    if not isinstance(value, dict):
        raise Flux2Error(f"{where} is not a JSON object; each line is one job, e.g. {EXAMPLE}")
    unknown = sorted(set(value) - set(KEYS))
    if unknown:
        raise Flux2Error(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; a job has {', '.join(KEYS)}")
    job = BatchJob(source=where)
    if value.get("prompt") is not None:
        if not isinstance(value["prompt"], str):
            raise Flux2Error(f'{where}: "prompt" must be a string')
        job.prompt = value["prompt"]
    if value.get("seed") is not None:
        if not isinstance(value["seed"], int) or isinstance(value["seed"], bool) or not 0 <= value["seed"] <= MAX_SEED:
            raise Flux2Error(f'{where}: "seed" {quoted(value["seed"])} must be a whole number from 0 to 2^64-1')
        job.seed = value["seed"]
    if value.get("size") is not None:
        job.size = parse_size(value["size"], where)
    for key in ("images", "masks"):
        files = value.get(key) or {}
        if not (isinstance(files, dict) and all(isinstance(p, str) and p for p in files.values())):
            raise Flux2Error(f'{where}: "{key}" must map node ids to file paths, e.g. {{"10": "photo.png"}}')
        setattr(job, key, {str(node): str(folder / path) for node, path in files.items()})
    sets = value.get("set") or {}
    if isinstance(sets, list):
        sets = parse_sets(sets, f'{where}: "set"')          # the --set form: ["6.steps=8"], read as --set is
    if not isinstance(sets, dict):
        raise Flux2Error(f'{where}: "set" must be {{"NODE.INPUT": value}} (e.g. {{"6.steps": 8}}) or a list of '
                         '"NODE.INPUT=VALUE"')
    job.sets = dict(sets)
    if value.get("id") is not None:
        job.id = value["id"]
    return job


def parse_sets(items, where: str) -> dict[str, object]:
    """NODE.INPUT=VALUE items (--set, a line's "set") -> {"NODE.INPUT": value}, JSON where it parses (8 a number)."""
    sets = {}
    for item in items:
        target, eq, value = item.partition("=") if isinstance(item, str) else ("", "", "")
        if not eq or "." not in target:
            raise Flux2Error(f"{where} {quoted(item)} is not NODE.INPUT=VALUE (e.g. 6.steps=8)")
        sets[target] = parse_value(value)
    return sets


def read_batch(path: str) -> list[BatchJob]:
    """Blank lines and # lines are skipped; every bad line is listed in one Flux2Error."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise Flux2Error(f"--batch {path}: cannot read it ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise Flux2Error(f"--batch {path} is not UTF-8 text; it should hold one JSON job a line") from None
    jobs, errors, folder = [], [], Path(path).parent
    for number, line in enumerate(lines, start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"{path} line {number}"
        try:
            try:
                value = json.loads(line)
            except (ValueError, RecursionError) as e:
                raise Flux2Error(f"{where} is not JSON ({shown(str(e), 80)}): {shown(line, 80)}; each line is one "
                                 f"job, e.g. {EXAMPLE}") from None
            jobs.append(job_from_line(value, where, folder))
        except Flux2Error as e:
            errors.append(str(e))
    if errors:
        raise Flux2Error(errors_message(errors))
    if not jobs:
        raise Flux2Error(f"--batch {path} holds no job; write one JSON object a line, e.g. {EXAMPLE}")
    return jobs


def errors_message(errors: list[str]) -> str:
    return (f"{len(errors)} job(s) of the batch are wrong; nothing was queued:\n  "
            + "\n  ".join(bounded_notes(errors, "wrong jobs", MAX_ERRORS))) if len(errors) > 1 else errors[0]


def resolve(base: dict, job: BatchJob, pictures: dict[str, Picture], names: dict[str, str] | None = None) -> dict:
    where = f"{job.source}: " if job.source else ""
    try:
        workflow = apply_overrides(base, (), job.prompt, job.seed)
    except Flux2Error as e:
        raise Flux2Error(f"{where}{e}") from None
    if job.size is not None:
        nodes = [n for n in workflow.values() if all(isinstance(n["inputs"].get(k), int) for k in ("width", "height"))]
        if not nodes:
            raise Flux2Error(f'{where}"size": the workflow has no node with width and height inputs; use "set"')
        for node in nodes:
            node["inputs"]["width"], node["inputs"]["height"] = job.size
    for target, value in job.sets.items():
        nid, dot, name = str(target).partition(".")
        if not dot or not name:
            raise Flux2Error(f"{where}set {shown(target, 60)} is not NODE.INPUT (e.g. 6.steps)")
        if nid not in workflow:
            raise Flux2Error(f"{where}set {shown(target, 60)}: the workflow has no node {shown(nid, 40)}; its nodes "
                             f"are {', '.join(sorted(workflow, key=_order))}")
        inputs = workflow[nid]["inputs"]
        if name not in inputs:
            raise Flux2Error(f"{where}set {shown(target, 60)}: node {nid} ({workflow[nid]['class_type']}) has no "
                             f"input {shown(name, 40)}; its inputs are {', '.join(sorted(inputs))}")
        inputs[name] = value
    for node, picture in pictures.items():
        set_picture(workflow, node, (names or {}).get(node, picture.name), f"{where}--image {node}")
    return workflow


def _order(nid: str):
    return (0, int(nid), "") if nid.isdigit() else (1, 0, nid)


def job_key(workflow: dict) -> str:
    return hashlib.sha256(json.dumps(workflow, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:24]


def plan_jobs(base: dict, jobs: list[BatchJob], images: dict[str, str] | None = None,
              masks: dict[str, str] | None = None, mask_reading: str = "auto") -> list[PlannedJob]:
    """`images` / `masks`: pictures for every job (a job's own replace them node by node); each file is read once,
    ids are checked unique, and all the bad jobs are listed in one Flux2Error."""
    planned, errors, ids, keys, seen = [], [], {}, {}, {}
    for number, job in enumerate(jobs, start=1):
        where = f"{job.source}: " if job.source else (f"job {number}: " if len(jobs) > 1 else "")
        try:
            files = {**(images or {}), **job.images}
            masked = {**(masks or {}), **job.masks}
            cache_key = tuple(sorted((n, p, masked.get(n)) for n, p in files.items()))
            pictures = seen.get(cache_key)
            if pictures is None:
                pictures = seen[cache_key] = plan_pictures(base, files, masked, where, mask_reading)
            job_id = job.id if job.id is not None else f"{number:04d}"
            if not (isinstance(job_id, str) and ID.fullmatch(job_id)):
                raise Flux2Error(f'{where}"id" {quoted(job_id)} must be 1 to 100 letters, digits, ".", "_" or "-" '
                                 "(it names the job's files)")
            if job_id in ids:
                raise Flux2Error(f'{where}"id" {job_id} is also the id of {ids[job_id]}; two jobs would write the '
                                 "same files")
            key = job_key(resolve(base, job, pictures))
            if key in keys:
                raise Flux2Error(f"{where}the same job as {keys[key]} (the same workflow, prompt, seed and pictures): "
                                 "it would make the same images; drop it or give it another seed")
            ids[job_id] = keys[key] = job.source or f"job {number}"
            planned.append(PlannedJob(job, job_id, key, pictures))
        except Flux2Error as e:
            errors.append(str(e))
    if errors:
        raise Flux2Error(errors_message(errors))
    return planned
