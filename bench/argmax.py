"""The device argmax (``argmax_rows``, schedules/kernels/sampling.py) at a decode step's row counts, a thread's loads
issued one at a time (the form before 1375756) against eight at a time (the compiled form), runtime-only TVM there.

  python bench/argmax.py prepare DIR                                    # here: build both for sm_90
  python bench/argmax.py run DIR --json OUT --commit SHA                # there: time them, check them against torch

Each call is timed warm (the logits in the L2, as right after the LM head) with the VM's time evaluator.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

VOCAB = 50304  # OLMoE's
LOADS = {"loads1": 1, "loads8": 8}


def build_module():
    import tvm
    from tvm import relax

    from moec.schedules.kernels.sampling import make_argmax

    bb = relax.BlockBuilder()
    for name, loads in LOADS.items():
        prim = make_argmax(VOCAB, "float32", "cuda", "int32", loads).without_attr("global_symbol").with_attr("op_pattern", 8)
        gv = bb.add_func(prim, f"argmax_{name}")
        n = tvm.tirx.Var("n", "int64")
        x = relax.Var("x", relax.TensorType((1, n, VOCAB), "float32"))
        with bb.function(name, [x]):
            with bb.dataflow():
                y = bb.emit_output(relax.call_tir(gv, [x], out_ty=relax.TensorType([1, n], "int32")))
            bb.emit_func_output(y)
    return bb.get()


def prepare(out: Path) -> None:
    import tvm

    from moec.compiler.artifact import atomic_directory
    from moec.compiler.build import _compile_cuda_kernels
    from moec.compiler.targets import make_target
    from moec.passes.pipeline import lowering_pipeline

    target = make_target("cuda", "sm_90")
    with atomic_directory(out) as tmp:
        ex = tvm.compile(build_module(), target=target, relax_pipeline=lowering_pipeline(target, list(LOADS)))
        kernels = _compile_cuda_kernels(ex, target, tmp, progress=True)
        ex.export_library(str(tmp / "lib.so"))
        (tmp / "index.json").write_text(json.dumps({"cuda_kernels": kernels}, indent=2))


def run(root: Path, json_out: Path | None, commit: str) -> int:
    import numpy as np
    import torch
    import tvm
    from tvm.runtime.vm import VirtualMachine

    from moec.runtime.engine import _load_cuda_runtime, _register_fatbins

    _load_cuda_runtime()
    _register_fatbins(root, json.loads((root / "index.json").read_text()))
    dev = tvm.cuda(0)
    vm = VirtualMachine(tvm.runtime.load_module(str(root / "lib.so")), dev)
    points, ok = [], True
    for n in (1, 16, 64, 128):
        g = torch.Generator(device="cuda").manual_seed(n)
        x = torch.randn(1, n, VOCAB, device="cuda", generator=g)
        x[0, 0, 7] = x[0, 0, VOCAB - 3] = 100.0  # a tie: the first index wins
        want = x.argmax(-1).int().cpu().numpy()
        row = {"rows": n}
        for name in LOADS:
            arg = tvm.runtime.from_dlpack(x)
            got = vm[name](arg).numpy()
            row[f"{name}_correct"] = bool(np.array_equal(got, want))
            ok &= row[f"{name}_correct"]
            timer = vm.time_evaluator(name, dev, number=200, repeat=5)
            row[f"{name}_us"] = round(float(np.median(timer(arg).results)) * 1e6, 2)
        points.append(row)
        print(json.dumps(row), flush=True)
    doc = {"benchmark": "argmax", "vocab": VOCAB, "points": points, "passed": ok, "git_commit": commit,
           "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
           "command": f"here: python bench/argmax.py prepare {root}; there (carry .devcarry/base, {root}): source bench/device_env.sh && "
                      + " ".join(["python3", "bench/argmax.py", *sys.argv[1:]])}
    if json_out:
        Path(json_out).write_text(json.dumps(doc, indent=2))
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("dir", type=Path)
    r = sub.add_parser("run")
    r.add_argument("dir", type=Path)
    r.add_argument("--json", type=Path)
    r.add_argument("--commit", default="unknown")
    a = ap.parse_args()
    if a.cmd == "prepare":
        prepare(a.dir)
        return 0
    return run(a.dir, a.json, a.commit)


if __name__ == "__main__":
    sys.exit(main())
