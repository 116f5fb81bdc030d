"""The ``queue`` command: one API-format workflow, or a batch of jobs over one or more servers (``batch.py``), sent
to ComfyUI with ``queue_client``; pictures from this machine uploaded first (``uploads.py``)."""

from __future__ import annotations

import argparse
import sys

from ..errors import Flux2Error
from ..sampling.inpaint import MASK_READINGS
from . import queue_client
from .batch import MAX_PER_SERVER, batch_main
from .batch_jobs import MAX_SEED
from .option_types import number_option
from .outputs import check_folder
from .uploads import parse_pairs, plan_pictures, set_picture, upload


def options(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Queue an API-format workflow on a running ComfyUI server, show its progress and\n"
                    "download its images (never replacing a file). Batches: --batch FILE or --prompt\n"
                    "given several times, spread over one or more --server, resumable (a manifest in --out).",
        epilog=f"examples:\n  {prog} workflows/api/flux2-klein-text-to-image.json --server 127.0.0.1:8188 \\\n"
               '      --prompt "a red fox in the snow" --seed 7 --out output/\n'
               f"  {prog} workflows/api/flux2-klein-edit.json --image 10=photo.png --prompt \"make it night\"\n"
               f"  {prog} workflows/api/flux2-klein-edit.json --batch jobs.jsonl \\\n"
               "      --server 127.0.0.1:8188 --server 127.0.0.1:8189 --out edits/\n"
               'a --batch line: {"prompt": "...", "seed": 1, "size": "768x1024", "images": {"10": "a.png"},\n'
               '                 "masks": {"10": "hole.png"}, "set": {"6.steps": 8}, "id": "fox-1"} (all optional)')
    parser.add_argument("workflow", help="an API-format workflow, e.g. workflows/api/flux2-klein-text-to-image.json")
    parser.add_argument("--server", action="append", metavar="HOST:PORT",
                        help="where ComfyUI listens (default 127.0.0.1:8188; from another machine, ComfyUI must run "
                             "with --listen); repeatable: a batch goes to the server with the least queued work")
    parser.add_argument("--set", action="append", default=[], metavar="NODE.INPUT=VALUE",
                        help="set one input of one node (repeatable); VALUE is JSON or a plain string")
    parser.add_argument("--prompt", action="append", metavar="TEXT",
                        help="prompt text for the FLUX.2 Klein prompt-encode node feeding `positive`; repeatable: one "
                             "job per prompt")
    parser.add_argument("--seed", type=number_option("--seed", 0, MAX_SEED, whole=True),
                        help="seed for every node with a seed input")
    parser.add_argument("--image", action="append", default=[], metavar="NODE=PATH",
                        help="a picture from this machine for Load Image node NODE, uploaded to ComfyUI's input "
                             "folder under a name made from its bytes (repeatable)")
    parser.add_argument("--mask", action="append", default=[], metavar="NODE=PATH",
                        help="a mask for the --image of node NODE, read as --mask-reading says, becomes the "
                             "picture's alpha, which Load Image gives as the mask")
    parser.add_argument("--mask-reading", choices=list(MASK_READINGS), default="auto",
                        help="grey: white = repaint; alpha: transparent = repaint (as ComfyUI's mask editor); auto "
                             "(default): grey without transparency, else the reading both give, or a refusal asking")
    parser.add_argument("--out", default="output", metavar="DIR", help="folder for the downloaded images (default "
                        "output/); existing files are kept, a taken name gets -1, -2, ...")
    parser.add_argument("--timeout", type=number_option("--timeout", 0, above_low=True), default=600.0,
                        metavar="SECONDS",
                        help="how long to wait for any server answer (default 600)")
    batch = parser.add_argument_group("batches")
    batch.add_argument("--batch", metavar="FILE", help="JSON Lines, one job a line (see below); paths in it are "
                       "relative to the file. Done jobs are recorded in DIR/manifest.json: running the same "
                       "batch again skips them and retries the failed ones")
    batch.add_argument("--per-server", type=number_option("--per-server", 1, MAX_PER_SERVER, whole=True), default=2,
                       metavar="N",
                       help="jobs queued at once on each server (default 2: one runs while the next waits)")
    batch.add_argument("--server-timeout", type=number_option("--server-timeout", 0, above_low=True), default=60.0,
                       metavar="SECONDS",
                       help="a server that answers nothing (HTTP, websocket pings) for this long is dropped and its "
                            "jobs go to the others; with one prompt, the prompt fails (default 60)")
    return parser


def is_batch(args: argparse.Namespace) -> bool:
    return bool(args.batch) or len(args.prompt or ()) > 1 or len(args.server or ()) > 1


def main(argv=None, prog: str = "flux2-klein queue") -> int:
    args = options(prog).parse_args(argv)
    if is_batch(args):
        return batch_main(args)
    server = (args.server or ["127.0.0.1:8188"])[0]
    note = queue_client.note
    try:
        workflow = queue_client.load_workflow(args.workflow)
        workflow = queue_client.apply_overrides(workflow, args.set, (args.prompt or [None])[0], args.seed)
        if args.image or args.mask:
            workflow = upload_pictures(workflow, args, server)
        paths = queue_client.queue(workflow, server, args.out, args.timeout, on_saved=print,
                                   heartbeat=args.server_timeout)
    except Flux2Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        note("interrupted: a prompt already queued keeps running in ComfyUI (its images go to ComfyUI's output "
             "folder); cancel it in ComfyUI's queue if you do not want it")
        return 130
    note(f"{len(paths)} image(s) saved in {args.out}" if paths else
         "the prompt ran, but ComfyUI lists no images for it; does the workflow end in a SaveImage node?")
    return 0


def upload_pictures(workflow: dict, args: argparse.Namespace, server: str) -> dict:
    """The workflow with the --image (and --mask) files uploaded and their nodes set to the names ComfyUI gave."""
    pictures = plan_pictures(workflow, parse_pairs(args.image, "--image"), parse_pairs(args.mask, "--mask"),
                             mask_reading=args.mask_reading)
    check_folder(args.out, "--out")                  # every check before the first upload
    client = queue_client.ComfyClient(server, timeout=args.timeout, heartbeat=args.server_timeout)
    for node, picture in pictures.items():
        name = upload(client, picture)
        set_picture(workflow, node, name, f"--image {node}")
        queue_client.note(f"uploaded {picture.path} to ComfyUI at {client.server} as {name}")
    return workflow


if __name__ == "__main__":
    sys.exit(main())
