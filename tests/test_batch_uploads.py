"""Pictures from disk for a workflow (flux2_core/app/uploads.py): checks, content-addressed names, masks, ComfyUI's
answers to an upload, and `queue --image` against a fake server (tests/batch_fakes.py)."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import pytest
from PIL import Image

from flux2_core.app import queue_client, queue_command, uploads
from flux2_core.errors import Flux2Error
from tests.tiny.pictures import png_bytes

ROOT = Path(__file__).resolve().parents[1]
EDIT = ROOT / "workflows" / "api" / "flux2-klein-edit.json"


def picture_file(path: Path, mode="RGB", size=(8, 6), fmt="PNG", colour=None) -> Path:
    Image.new(mode, size, colour if colour is not None else (10, 20, 30)).save(path, fmt)
    return path


# ---------------------------------------------------------------------------------------------------------------------
# Pictures.

def test_a_picture_is_named_by_its_bytes(tmp_path):
    a = picture_file(tmp_path / "a.png")
    copy = tmp_path / "copy of a.png"
    copy.write_bytes(a.read_bytes())
    other = picture_file(tmp_path / "b.png", colour=(1, 2, 3))
    first = uploads.read_picture(str(a), "--image 10")
    assert first.name == f"flux2-{hashlib.sha256(a.read_bytes()).hexdigest()[:32]}.png"
    assert (first.width, first.height) == (8, 6) and first.data() == a.read_bytes()
    assert uploads.read_picture(str(copy), "--image 10").name == first.name            # the same bytes, one name
    assert uploads.read_picture(str(other), "--image 10").name != first.name
    jpeg = uploads.read_picture(str(picture_file(tmp_path / "c.jpeg", fmt="JPEG")), "--image 10")
    assert jpeg.name.endswith(".jpg")


def test_a_picture_changed_after_the_check_is_refused_at_upload(tmp_path):
    path = picture_file(tmp_path / "a.png")
    picture = uploads.read_picture(str(path), "--image 10")
    picture_file(path, colour=(200, 0, 0))
    with pytest.raises(Flux2Error, match=r"the picture .*a.png on this machine changed after it was checked"):
        picture.data()


@pytest.mark.parametrize("write, says", [
    (lambda p: p.write_bytes(b"not a picture at all"), "is not a readable picture"),
    (lambda p: p.write_bytes(png_bytes("whole")[:60]), "is not a readable picture"),      # cut short
    (lambda p: p.mkdir(), "is a folder; give a picture file"),
    (lambda p: None, "cannot read"),                                                      # missing
])
def test_what_is_not_a_picture_is_refused(tmp_path, write, says):
    path = tmp_path / "x.png"
    write(path)
    with pytest.raises(Flux2Error, match="--image 10=x.png: ") as error:
        uploads.read_picture(str(path), "--image 10=x.png")
    assert says in str(error.value)


def test_pictures_too_large_are_refused(tmp_path, monkeypatch):
    path = picture_file(tmp_path / "big.png", size=(40, 30))
    monkeypatch.setattr(uploads, "UPLOAD_LIMIT", path.stat().st_size - 1)
    size = path.stat().st_size
    with pytest.raises(Flux2Error, match=rf"big.png is {size} bytes, over the {size - 1} bytes ComfyUI takes by"):
        uploads.read_picture(str(path), "--image 10")
    monkeypatch.setattr(uploads, "UPLOAD_LIMIT", 1 << 20)
    monkeypatch.setattr(uploads, "PIXEL_LIMIT", 40 * 30 - 1)
    with pytest.raises(Flux2Error, match=r"big.png is 40x30 pixels, over the"):
        uploads.read_picture(str(path), "--image 10")


def test_a_mask_becomes_the_pictures_alpha(tmp_path):
    """Load Image gives 1 - alpha as the mask: a white mask pixel (repaint) must become alpha 0, a black one 255;
    a mask with alpha of its own gives that alpha as it is where it is read by it (mask_reading="alpha"; its grey
    levels say otherwise, so auto refuses)."""
    photo = picture_file(tmp_path / "photo.png", colour=(50, 60, 70), size=(4, 2))
    grey = Image.new("L", (4, 2), 0)
    grey.putpixel((1, 0), 255)
    grey.save(tmp_path / "mask.png")
    picture = uploads.read_picture(str(photo), "--image 10", mask=str(tmp_path / "mask.png"))
    joined = Image.open(io.BytesIO(picture.data()))
    assert picture.name.endswith(".png") and joined.mode == "RGBA"
    assert list(joined.getchannel("A").tobytes()) == [255, 0, 255, 255, 255, 255, 255, 255]
    assert joined.convert("RGB").getpixel((1, 0)) == (50, 60, 70)
    alpha = Image.new("RGBA", (4, 2), (0, 0, 0, 255))
    alpha.putpixel((3, 1), (0, 0, 0, 7))
    alpha.save(tmp_path / "alpha.png")
    with pytest.raises(Flux2Error, match="reads two ways"):      # its grey levels (all black) say "keep all"
        uploads.read_picture(str(photo), "--image 10", mask=str(tmp_path / "alpha.png"))
    picture = uploads.read_picture(str(photo), "--image 10", mask=str(tmp_path / "alpha.png"), mask_reading="alpha")
    assert list(Image.open(io.BytesIO(picture.data())).getchannel("A").tobytes())[-1] == 7
    assert uploads.read_picture(str(photo), "--image 10", mask=str(tmp_path / "alpha.png"),
                                mask_reading="alpha").name == picture.name
    opaque = grey.convert("RGBA")                        # a black and white mask saved with an opaque alpha channel
    opaque.save(tmp_path / "opaque.png")
    picture = uploads.read_picture(str(photo), "--image 10", mask=str(tmp_path / "opaque.png"))
    assert list(Image.open(io.BytesIO(picture.data())).getchannel("A").tobytes()) == [255, 0, 255, 255, 255, 255,
                                                                                     255, 255]
    picture_file(tmp_path / "small.png", mode="L", size=(2, 2), colour=0)
    with pytest.raises(Flux2Error, match=r"the mask .*small.png is 2x2 pixels and the picture .*photo.png 4x2"):
        uploads.read_picture(str(photo), "--image 10", mask=str(tmp_path / "small.png"))


def test_nodes_and_pairs_are_checked(tmp_path):
    workflow = json.loads(EDIT.read_text())
    path = str(picture_file(tmp_path / "a.png"))
    assert list(uploads.plan_pictures(workflow, {"10": path}, {})) == ["10"]
    with pytest.raises(Flux2Error, match=r"--image 99=.*: the workflow has no node '99'; its Load Image nodes are "
                                         r"\['10'\]"):
        uploads.plan_pictures(workflow, {"99": path}, {})
    with pytest.raises(Flux2Error, match=r"node 7 \(Flux2KleinDenoise\) has no image file input"):
        uploads.plan_pictures(workflow, {"7": path}, {})
    with pytest.raises(Flux2Error, match=r"--mask 10=m.png needs --image 10=PATH too"):
        uploads.plan_pictures(workflow, {}, {"10": "m.png"})
    with pytest.raises(Flux2Error, match=r"--image 'photo.png' is not NODE=PATH"):
        uploads.parse_pairs(["photo.png"], "--image")
    with pytest.raises(Flux2Error, match=r"--image names node 10 twice"):
        uploads.parse_pairs(["10=a.png", "10=b.png"], "--image")


# ---------------------------------------------------------------------------------------------------------------------
# ComfyUI's answer to an upload.

@pytest.mark.parametrize("body, name", [
    (b'{"name": "flux2-ab.png", "subfolder": "", "type": "input"}', "flux2-ab.png"),
    (b'{"name": "flux2-ab (1).png", "subfolder": "", "type": "input"}', "flux2-ab (1).png"),
    (b'{"name": "flux2-ab.png", "subfolder": "batch", "type": "input"}', "batch/flux2-ab.png"),
    (b'{"name": "flux2-ab.png"}', "flux2-ab.png"),
])
def test_upload_answers(body, name):
    assert uploads.parse_upload("s:1", body) == name


@pytest.mark.parametrize("body, says", [
    (b"", "the answer to POST /upload/image is empty"),
    (b"<html>", "the answer to POST /upload/image is not JSON"),
    (b'["flux2-ab.png"]', 'is not {"name", "subfolder", "type": "input"}'),
    (b'{"name": "a.png", "type": "output"}', 'is not {"name", "subfolder", "type": "input"}'),
    (b'{"name": 7}', 'is not {"name", "subfolder", "type": "input"}'),
    (b'{"name": ".."}', "names no usable file"),
    (b'{"name": "a/b.png"}', "names no usable file"),
    (b'{"name": "a.png", "subfolder": "../x"}', "names no usable file"),
    (b'{"name": "a\\u001b.png"}', "names no usable file"),
])
def test_odd_upload_answers_name_the_server(body, says):
    with pytest.raises(queue_client.ServerError, match="ComfyUI at s:1: ") as error:
        uploads.parse_upload("s:1", body)
    assert says in str(error.value)


@pytest.mark.parametrize("answer, says", [
    ((500, b"Internal Server Error"), "POST /upload/image refused"),
    ((413, b""), "as too large (HTTP 413); start ComfyUI with a larger --max-upload-size"),
    ((200, b"ok"), "the answer to POST /upload/image is not JSON: b'ok'"),
])
def test_a_refused_upload_names_the_server_and_the_file(fakes, tmp_path, answer, says):
    server = fakes()
    server.upload_answer = answer
    picture = uploads.read_picture(str(picture_file(tmp_path / "a.png")), "--image 10")
    with pytest.raises(queue_client.ServerError) as error:
        uploads.upload(queue_client.ComfyClient(server.address, timeout=10), picture)
    assert str(error.value).startswith(f"ComfyUI at {server.address}: ") and says in str(error.value)


# ---------------------------------------------------------------------------------------------------------------------
# queue --image: one job.

def test_queue_uploads_the_image_and_names_it_in_the_workflow(fakes, tmp_path, capsys):
    server = fakes()
    photo = picture_file(tmp_path / "photo.png")
    argv = [str(EDIT), "--server", server.address, "--image", f"10={photo}", "--prompt", "make it night",
            "--out", str(tmp_path / "out")]
    assert queue_command.main(argv) == 0
    name = f"flux2-{hashlib.sha256(photo.read_bytes()).hexdigest()[:32]}.png"
    assert server.uploads == [name] and server.inputs == {name: photo.read_bytes()}
    assert server.prompts[0]["10"]["inputs"]["image"] == name and server.prompts[0]["4"]["inputs"]["prompt"] == \
        "make it night"
    assert f"uploaded {photo} to ComfyUI at {server.address} as {name}" in capsys.readouterr().err
    assert queue_command.main(argv) == 0                       # again: the same name, one copy on the server
    assert server.uploads == [name, name] and list(server.inputs) == [name]
    assert server.prompts[1]["10"]["inputs"]["image"] == name
    assert len(list((tmp_path / "out").glob("*.png"))) == 2


def test_queue_uses_the_name_the_server_answered(fakes, tmp_path):
    """A different file under our name already on the server: ComfyUI keeps both and answers another name,
    which the workflow must then use."""
    server = fakes()
    photo = picture_file(tmp_path / "photo.png")
    name = uploads.read_picture(str(photo), "x").name
    server.inputs[name] = b"someone else's file"
    assert queue_command.main([str(EDIT), "--server", server.address, "--image", f"10={photo}",
                              "--out", str(tmp_path / "out")]) == 0
    assert server.prompts[0]["10"]["inputs"]["image"] == name.replace(".png", " (1).png")


def test_a_bad_image_is_refused_before_anything_is_sent(fakes, tmp_path, capsys):
    server = fakes()
    (tmp_path / "notes.png").write_text("not a picture")
    code = queue_command.main([str(EDIT), "--server", server.address, "--image", f"10={tmp_path / 'notes.png'}",
                              "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith(f"error: --image 10={tmp_path / 'notes.png'}: ") and "Traceback" not in err
    assert "is not a readable picture" in err and server.uploads == [] and server.prompts == []


def test_a_mask_and_its_picture_are_joined_upright(tmp_path):
    """EXIF orientation 6 (turned a quarter): the picture and the mask are each turned upright, as Load Image turns a
    picture, before they are compared and joined; a mask turned where its picture is not is another size, refused
    with the sizes (not a crash in the join)."""
    from PIL import ImageOps

    turned = Image.Exif()
    turned[0x0112] = 6
    photo = Image.new("RGB", (4, 2), (50, 60, 70))
    photo.save(tmp_path / "photo.png", exif=turned)
    photo.save(tmp_path / "plain.png")
    mask = Image.new("L", (4, 2), 0)
    mask.putpixel((1, 0), 255)
    mask.save(tmp_path / "mask.png", exif=turned)
    picture = uploads.read_picture(str(tmp_path / "photo.png"), "--image 10", mask=str(tmp_path / "mask.png"))
    joined = Image.open(io.BytesIO(picture.data()))
    upright = ImageOps.exif_transpose(Image.open(tmp_path / "mask.png"))
    assert joined.size == upright.size == (2, 4) and (picture.width, picture.height) == (2, 4)
    assert list(joined.getchannel("A").tobytes()) == [255 - v for v in upright.tobytes()]
    with pytest.raises(Flux2Error, match=r"is 2x4 pixels and the picture .*plain.png 4x2"):
        uploads.read_picture(str(tmp_path / "plain.png"), "--image 10", mask=str(tmp_path / "mask.png"))
