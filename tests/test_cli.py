"""The command line: exit codes, one-line errors, and no half-written artifact."""

import json
import os
import shutil
import subprocess
import sys

import pytest


def moec(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "moec.compiler.cli", *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=900)


def _no_partials(parent, name):
    return not [p for p in os.listdir(parent) if p.startswith(f".{name}.")]


def test_help_lists_commands():
    out = moec("--help")
    assert out.returncode == 0
    for cmd in ("compile", "inspect", "generate", "demo"):
        assert cmd in out.stdout


def test_inspect_prints_table(zoo):
    out = moec("inspect", zoo.source("hf-qwen2_moe", "onnx"))
    assert out.returncode == 0, out.stderr
    assert "softmax top-2/8" in out.stdout and "+gate" in out.stdout
    js = moec("inspect", zoo.source("tiny", "onnx"), "--json")
    assert json.loads(js.stdout)["num_moe_layers"] == 2


@pytest.mark.parametrize("case", ["missing", "truncated", "dense", "bad-arch", "graph-on-llvm", "bad-graph-bound"])
def test_compile_errors_exit_2_and_write_nothing(zoo, tmp_path, case):
    out_dir = tmp_path / "art"
    if case == "missing":
        src, extra = tmp_path / "nope.onnx", []
    elif case == "truncated":
        data = zoo.source("tiny", "onnx").read_bytes()
        src = tmp_path / "trunc.onnx"
        src.write_bytes(data[: len(data) // 2])
        extra = []
    elif case == "dense":
        from moec.models.export import save_onnx

        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "compiler"))
        from test_importers import Dense

        src, extra = save_onnx(Dense(), 32, tmp_path / "dense.onnx"), []
    elif case == "graph-on-llvm":
        src, extra = zoo.source("tiny", "onnx"), ["--cuda-graph"]
    elif case == "bad-graph-bound":
        src, extra = zoo.source("tiny", "onnx"), ["--target", "cuda", "--cuda-graph", "--graph-max-batch", "0"]
    else:
        src, extra = zoo.source("tiny", "onnx"), ["--target", "cuda", "--arch", "sm_9x"]
    res = moec("compile", src, "-o", out_dir, *extra)
    assert res.returncode == 2, res.stderr[-3000:]
    err = res.stderr.strip().splitlines()
    assert err and err[-1].startswith("moec: error:") and "Traceback" not in res.stderr
    assert not out_dir.exists() and _no_partials(tmp_path, "art")


def test_compile_refuses_when_the_disk_is_too_full(zoo, tmp_path, monkeypatch, capsys):
    """The weights' size is checked against the output file system's free space before anything is written."""
    from collections import namedtuple

    from moec.compiler.cli import main

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 << 30, 10 << 30, 1 << 20))
    out_dir = tmp_path / "sub" / "art"
    assert main(["compile", str(zoo.source("tiny", "onnx")), "-o", str(out_dir)]) == 2
    err = capsys.readouterr().err
    assert "not enough disk space for the artifact" in err and str(out_dir) in err and "0.00 GB free" in err
    assert not out_dir.exists()


def test_compile_replaces_existing_artifact_atomically(zoo, tmp_path):
    out_dir = tmp_path / "art"
    shutil.copytree(zoo.artifact("tiny", "onnx"), out_dir)
    data = zoo.source("tiny", "onnx").read_bytes()
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(data[:1000])
    assert moec("compile", bad, "-o", out_dir).returncode == 2
    assert (out_dir / "manifest.json").exists()  # the previous artifact is untouched
    res = moec("compile", zoo.source("tiny", "pt2"), "-o", out_dir)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads((out_dir / "manifest.json").read_text())["source"]["kind"] == "torch"
    assert _no_partials(tmp_path, "art")


def test_generate_and_edited_manifest(zoo, tmp_path):
    art = tmp_path / "art"
    shutil.copytree(zoo.artifact("tiny", "onnx"), art)
    ok = moec("generate", art, "--prompt-ids", "1,2,3", "4,5", "--max-new-tokens", "3")
    assert ok.returncode == 0, ok.stderr[-2000:]
    lines = [json.loads(line) for line in ok.stdout.splitlines() if line.startswith("{")]
    assert [len(x["generated"]) for x in lines] == [3, 3]
    m = json.loads((art / "manifest.json").read_text())
    m["model"]["num_layers"] = 3
    m["files"]["weights.safetensors"] = "f" * 64
    (art / "manifest.json").write_text(json.dumps(m))
    bad = moec("generate", art, "--prompt-ids", "1,2")
    assert bad.returncode == 2 and "SHA-256 does not match" in bad.stderr


def test_tune_dry_run_for_cuda_and_foreign_tuning_db(zoo, tmp_path):
    """``moec tune --target cuda`` lists its tasks without a GPU; compile refuses another target's database."""
    src = zoo.source("tiny", "onnx")
    dry = moec("tune", src, "--target", "cuda", "--arch", "sm_90", "--buckets", "1", "--dry-run", "--db", tmp_path / "db")
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert "matmul2@1" in dry.stdout.splitlines() and not (tmp_path / "db").exists()
    from moec.compiler.targets import make_target
    from moec.schedules.database import open_database

    open_database(tmp_path / "cuda-db", make_target("cuda", "sm_90"), create=True)
    bad = moec("compile", src, "-o", tmp_path / "art", "--tuning-db", tmp_path / "cuda-db")
    assert bad.returncode == 2 and str(tmp_path / "cuda-db") in bad.stderr.strip().splitlines()[-1]
    assert "Traceback" not in bad.stderr and not (tmp_path / "art").exists()
