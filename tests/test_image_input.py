"""Input images (references, the init image) as users hand them over: every image PIL can decode becomes the right
8-bit upright RGB image, every other input a Flux2Error naming it, never another exception.

The expectations are computed independently of ``references.py``: 16-bit PNGs written byte by byte (zlib, CRC)
and scaled with numpy, EXIF orientations undone with numpy's rot90 / flip, and 8-bit modes against PIL's
``convert("RGB")``, which is what BFL and diffusers apply (the module docstring's parity rule).
"""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from flux2_core.app import cli
from flux2_core.errors import Flux2Error
from flux2_core.families.flux2 import FLUX2
from flux2_core.sampling.references import MAX_IMAGE_PIXELS, as_pil, open_image, prepare_references

SETTINGS = settings(max_examples=150, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png16(array: np.ndarray) -> bytes:
    """A 16-bit PNG written without PIL: grey (HxW), RGB or RGBA (HxWx3/4) uint16 samples, filter 0 on every row."""
    color_type = {2: 0, 3: {3: 2, 4: 6}.get(array.shape[-1])}[array.ndim]
    h, w = array.shape[:2]
    rows = b"".join(b"\x00" + array[y].astype(">u2").tobytes() for y in range(h))
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, color_type, 0, 0, 0))
            + png_chunk(b"IDAT", zlib.compress(rows)) + png_chunk(b"IEND", b""))


def expected_from_16_bit(values: np.ndarray) -> np.ndarray:
    """8-bit RGB of 16-bit grey values: round(v / 257), the same in all three channels."""
    grey = np.rint(np.clip(values.astype(np.float64), 0, 65535) / 257).astype(np.uint8)
    return np.repeat(grey[..., None], 3, axis=2)


def write(path: Path, content: bytes) -> Path:
    path.write_bytes(content)
    return path


# ---------------------------------------------------------------------------------------------------------------
# bit depth, alpha, orientation
# ---------------------------------------------------------------------------------------------------------------

def test_16_bit_grey_png_is_scaled_not_clipped(tmp_path):
    """A 16-bit grey gradient (every 8-bit level and the ends) comes out as round(v / 257), not as PIL's convert's
    0 / 255 (which would make a dark image white)."""
    values = np.linspace(0, 65535, 64 * 80).round().astype(np.uint16).reshape(64, 80)
    values[0, :4] = [0, 128, 129, 65535]               # 128 / 257 rounds down, 129 / 257 up
    image = open_image(write(tmp_path / "grey16.png", png16(values)))
    assert image.mode == "RGB" and image.size == (80, 64)
    got = np.asarray(image)
    assert np.array_equal(got, expected_from_16_bit(values))
    assert got[0, :4, 0].tolist() == [0, 0, 1, 255] and len(np.unique(got)) == 256
    with Image.open(tmp_path / "grey16.png") as raw:                  # what a plain convert("RGB") would give
        assert np.asarray(raw.convert("RGB"))[32, 40, 0] == 255 != got[32, 40, 0]


@pytest.mark.parametrize("channels", [3, 4])
def test_16_bit_rgb_png_keeps_its_colours(tmp_path, channels):
    """16-bit RGB(A) PNGs: PIL opens them as 8-bit by the high byte of each sample; alpha is dropped."""
    rng = np.random.default_rng(channels)
    values = rng.integers(0, 65536, (70, 66, channels), dtype=np.uint16)
    values[0, 0, :3] = [0, 32896, 65535]
    got = np.asarray(open_image(write(tmp_path / "rgb16.png", png16(values))))
    assert np.array_equal(got, (values[..., :3] >> 8).astype(np.uint8))
    assert got[0, 0].tolist() == [0, 128, 255]


@pytest.mark.parametrize("mode,dtype", [("I;16", "<u2"), ("I;16L", "<u2"), ("I;16B", ">u2"), ("I", "<i4")])
def test_16_bit_modes_in_memory(mode, dtype):
    """PIL images of the 16-bit modes (and I, taken as 16-bit and clipped to it) given to the pipeline directly."""
    rng = np.random.default_rng(1)
    values = rng.integers(-1000 if mode == "I" else 0, 70000 if mode == "I" else 65536, (64, 80)).astype(dtype)
    image = Image.frombytes(mode, (80, 64), values.tobytes())
    assert image.mode == mode
    (out,) = prepare_references([image], None, FLUX2.references)
    assert np.array_equal(np.asarray(out), expected_from_16_bit(values))


def test_alpha_is_dropped_as_bfl_does(tmp_path):
    """BFL and diffusers convert("RGB"): a transparent pixel keeps its stored colour (not composited on white)."""
    rgba = np.zeros((64, 64, 4), dtype=np.uint8)
    rgba[...] = [10, 20, 30, 0]                         # fully transparent, dark underneath
    rgba[:, 32:] = [200, 100, 50, 128]
    Image.fromarray(rgba, "RGBA").save(tmp_path / "a.png")
    got = np.asarray(open_image(tmp_path / "a.png"))
    assert got[0, 0].tolist() == [10, 20, 30] and got[0, 63].tolist() == [200, 100, 50]
    grey = Image.fromarray(np.full((64, 64, 2), [77, 0], dtype=np.uint8), "LA")
    assert np.asarray(as_pil(grey))[5, 5].tolist() == [77, 77, 77]
    palette = Image.new("P", (64, 64), 3)
    palette.putpalette([0, 0, 0] * 3 + [9, 8, 7] + [0, 0, 0] * 252)
    palette.info["transparency"] = 3                     # index 3 is transparent: its palette colour stays
    palette.save(tmp_path / "p.png")
    assert np.asarray(open_image(tmp_path / "p.png"))[0, 0].tolist() == [9, 8, 7]


@pytest.mark.parametrize("orientation,upright", [
    (1, lambda a: a), (2, lambda a: a[:, ::-1]), (3, lambda a: np.rot90(a, 2)), (4, lambda a: a[::-1]),
    (6, lambda a: np.rot90(a, -1)), (8, lambda a: np.rot90(a, 1))])
def test_exif_orientation_is_applied(tmp_path, orientation, upright):
    """A photo stored sideways with an EXIF orientation is used as it is meant to be seen (6: turn 90 degrees
    clockwise, 8: counter-clockwise, 3: 180, 2 / 4: mirrored)."""
    stored = np.random.default_rng(orientation).integers(0, 256, (64, 96, 3), dtype=np.uint8)
    exif = Image.Exif()
    exif[0x0112] = orientation
    Image.fromarray(stored).save(tmp_path / "photo.png", exif=exif)
    image = open_image(tmp_path / "photo.png")
    assert np.array_equal(np.asarray(image), upright(stored))
    with Image.open(tmp_path / "photo.png") as raw:     # the same through the pipeline's own entry, given PIL
        assert np.array_equal(np.asarray(prepare_references([raw], None, FLUX2.references)[0]), upright(stored))


def test_unreadable_exif_is_ignored(tmp_path):
    """EXIF with a byte-order mark that is neither II nor MM (PIL's exif_transpose raises SyntaxError on it): the
    pixels are used as stored."""
    stored = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    Image.fromarray(stored).save(tmp_path / "photo.png", exif=b"Exif\x00\x00ZZ\x00*\x00\x00\x00\x08")
    assert np.array_equal(np.asarray(open_image(tmp_path / "photo.png")), stored)


# ---------------------------------------------------------------------------------------------------------------
# files that must be refused
# ---------------------------------------------------------------------------------------------------------------

def header_only_png(width: int, height: int) -> bytes:
    """A PNG that declares a size and holds no pixels: opening it costs nothing, decoding it would."""
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + png_chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + png_chunk(b"IEND", b""))


@pytest.mark.parametrize("width,height,detail", [
    (8193, 8192, "8193x8192, 67,117,056 pixels"),
    (20000, 20000, "could be decompression bomb"),     # past PIL's own refusal (2 x 89.5 M pixels)
])
def test_decompression_bombs_are_refused_before_decoding(tmp_path, width, height, detail):
    path = write(tmp_path / "bomb.png", header_only_png(width, height))
    with pytest.raises(Flux2Error, match=rf"image {path} is too large \(.*{detail}.*\): an input image may have at "
                                         rf"most {MAX_IMAGE_PIXELS:,} pixels \(8192 x 8192\); scale it down"):
        open_image(path)


def test_the_limit_itself_is_allowed(tmp_path):
    """8192 x 8192 passes the limit (it then fails only because this file holds no pixels)."""
    with pytest.raises(Flux2Error, match="could not be decoded"):
        open_image(write(tmp_path / "big.png", header_only_png(8192, 8192)))


def test_a_lower_pil_limit_set_by_the_host_is_said_the_same_way(tmp_path, monkeypatch):
    Image.fromarray(np.zeros((64, 64, 3), dtype=np.uint8)).save(tmp_path / "small.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    with pytest.raises(Flux2Error, match="is too large .*scale it down"):
        open_image(tmp_path / "small.png")


def test_damaged_files(tmp_path):
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(tmp_path / "ok.png")
    content = (tmp_path / "ok.png").read_bytes()
    cases = {"cut.png": content[: len(content) // 2], "empty.png": b"", "text.png": b"not an image\n" * 10,
             "crc.png": content[:40] + bytes([content[40] ^ 0xFF]) + content[41:]}
    for name, data in cases.items():
        path = write(tmp_path / name, data)
        with pytest.raises(Flux2Error, match=rf"image {path} could (not be read|not be decoded)"):
            open_image(path)
    with pytest.raises(Flux2Error, match="no such file"):
        open_image(tmp_path / "missing.png")
    with pytest.raises(Flux2Error, match="could not be read.*IsADirectoryError"):
        open_image(tmp_path)


def test_every_kind_of_pil_error_becomes_a_flux2error(tmp_path):
    """Pillow reports bad files with many exception types (its own fuzzers catch Exception): a header chunk of the
    wrong length (ValueError), a chunk length pointing into garbage (SyntaxError), a text chunk that inflates past
    PIL's limit (ValueError): each is a Flux2Error naming the file and the type."""
    good = png16(np.zeros((64, 64), dtype=np.uint16))
    ihdr_length = good[:11] + b"\x0a" + good[12:]                 # IHDR says 10 bytes, not 13
    idat_length = good[:33] + struct.pack(">I", 4) + good[37:]      # IDAT says 4 bytes: the next chunk is garbage
    text_bomb = good[:33] + png_chunk(b"zTXt", b"bomb\x00\x00" + zlib.compress(bytes(2**21))) + good[33:]
    for name, content, kind in [("ihdr.png", ihdr_length, "ValueError"), ("idat.png", idat_length, "SyntaxError"),
                                ("text.png", text_bomb, "ValueError")]:
        path = write(tmp_path / name, content)
        with pytest.raises(Flux2Error, match=rf"image {path} could not be (read|decoded) \({kind}: "):
            open_image(path)


def test_cli_uses_the_same_decoding(tmp_path):
    values = np.linspace(0, 65535, 64 * 64).astype(np.uint16).reshape(64, 64)
    path = write(tmp_path / "grey16.png", png16(values))
    assert np.array_equal(np.asarray(cli.open_image(str(path))), expected_from_16_bit(values))
    with pytest.raises(Flux2Error, match="too large"):
        cli.open_image(str(write(tmp_path / "bomb.png", header_only_png(10000, 10000))))


@pytest.mark.parametrize("bad", ["photo.png", np.zeros((64, 64, 5), np.uint8), np.zeros((64, 64), np.float32),
                                 np.zeros((2, 64, 64, 3), np.uint8)])
def test_what_is_not_an_image(bad):
    with pytest.raises(Flux2Error, match="reference image 1 must be a PIL image or a uint8 HxWxC array"):
        prepare_references([bad], None, FLUX2.references)


# ---------------------------------------------------------------------------------------------------------------
# property tests: every mode and bit depth, every damage
# ---------------------------------------------------------------------------------------------------------------

MODES = ["1", "L", "LA", "La", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr", "LAB", "HSV", "I",
         "I;16", "I;16L", "I;16B", "I;16N"]


@pytest.mark.parametrize("values", [(0.0, 1.0), (0.0, 255.0)])
def test_float_images_are_refused_not_clipped(tmp_path, values):
    """A float TIFF (PIL mode F) has no fixed range: PIL's convert would clip it to 0..255, so a 0..1 image would
    become black. It is refused with what to do instead, from a file and in memory."""
    image = Image.fromarray(np.linspace(*values, 64 * 64, dtype=np.float32).reshape(64, 64), mode="F")
    image.save(tmp_path / "float.tiff")
    with pytest.raises(Flux2Error, match="floating-point .* 8- or 16-bit PNG"):
        open_image(tmp_path / "float.tiff")
    with pytest.raises(Flux2Error, match="floating-point .* 8- or 16-bit PNG"):
        as_pil(image)


def expected_rgb(image: Image.Image) -> np.ndarray:
    """The RGB the rules give, computed apart from references.py: numpy for the 16-bit modes, else PIL's convert."""
    if image.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I"):
        return expected_from_16_bit(np.asarray(image))
    return np.asarray((image.convert("LA") if image.mode == "La" else image).convert("RGB"))


@SETTINGS
@given(mode=st.sampled_from(MODES), width=st.integers(1, 12), height=st.integers(1, 12), data=st.data())
def test_every_mode_becomes_the_right_rgb(mode, width, height, data):
    size = len(Image.new(mode, (width, height)).tobytes())
    image = Image.frombytes(mode, (width, height), data.draw(st.binary(min_size=size, max_size=size)))
    got = as_pil(image)
    assert got.mode == "RGB" and got.size == (width, height)
    assert np.array_equal(np.asarray(got), expected_rgb(image))


@SETTINGS
@given(shape=st.lists(st.integers(0, 6), min_size=1, max_size=4), dtype=st.sampled_from([np.uint8, np.uint16,
                                                                                          np.float32, np.int64]))
def test_any_array_is_an_image_or_a_flux2error(shape, dtype):
    array = np.random.default_rng(0).integers(0, 256, shape).astype(dtype)
    try:
        image = as_pil(array)
    except Flux2Error:
        assert dtype is not np.uint8 or len(shape) not in (2, 3) or shape[-1] not in range(1, 5)
        return
    assert image.mode == "RGB" and image.size == (shape[1], shape[0])


# (mode, format) pairs PIL saves; PNG, BMP and TIFF are lossless, so the undamaged file must read back exactly
SAVED = [("1", "PNG"), ("L", "PNG"), ("LA", "PNG"), ("P", "PNG"), ("RGB", "PNG"), ("RGBA", "PNG"), ("I;16", "PNG"),
         ("L", "BMP"), ("RGB", "BMP"), ("RGB", "TIFF"), ("CMYK", "TIFF"), ("I;16", "TIFF"), ("L", "JPEG"),
         ("RGB", "JPEG"), ("CMYK", "JPEG"), ("RGB", "WEBP"), ("RGBA", "WEBP"), ("P", "GIF")]
LOSSLESS = {"PNG", "BMP", "TIFF"}


@SETTINGS
@given(saved=st.sampled_from(SAVED), width=st.integers(1, 20), height=st.integers(1, 20),
       damage=st.sampled_from(["none", "cut", "bytes", "insert"]), data=st.data())
def test_damaged_files_decode_right_or_fail_cleanly(tmp_path, saved, width, height, damage, data):
    mode, fmt = saved
    size = len(Image.new(mode, (width, height)).tobytes())
    original = Image.frombytes(mode, (width, height), data.draw(st.binary(min_size=size, max_size=size)))
    buffer = io.BytesIO()
    original.save(buffer, fmt)
    content = bytearray(buffer.getvalue())
    if damage == "cut":
        content = content[: data.draw(st.integers(0, len(content) - 1))]
    elif damage == "bytes":
        for _ in range(data.draw(st.integers(1, 8))):
            content[data.draw(st.integers(0, len(content) - 1))] = data.draw(st.integers(0, 255))
    elif damage == "insert":
        at = data.draw(st.integers(0, len(content)))
        content[at:at] = data.draw(st.binary(min_size=1, max_size=16))
    path = write(tmp_path / f"image.{fmt.lower()}", bytes(content))
    try:
        image = open_image(path)
    except Flux2Error as e:
        assert damage != "none", e
        assert str(path) in str(e)
        return
    assert image.mode == "RGB" and image.width * image.height <= MAX_IMAGE_PIXELS
    if damage == "none":
        assert image.size == (width, height)
        if fmt in LOSSLESS:
            assert np.array_equal(np.asarray(image), expected_rgb(original))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 80), st.integers(1, 80))
def test_every_input_picture_fits_the_16_pixel_grid_or_is_refused_by_name(width, height):
    """grid_size, the one rule for every input picture: the largest multiple-of-16 crop, or (smaller than one cell)
    a Flux2Error naming the input and the smallest size that works."""
    from flux2_core.sampling.references import center_crop_16, grid_size

    if width < 16 or height < 16:
        with pytest.raises(Flux2Error, match=rf"^the mask is {width}x{height} pixels.*at least 16x16 pixels"):
            grid_size(width, height, "the mask")
        return
    w, h = grid_size(width, height, "the mask")
    assert (w % 16, h % 16) == (0, 0) and width - 16 < w <= width and height - 16 < h <= height
    assert center_crop_16(Image.new("RGB", (width, height))).size == (w, h)


def test_a_picture_too_small_for_the_grid_is_refused_before_any_model_loads(tmp_path, capsys, monkeypatch):
    """A 1x1 --image (image-to-image, inpainting; a mask is fitted to the image): exit 2, the option and file named;
    nothing loads (the loader would fail the test)."""
    from flux2_core import pipeline

    monkeypatch.setattr(pipeline, "load_models", lambda *a, **k: pytest.fail("models were loaded"))
    tiny = tmp_path / "dot.png"
    Image.new("RGB", (1, 1), (200, 10, 10)).save(tiny)
    good = tmp_path / "good.png"
    Image.new("RGB", (64, 64)).save(good)
    for argv in (["--image", str(tiny)], ["--image", str(tiny), "--mask", str(good)]):
        code = cli.main(["--prompt", "x", "--models", str(tmp_path), "--out", str(tmp_path / "out"), *argv])
        err = capsys.readouterr().err
        assert code == 2 and f"--image {tiny} is 1x1 pixels" in err and "at least 16x16" in err, err


def test_generate_refuses_an_image_to_edit_too_small_for_the_grid():
    """The Python API applies the same rule (a 1x1 start image used to run as if there were none)."""
    from flux2_core.app.demo import demo_models
    from flux2_core.pipeline import generate

    models = demo_models("klein-4b", "cpu")
    for mask in (None, Image.new("L", (1, 1), 255)):
        with pytest.raises(Flux2Error, match="the image to edit is 1x1 pixels"):
            generate(models, "x", image=Image.new("RGB", (1, 1)), mask=mask, strength=0.5, width=32, height=32,
                     steps=1)
