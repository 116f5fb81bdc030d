"""A batch's manifest.json is data from disk, perhaps damaged or edited (flux2_core/app/manifest.py): whatever it
says, a rerun reads, writes and deletes nothing outside --out, ends in a Flux2Error or treats the record as unknown
(never another exception), and takes a recorded image for done only while it is whole, as it was published.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from flux2_core import BatchClient
from flux2_core.app import manifest as manifest_module
from flux2_core.app.manifest import FORMAT, JobRecord, Manifest
from flux2_core.errors import Flux2Error

ROOT = Path(__file__).resolve().parents[1]
EDIT = ROOT / "workflows" / "api" / "flux2-klein-edit.json"
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# names a damaged or edited record may give its files: the way out of the folder, into it, and plain ones
ESCAPES = ["../outside.png", "..", ".", "/", "", "sub/x.png", "..\\outside.png", "manifest.json", ".flux2-batch.lock",
           "a\x00b.png", "C:outside.png", " x.png"]
json_leaf = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12)
json_value = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.text(max_size=6), inner, max_size=3), max_leaves=6)
file_name = st.sampled_from(ESCAPES) | st.builds(lambda p: str(p), st.sampled_from(["/tmp", "/"])) | st.from_regex(
    r"[A-Za-z0-9./\\-]{1,12}", fullmatch=True)


def field_value(good):
    """A field as a damaged manifest may hold it: the good value, or any JSON value instead."""
    return st.just(good) | json_value


@st.composite
def records(draw, job_id: str, key: str):
    """One record of manifest.json: every field drawn from its right value and from every JSON value."""
    record = {"id": draw(field_value(job_id)), "key": draw(field_value(key)),
              "status": draw(st.sampled_from(["done", "failed"]) | json_value),
              "files": draw(st.lists(file_name | json_value, max_size=3) | json_value),
              "server": draw(field_value("127.0.0.1:8188")), "error": draw(field_value("")),
              "seconds": draw(field_value(1.5)), "source": draw(field_value(""))}
    for name in draw(st.sets(st.sampled_from(sorted(record)), max_size=3)):
        del record[name]                                # a field missing
    return record if draw(st.integers(0, 9)) else draw(json_value)      # sometimes not an object at all


def png(colour=(10, 20, 30)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 8), colour).save(out, "PNG")
    return out.getvalue()


def write_manifest(folder: Path, jobs: list, workflow_key: str = "") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "manifest.json").write_text(json.dumps({"format": FORMAT, "workflow": "", "workflow_key": workflow_key,
                                                      "jobs": jobs}))


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@SETTINGS
@given(data=st.data())
def test_no_record_reaches_outside_the_folder_or_ends_in_a_traceback(tmp_path_factory, data):
    """Draws 1-3 records of any shape (each field its right value or any JSON value, fields missing, a record not an
    object) whose files are names leading out of the folder, absolute paths, the manifest itself, or plain names;
    the batch's jobs reuse the records' ids under other keys, so a rerun replaces (deletes) what the records list.
    Before the fix, "../outside.png" was deleted and a null or list field ended in a TypeError."""
    root = tmp_path_factory.mktemp("m")
    out = root / "out"
    (root / "outside.png").write_bytes(b"keep me")
    (out / "sub").mkdir(parents=True)
    (out / "sub" / "x.png").write_bytes(b"keep me too")
    jobs = data.draw(st.lists(records("0001", "old"), min_size=1, max_size=3))
    write_manifest(out, jobs)
    outside = {**snapshot(root / "out" / "sub"), "outside": (root / "outside.png").read_bytes()}
    try:
        manifest = Manifest.open(str(out))
    except Flux2Error:
        return                                           # the whole file refused, with the fix: allowed
    try:
        for record in manifest.records.values():         # what is kept is a record this client could have written
            assert isinstance(record.id, str) and isinstance(record.key, str) and record.status in ("done", "failed")
            assert all(manifest_module.folder_name(name) for name in record.files)
        assert manifest.unread == sum(JobRecord.read(job) is None for job in jobs)
        manifest.finished("old")
        manifest.begin({"0001": "new"})                  # job 0001 changed: its old files are replaced on publish
        staged = manifest.stage(png(), ".png")
        done = manifest.publish(JobRecord("0001", "new", "done"), [staged])
        assert manifest.finished("new") == done
    finally:
        manifest.end()
    assert (root / "outside.png").read_bytes() == outside["outside"]
    assert snapshot(root / "out" / "sub") == {k: v for k, v in outside.items() if k != "outside"}
    assert sorted(p.name for p in root.iterdir()) == ["out", "outside.png"]


@SETTINGS
@given(cut=st.integers(0, len(png()) - 1), flip=st.integers(0, len(png()) - 1), how=st.sampled_from(
    ["cut", "flip", "gone", "link", "folder"]))
def test_a_recorded_image_that_is_not_whole_is_made_again(tmp_path_factory, cut, flip, how):
    """Draws a published image cut short at any byte, one byte changed anywhere, the file removed, replaced by a link
    to a whole copy outside the folder, or by a folder: the job is no longer done. Before the fix any file of the
    name counted as done, and a cut image was never redone."""
    out = tmp_path_factory.mktemp("w") / "out"
    manifest = Manifest.open(str(out))
    data = png()
    done = manifest.publish(JobRecord("0001", "k", "done"), [manifest.stage(data, ".png")])
    assert manifest.finished("k") == done
    path = out / done.files[0]
    if how == "cut":
        path.write_bytes(data[:cut])
    elif how == "flip":
        path.write_bytes(data[:flip] + bytes([data[flip] ^ 0x01]) + data[flip + 1:])
    elif how == "gone":
        path.unlink()
    elif how == "link":
        (out.parent / "copy.png").write_bytes(data)
        path.unlink()
        path.symlink_to(out.parent / "copy.png")
    else:
        path.unlink()
        path.mkdir()
    manifest.end()
    assert Manifest.open(str(out)).finished("k") is None


def test_a_record_of_an_earlier_client_counts_while_its_picture_decodes(tmp_path):
    """Records written before digests were kept: the picture must decode to its last pixel."""
    out = tmp_path / "out"
    write_manifest(out, [{"id": "0001", "key": "a", "status": "done", "files": ["0001-1.png"]},
                         {"id": "0002", "key": "b", "status": "done", "files": ["0002-1.png"]}])
    (out / "0001-1.png").write_bytes(png())
    (out / "0002-1.png").write_bytes(png()[:-20])
    manifest = Manifest.open(str(out))
    assert manifest.finished("a") is not None and manifest.finished("b") is None
    manifest.end()


@pytest.mark.parametrize("text,says", [
    ('{"format": "flux2-klein batch manifest 1", "jobs": {"0001": {}}}', '"jobs" is not a list'),
    ('["flux2-klein batch manifest 1"]', "its format is None"),
    ('{"format": "flux2-klein batch manifest 1", "jobs": [], "workflow_key": ["x"]}', '"workflow_key" is not a str'),
    ("[" * 100_000, "not a batch manifest this client can read"),
])
def test_a_manifest_of_the_wrong_shape_is_refused_with_the_fix(tmp_path, text, says):
    (tmp_path / "manifest.json").write_text(text)
    with pytest.raises(Flux2Error, match=f"{says}.*move it away"):
        Manifest.open(str(tmp_path))


def test_a_rerun_redoes_a_cut_image_and_keeps_files_outside_out(fakes, tmp_path, capsys):
    """Through the batch client: a manifest edited to list ../outside.png for a job, a damaged record, and an image
    cut short by a crash. The rerun makes both jobs again, says why, and deletes nothing outside --out."""
    server = fakes()
    out = tmp_path / "out"
    jobs = [{"prompt": "a", "seed": 1}, {"prompt": "b", "seed": 2}]
    assert BatchClient(str(EDIT), server.address, str(out), progress=None).run(jobs).ok
    data = json.loads((out / "manifest.json").read_text())
    records = {record["id"]: record for record in data["jobs"]}
    records["0001"]["files"] = ["../outside.png"]                                     # edited by hand
    data["jobs"].append({"id": "0003", "key": None, "status": "done", "files": None})  # damaged
    (out / "manifest.json").write_text(json.dumps(data))
    (tmp_path / "outside.png").write_bytes(b"not the batch's")
    image = out / "0002-1.png"
    image.write_bytes(image.read_bytes()[:30])                                         # cut short by a crash
    summary = BatchClient(str(EDIT), server.address, str(out), progress=True).run(jobs)
    assert summary.ok and summary.skipped == 0 and len(server.prompts) == 4
    assert "2 record(s) of" in capsys.readouterr().err
    assert (tmp_path / "outside.png").read_bytes() == b"not the batch's"
    # the cut image is replaced; the edited record's file is unknown now, so the new one lands beside it
    assert [job.files for job in summary.jobs] == [["0001-1-1.png"], ["0002-1.png"]]
    for name, seed in (("0001-1-1.png", 1), ("0002-1.png", 2)):
        with Image.open(out / name) as picture:
            picture.load()
            assert json.loads(picture.text["prompt"])["5"]["inputs"]["seed"] == seed
