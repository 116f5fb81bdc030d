"""Numbers and addresses a user types: every numeric option (the generate command's, the queue command's, --expand's
sides, a batch line's size) is read by one parser (``checks.parse_number``) that takes ASCII digits alone, of a
bounded length, finite; options are checked whether a batch or one prompt is queued; a server written two ways is
one server (``queue_client.parse_server``).
"""

from __future__ import annotations

import ipaddress
import json
import math
import re
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from flux2_core.app import batch, batch_jobs, cli, queue_client, queue_command
from flux2_core.errors import Flux2Error
from flux2_core.sampling import inpaint

ROOT = Path(__file__).resolve().parents[1]
TEXT_TO_IMAGE = ROOT / "workflows" / "api" / "flux2-klein-text-to-image.json"
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# what looks like a number: ASCII digits, other scripts' digits (int() takes "٣" and "３"), digit-like signs that
# str.isdigit() takes and int() refuses ("²", "①"), signs, points, exponents, spaces, and words float() reads
DIGITISH = st.sampled_from(list("0123456789") + ["٣", "３", "²", "①", "߁", "𝟗", "Ⅻ", "+", "-", ".", "e", "E", " ",
                                                  "_", "x", "\u00a0"])
number_texts = (st.text(DIGITISH, min_size=1, max_size=12) | st.sampled_from(["nan", "inf", "-inf", "1e999", "0x10",
                                                                               "1_000"])
                | st.integers(0, 10 ** 60).map(str) | st.integers(0, 4).map(lambda n: "9" * (10 ** n)))
GENERATE = {"--width": True, "--height": True, "--steps": True, "--seed": True, "--batch": True, "--cfg": False,
            "--strength": False}
QUEUE = {"--seed": True, "--per-server": True, "--timeout": False, "--server-timeout": False}
ASCII_WHOLE = r"[+-]?[0-9]+"
ASCII_REAL = r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?"


def reads_as(text: str, whole: bool) -> bool:
    """The independent expectation: plain ASCII digits (with a point and exponent for reals), at most 40 long; space
    around them (any Unicode space, as str.strip() sees it) is no part of the number."""
    text = text.strip()
    return len(text) <= 40 and re.fullmatch(ASCII_WHOLE if whole else ASCII_REAL, text, re.ASCII) is not None


def parse(parser, argv, capsys):
    """(namespace, None) or (None, what argparse printed) for exit 2; anything else raised fails the test."""
    try:
        return parser.parse_args(argv), None
    except SystemExit as e:
        assert e.code == 2
        return None, capsys.readouterr().err


@SETTINGS
@given(text=number_texts, data=st.data())
def test_every_numeric_option_takes_ascii_numbers_alone(text, data, capsys):
    """Draws a text of ASCII and other digits, digit-like signs, signs, points, exponents, spaces and numbers of up to
    10,000 digits for each numeric option of both commands: it is taken (as the number int() / float() read) exactly
    when it is ASCII digits of at most 40 characters and finite, else refused by the usage line naming the option.
    Before, "١٢" was taken as 12, and --expand "²" ended in a ValueError traceback."""
    assume(text != "--")                          # argparse's own marker: "--width=--" leaves --width unset
    command = data.draw(st.sampled_from(["generate", "queue"]))
    options = GENERATE if command == "generate" else QUEUE
    option = data.draw(st.sampled_from(sorted(options)))
    whole = options[option]
    parser = cli.build_parser() if command == "generate" else queue_command.options("q")
    base = ["--prompt", "x"] if command == "generate" else [str(TEXT_TO_IMAGE)]
    args, err = parse(parser, [*base, f"{option}={text}"], capsys)
    expected = reads_as(text, whole)
    value = (int(text) if whole else float(text)) if expected else None
    in_range = expected and math.isfinite(value)
    if command == "queue" and in_range:          # the queue options have ranges of their own
        in_range = {"--seed": 0 <= value <= batch_jobs.MAX_SEED, "--per-server": 1 <= value <= batch.MAX_PER_SERVER,
                    "--timeout": value > 0, "--server-timeout": value > 0}[option]
    if in_range:
        assert err is None, err
        assert getattr(args, option[2:].replace("-", "_")) == value
    else:
        assert args is None and f"argument {option}: {option} must" in err, err


@SETTINGS
@given(sides=st.lists(number_texts, min_size=4, max_size=4))
def test_expand_reads_its_four_sides_with_the_same_parser(sides):
    """Draws four side texts as above: the sides come back rounded up to the grid, or a Flux2Error names the side."""
    names = ["LEFT", "TOP", "RIGHT", "BOTTOM"]
    try:
        got = inpaint.parse_expand(",".join(sides))
    except Flux2Error as e:
        wrong = [name for name, side in zip(names, sides) if "," in side or not reads_as(side, True)
                 or not 0 <= int(side) <= 8192]
        assert wrong or "adds nothing" in str(e) or "four whole numbers" in str(e), str(e)
        assert not wrong or "four whole numbers" in str(e) or f"expand's {wrong[0]} pixels" in str(e), str(e)
        return
    assert got == tuple(-(-int(side) // 16) * 16 for side in sides)


def test_a_batch_lines_size_takes_ascii_digits_alone():
    assert batch_jobs.parse_size("768x1024", "line 1") == (768, 1024)
    for size in ("７６８x1024", "٧٦٨x1024", "768x1024²"):
        with pytest.raises(Flux2Error, match='line 1: "size"'):
            batch_jobs.parse_size(size, "line 1")


# --- options checked in one mode only ---------------------------------------------------------------------------------

@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(option=st.sampled_from(["--per-server", "--server-timeout", "--timeout"]),
       value=st.sampled_from(["0", "-1", "65", "1000", "nan", "1e999", "٣", "2", "0.5", "1"]))
def test_one_prompt_and_a_batch_check_an_option_alike(fakes, tmp_path_factory, capsys, option, value):
    """Draws an option of the queue command and a value, right or wrong: one prompt and a batch of two refuse or take
    it alike. Before, --per-server 0 and --server-timeout 0 were refused in a batch and ignored with one prompt."""
    server = fakes()
    out = tmp_path_factory.mktemp("o")
    outcomes = []
    for prompts in (["one"], ["one", "two"]):
        argv = [str(TEXT_TO_IMAGE), "--server", server.address, "--out", str(out), f"{option}={value}",
                *(a for p in prompts for a in ("--prompt", p))]
        try:
            code = queue_command.main(argv)
        except SystemExit as e:
            code = e.code
        err = capsys.readouterr().err
        # refused: argparse's usage exit, or the option named with "must" on one line. A run that took the option may
        # still fail (0.5 s is short on a loaded machine), and its "--timeout SECONDS waits longer" is no refusal
        refused = code == 2 or re.search(rf"{re.escape(option)}\b[^\n]* must ", err) is not None
        outcomes.append("refused" if refused else "taken")
    assert outcomes[0] == outcomes[1], (option, value, outcomes)


def test_server_timeout_drops_a_hung_server_with_one_prompt_too(fakes, tmp_path, capsys):
    """--server-timeout was read only by batches: one prompt on a server that hangs waited the whole --timeout."""
    hangs = fakes()
    hangs.hang_after = 0                          # answers the prompt, then nothing (not even pings)
    start = time.monotonic()
    code = queue_command.main([str(TEXT_TO_IMAGE), "--server", hangs.address, "--prompt", "x", "--out",
                               str(tmp_path), "--timeout", "600", "--server-timeout", "1"])
    assert code == 1 and time.monotonic() - start < 30
    err = capsys.readouterr().err
    assert "stopped answering" in err or "no answer within 1 s" in err, err


# --- one server written two ways ----------------------------------------------------------------------------------

hosts = (st.ip_addresses(v=4).map(str) | st.ip_addresses(v=6).map(lambda a: f"[{a}]")
         | st.from_regex(r"[a-z][a-z0-9-]{0,10}(\.[a-z][a-z0-9-]{0,10}){0,2}", fullmatch=True))


@st.composite
def written_another_way(draw, host: str, port: int) -> str:
    """The same server as a user may write it: case, a final dot, a scheme, a slash, zeros before the port, an IPv6
    address written out in full."""
    if host.startswith("["):
        address = ipaddress.ip_address(host[1:-1])
        host = f"[{draw(st.sampled_from([address.compressed, address.exploded, address.exploded.upper()]))}]"
    elif not host[0].isdigit():
        host = "".join(c.upper() if draw(st.booleans()) else c for c in host) + draw(st.sampled_from(["", "."]))
    text = f"{host}:{'0' * draw(st.integers(0, 3))}{port}"
    return draw(st.sampled_from(["", "http://"])) + text + draw(st.sampled_from(["", "/"]))


@settings(max_examples=300, deadline=None)
@given(data=st.data(), host=hosts, port=st.integers(1, 65535))
def test_one_server_written_two_ways_is_one_server(data, host, port):
    """Draws a host (IPv4, IPv6, a name) and a port, written two ways: both name one server, and a batch given both
    is refused as given twice. Before, 127.0.0.1:08188 and 127.0.0.1:8188 were two servers."""
    assume(not host.startswith("[") or ipaddress.ip_address(host[1:-1]).ipv4_mapped is None)
    a, b = data.draw(written_another_way(host, port)), data.draw(written_another_way(host, port))
    assert queue_client.parse_server(a) == queue_client.parse_server(b)
    name = queue_client.parse_server(a)[1]
    assert name.endswith(f":{port}") and name.lower() == name
    with pytest.raises(Flux2Error, match="is given twice"):
        batch.check_servers([a, b])


def test_the_single_prompt_and_the_batch_paths_name_the_server_alike(fakes, tmp_path, capsys):
    """The canonical name is what messages and the manifest show."""
    server = fakes()
    port = server.address.rsplit(":", 1)[1]
    code = queue_command.main([str(TEXT_TO_IMAGE), "--server", f"127.0.0.1:0{port}", "--prompt", "x", "--out",
                               str(tmp_path)])
    assert code == 0 and "queued prompt" in capsys.readouterr().err
    code = queue_command.main([str(TEXT_TO_IMAGE), "--server", f"127.0.0.1:0{port}", "--prompt", "x", "--prompt",
                               "y", "--out", str(tmp_path / "b")])
    assert code == 0
    records = json.loads((tmp_path / "b" / "manifest.json").read_text())["jobs"]
    assert {record["server"] for record in records} == {f"127.0.0.1:{port}"}
