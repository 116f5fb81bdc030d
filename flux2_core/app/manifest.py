"""A batch's output folder: its jobs' images and manifest.json, the record of what each job did.

Nothing half-written carries a real name: files are written under a temp name and renamed once whole; image names
are claimed with a hard link (or O_EXCL), which never replaces a file. A lock keeps two batches apart.
manifest.json may be damaged or edited: a record is used only as ``JobRecord.read`` finds it, and an image only while
its bytes hash as recorded.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import tempfile
import threading
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from ..errors import Flux2Error
from .outputs import PICTURE_ERRORS, check_folder, picture_format

try:
    import fcntl
except ImportError:              # Windows: no lock, and stale temp files are left for the user
    fcntl = None

NAME = "manifest.json"
FORMAT = "flux2-klein batch manifest 1"
TEMP = ".flux2-batch-"           # prefix of every temp file a batch writes in its folder
LOCK = ".flux2-batch.lock"
FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}", re.ASCII)    # what a published image may be named
SUFFIX = re.compile(r"\.[A-Za-z0-9]{1,16}", re.ASCII)
STATUSES = ("done", "failed")


def folder_name(name) -> bool:
    """A name the manifest may give a file: one plain name in the folder, so a record can reach nothing outside it."""
    return isinstance(name, str) and bool(FILE_NAME.fullmatch(name)) and name != NAME


def image_suffix(name: str) -> str:
    """How a published image's name ends: the server's own suffix (".png", ".webp") where it is a plain one."""
    suffix = os.path.splitext(name)[1]
    return suffix if SUFFIX.fullmatch(suffix) else ".png"


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class JobRecord:
    """`files`: names in the folder, in save order; `digests`: the SHA-256 of each (empty in older records)."""

    id: str
    key: str                     # batch_jobs.job_key: the same key means the same job
    status: str                  # "done" or "failed"
    files: list[str] = field(default_factory=list)
    server: str = ""
    error: str = ""
    seconds: float = 0.0
    source: str = ""
    digests: list[str] = field(default_factory=list)

    @classmethod
    def read(cls, value) -> JobRecord | None:
        """A record as manifest.json holds it, or None where this client could not have written it (run it again)."""
        if not isinstance(value, dict):
            return None
        texts = ("id", "key", "status", "server", "error", "source")
        if not all(isinstance(value.get(name, ""), str) for name in texts) or not value.get("id") or \
                not value.get("key") or value.get("status") not in STATUSES:
            return None
        files, digests = value.get("files", []), value.get("digests", [])
        seconds = value.get("seconds", 0.0)
        if not (isinstance(files, list) and all(map(folder_name, files)) and len(set(files)) == len(files)):
            return None
        if not (isinstance(digests, list) and len(digests) in (0, len(files))
                and all(isinstance(d, str) and re.fullmatch(r"[0-9a-f]{64}", d) for d in digests)):
            return None
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds):
            return None
        known = {f.name for f in fields(cls)}
        return cls(**{name: item for name, item in value.items() if name in known})


@dataclass
class Staged:
    temp: str                    # the temp file's path
    suffix: str                  # how its published name ends (".png")
    digest: str                  # the SHA-256 of its bytes


class Manifest:
    def __init__(self, folder: Path, workflow: str, workflow_key: str = ""):
        self.folder, self.workflow, self.workflow_key = folder, workflow, workflow_key
        self.path = folder / NAME
        self.records: dict[str, JobRecord] = {}
        self._lines: dict[str, str | None] = {}              # key -> its record as one line of JSON (_save)
        self._whole: dict[str, bool] = {}                     # key -> its images were read whole (``finished``)
        self.replaced: dict[str, list[JobRecord]] = {}     # job id -> the records its next images replace (begin)
        self.unread = 0                                      # records of manifest.json that JobRecord.read refused
        self.lock = threading.Lock()
        self._lock_file = None
        self.ended = threading.Event()             # the batch writing here has ended (see end)

    @classmethod
    def open(cls, out: str, workflow: str = "", workflow_key: str = "") -> Manifest:
        """The folder checked, created, locked and cleaned of temp files, with its record (another workflow's is
        refused)."""
        folder = check_folder(out, "--out")
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise Flux2Error(f"--out {out}: cannot create it ({e.strerror or e}); choose a folder you can write "
                             "to") from None
        manifest = cls(folder, workflow, workflow_key)
        manifest._take_lock(out)
        for stale in folder.glob(f"{TEMP}*.part"):
            stale.unlink(missing_ok=True)
        manifest._load(out)
        return manifest

    def _take_lock(self, out: str) -> None:
        if fcntl is None:
            return
        self._lock_file = open(self.folder / LOCK, "a+b")       # noqa: SIM115 - held until close()
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock_file.close()
            raise Flux2Error(f"--out {out}: another batch is writing there now; wait for it to end, or give this "
                             "one another folder") from None

    def end(self) -> None:
        """Publish refuses from now on and the folder is unlocked; waits for a publish under way."""
        with self.lock:
            self.ended.set()
        self.close()

    def close(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    def _load(self, out: str) -> None:
        if not self.path.exists():
            return
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            if not isinstance(data, dict) or data.get("format") != FORMAT:
                raise ValueError(f"its format is {data.get('format') if isinstance(data, dict) else None!r}")
            if not isinstance(data.get("jobs"), list):
                raise TypeError('"jobs" is not a list')
            for name in ("workflow", "workflow_key"):
                if not isinstance(data.get(name, ""), str):
                    raise TypeError(f'"{name}" is not a string')
        except (OSError, ValueError, TypeError, RecursionError) as e:
            self.close()
            raise Flux2Error(f"--out {out}: {self.path} is not a batch manifest this client can read ({e}); move it "
                             "away (the batch then runs every job again) or choose another folder") from None
        records = [record for record in map(JobRecord.read, data["jobs"]) if record is not None]
        self.unread = len(data["jobs"]) - len(records)
        theirs = data.get("workflow_key") or ""
        if theirs and self.workflow_key and theirs != self.workflow_key:
            self.close()
            named = f" ({data.get('workflow')})" if data.get("workflow") else ""
            raise Flux2Error(f"--out {out}: {self.path} records a batch of another workflow{named}, or of this one "
                             "before it was changed; one folder holds one batch, whose ids name its files. Give this "
                             f"batch another --out, or remove {self.path} (and the images it lists) to start over "
                             "there")
        self.records = {record.key: record for record in records}
        self.workflow_key = self.workflow_key or theirs

    def begin(self, jobs: dict[str, str]) -> list[str]:
        """jobs {id: key} -> the ids changed since they ran: their new images replace the old record and files when
        published. A done job whose images are no longer whole is made again in their place too."""
        keys = set(jobs.values())
        self.replaced, changed = {}, set()
        for record in self.records.values():
            if record.id in jobs and record.key not in keys:
                changed.add(record.id)
            elif not (jobs.get(record.id) == record.key and record.status == "done" and not self.finished(record.key)):
                continue
            self.replaced.setdefault(record.id, []).append(record)
        return sorted(changed)

    def finished(self, key: str) -> JobRecord | None:
        """The job's record if it is done and each of its images is in the folder whole, as it was published."""
        record = self.records.get(key)
        if not (record and record.status == "done"):
            return None
        if key not in self._whole:                   # read once a run: a rerun of 5000 jobs hashes each image once
            self._whole[key] = all(self._whole_file(name, i, record) for i, name in enumerate(record.files))
        return record if self._whole[key] else None

    def _whole_file(self, name: str, index: int, record: JobRecord) -> bool:
        """A plain file of the bytes published (without digests: a picture that decodes whole)."""
        try:
            fd = os.open(self.folder / name, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            with os.fdopen(fd, "rb") as f:
                data = f.read()
        except OSError:
            return False
        if record.digests:
            return digest(data) == record.digests[index]
        try:
            picture_format(data)
        except PICTURE_ERRORS:
            return False
        return True

    def record(self, record: JobRecord) -> None:
        with self.lock:
            self._save(record)

    def _save(self, record: JobRecord, dropped: list[str] = ()) -> None:
        """The lock held; kept only once manifest.json holds it. Each record's JSON line is made once, so a save of
        5000 jobs does not serialize every record again."""
        records = {key: r for key, r in self.records.items() if key not in dropped}
        records[record.key] = record
        # self._lines holds the lines of self.records' very objects (both change together, after a good write)
        lines = {key: self._lines[key] if key in self._lines and self.records.get(key) is r
                 else json.dumps(asdict(r), ensure_ascii=False) for key, r in records.items()}
        head = {"format": FORMAT, "workflow": self.workflow, "workflow_key": self.workflow_key}
        text = json.dumps(head, ensure_ascii=False)[:-1] + ', "jobs": [\n' + ",\n".join(lines.values()) + "\n]}\n"
        self._replace(self.path, text.encode())
        self.records, self._lines = records, lines
        self._whole = {k: v for k, v in self._whole.items() if k in records and k != record.key}

    def _replace(self, path: Path, data: bytes) -> None:
        temp = self._temp(data)
        try:
            os.replace(temp, path)
        except OSError as e:
            Path(temp).unlink(missing_ok=True)
            raise Flux2Error(f"cannot write {path}: {e.strerror or e}; check the free space and the folder's "
                             "permissions") from None

    def _temp(self, data: bytes) -> str:
        try:
            fd, temp = tempfile.mkstemp(prefix=TEMP, suffix=".part", dir=self.folder)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
            except BaseException:
                Path(temp).unlink(missing_ok=True)
                raise
        except OSError as e:
            raise Flux2Error(f"cannot write in {self.folder}: {e.strerror or e}; check the free space and the "
                             "folder's permissions") from None
        return temp

    def stage(self, data: bytes, suffix: str) -> Staged:
        return Staged(self._temp(data), suffix, digest(data))

    def publish(self, record: JobRecord, staged: list[Staged]) -> JobRecord:
        """Staged files -> <id>-1<suffix>, -2, ... and the job recorded done, in one step under the lock (no image
        without its record). Refused after ``end``."""
        with self.lock:
            if self.ended.is_set():
                raise Flux2Error("the batch ended before this job did; nothing was written")
            old = self.replaced.pop(record.id, [])
            for earlier in old:                      # the changed job's earlier images: their names are for these
                for name in earlier.files:
                    (self.folder / name).unlink(missing_ok=True)
            names: list[str] = []
            try:
                for number, image in enumerate(staged, start=1):
                    names.append(self._claim(f"{record.id}-{number}", image.suffix, image.temp))
                done = replace(record, status="done", files=names, digests=[image.digest for image in staged])
                self._save(done, [earlier.key for earlier in old])
            except BaseException:
                for name in names:                  # no image without its record
                    (self.folder / name).unlink(missing_ok=True)
                raise
            return done

    def discard(self, staged: list[Staged]) -> None:
        for image in staged:
            Path(image.temp).unlink(missing_ok=True)

    def _claim(self, stem: str, suffix: str, temp: str) -> str:
        n = 0
        while True:
            name = f"{stem}{suffix}" if n == 0 else f"{stem}-{n}{suffix}"
            path = self.folder / name
            try:
                try:
                    os.link(temp, path)             # atomic, and fails where the name is taken
                except FileExistsError:
                    raise
                except OSError:                     # no hard links here (FAT, some network shares)
                    with open(path, "xb"):          # take the name, then put the whole file in its place
                        pass
                    os.replace(temp, path)
                    return name
                os.unlink(temp)
                return name
            except FileExistsError:
                n += 1
            except OSError as e:
                raise Flux2Error(f"cannot write {path}: {e.strerror or e}; check the free space and the folder's "
                                 "permissions") from None
