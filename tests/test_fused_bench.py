"""What the GPU session runs to measure the fused kernels (flux2_core/storage/kernels.py): bench/gpu-check's stages pair
every quantized storage (GGUF Q4_K and Q8_0, fp8) with and without them beside the plain bf16 stage, bench.py's
--ours-no-fused reaches the worker as FLUX2_NO_FUSED, and the report's "Steps against bf16" table divides each stage's
steps by the bf16 stage's."""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import os
import sys
from pathlib import Path

from bench import bench

ROOT = Path(__file__).resolve().parents[1]


def gpu_check():
    """bench/gpu-check (a script without .py) as a module, registered first as its dataclasses need."""
    if "gpu_check" not in sys.modules:
        loader = importlib.machinery.SourceFileLoader("gpu_check", str(ROOT / "bench" / "gpu-check"))
        module = importlib.util.module_from_spec(importlib.util.spec_from_loader("gpu_check", loader))
        sys.modules["gpu_check"] = module
        loader.exec_module(module)
    return sys.modules["gpu_check"]


def options(stage) -> tuple[str, ...]:
    """A bench stage's --ours-* flags and --ours-gguf's type."""
    cmd = stage.command
    return tuple(a for i, a in enumerate(cmd) if a.startswith("--ours") or cmd[i - 1] == "--ours-gguf")


def test_each_quantized_storage_runs_with_and_without_the_fused_kernels(tmp_path):
    check = gpu_check()
    stages = {s.name: options(s) for s in check.bench_stages(False, tmp_path, tmp_path)}
    assert stages["bench klein-4b distilled"] == ()
    runs = set(stages.values())
    for storage in (("--ours-gguf", "Q4_K"), ("--ours-gguf", "Q8_0"), ("--ours-fp8",)):
        assert storage in runs and (*storage, "--ours-no-fused") in runs, storage
    smoke = [s.name for s in check.bench_stages(True, tmp_path, tmp_path)]
    assert not [name for name in smoke if "no fused" in name or "Q8_0" in name]


def test_the_report_gives_each_stage_s_steps_against_bf16(tmp_path):
    check = gpu_check()

    def stage(name, config, steps):
        return check.Stage(name, 1, figures={"configs": {config: {"ours": {"median": {"steps": steps}}}}})

    stages = [check.Stage("tests", 1, figures={"passed": 3}), stage("bench klein-4b distilled", "klein-4b", 0.4),
              stage("bench klein-4b GGUF", "klein-4b", 0.5), stage("bench klein-4b fp8 no fused", "klein-4b", 0.44),
              stage("bench klein-9b-KV edit", "klein-9b", 2.0)]
    assert check.step_ratios(stages) == [
        "| stage | our steps (median, s) | / bf16 distilled |", "|---|---|---|",
        "| bench klein-4b distilled | 0.400 | 1.00x |", "| bench klein-4b GGUF | 0.500 | 1.25x |",
        "| bench klein-4b fp8 no fused | 0.440 | 1.10x |"]
    assert check.step_ratios(stages[2:]) == []                 # no bf16 stage ran: no ratios
    check.write_report(tmp_path / "r.md", {"device": "x"}, stages, "GPU run", "now")
    assert "## Steps against bf16" in (tmp_path / "r.md").read_text()


def test_no_fused_reaches_the_worker_as_flux2_no_fused(tmp_path, monkeypatch):
    """The driver passes --ours-no-fused to our worker's process, which sets FLUX2_NO_FUSED before loading."""
    commands = []

    def run(cmd, **kwargs):
        commands.append(cmd)
        Path(cmd[cmd.index("--out") + 1]).write_text(json.dumps({"side": "ours"}))

    monkeypatch.setattr(bench.subprocess, "run", run)
    args = argparse.Namespace(config=["tiny"], steps=2, size=64, repeats=1, device="cpu", dtype=None, cfg=None,
                              compile_backend="eager", **{o: False for o in bench.OURS_OPTIONS})
    args.ours_no_fused, args.ours_gguf = True, "Q8_0"
    bench.spawn(args, "ours", tmp_path / "ours.json", tmp_path)
    assert "--ours-no-fused" in commands[0] and commands[0][commands[0].index("--ours-gguf") + 1] == "Q8_0"

    seen = []
    monkeypatch.setenv("FLUX2_NO_FUSED", "")                   # restored (removed) after the test
    monkeypatch.setattr(bench, "worker", lambda args: seen.append(os.environ.get("FLUX2_NO_FUSED")))
    bench.main(["--worker", "ours", "--config", "tiny", "--ours-no-fused", "--out", str(tmp_path / "w.json")])
    assert seen == ["1"]


def test_the_parts_of_the_gpu_check_cover_every_stage_by_its_name(tmp_path, monkeypatch):
    """--part N selects one call's share by exact stage names: every GPU stage is in a part (a stage added without
    one would never run in a part-by-part session), no part names a stage that does not exist, and --only adds to a
    part."""
    check = gpu_check()
    monkeypatch.setenv("COMFYUI_DIR", str(tmp_path))            # the native stage exists either way; named alike
    names = {"tests", *(s.name for s in [*check.bench_stages(False, tmp_path, tmp_path),
                                          *check.flux3_stages(False, tmp_path),
                                          check.step_cache_stage(False, tmp_path, tmp_path),
                                          check.quant_formats_stage(False, tmp_path),
                                          check.native_stage(False, tmp_path)])}
    in_parts = set().union(*check.PARTS.values())
    assert in_parts == names, (names - in_parts, in_parts - names)
    assert check.selected("bench klein-4b fp8", None, 2) and not check.selected("bench klein-4b fp8 no fused", None, 2)
    assert check.selected("bench klein-4b fp8 no fused", ["no fused"], 2)
    assert not check.selected("bench klein-9b distilled", None, 1) and check.selected("anything", None, None)
    assert not check.selected("bench klein-4b fp8", ["int8"], None)


def test_a_part_of_the_gpu_check_is_refused_in_the_cpu_smoke_run(capsys):
    """The smoke run's stages have other names (tiny): --part there would select the tests alone, silently."""
    import pytest

    with pytest.raises(SystemExit):
        gpu_check().main(["--cpu-smoke", "--part", "1"])
    assert "use --only there" in capsys.readouterr().err
