"""The ``moec`` command line: parses arguments and calls the typed Python API.

Bad input gets a one-line reason on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from .errors import MoecError


def _print_args(args) -> None:
    shown = {k: v for k, v in vars(args).items() if k != "func"}
    print(f"[moec] {args.command}: " + " ".join(f"{k}={v}" for k, v in shown.items() if k != "command"), flush=True)


def cmd_compile(args) -> int:
    from .build import compile as moec_compile

    _print_args(args)
    moec_compile(args.model, args.output, target=args.target, arch=args.arch, debug_dump=args.debug_dump, progress=True,
                 kv_cache_dtype=args.kv_cache_dtype)
    return 0


def cmd_inspect(args) -> int:
    from .importers import import_model
    from .moe_structure import analyze

    imported = import_model(args.model)
    structure = analyze(imported.main, imported.num_inputs, imported.source_name)
    if args.json:
        print(json.dumps(structure.to_dict(), indent=2))
    else:
        print(f"{imported.source_name}: {imported.source_kind} model, {structure.num_layers} layers, {len(structure.moe_layers)} MoE")
        print(structure.table())
    return 0


def cmd_generate(args) -> int:
    from ..runtime.engine import load

    engine = load(args.artifact, device=args.device)
    prompts = [[int(t) for t in p.split(",") if t.strip()] for p in args.prompt_ids]
    t0 = time.perf_counter()
    out = engine.generate(prompts, args.max_new_tokens)
    dt = time.perf_counter() - t0
    for p, o in zip(prompts, out):
        print(json.dumps({"prompt": p, "generated": o}))
    print(f"[moec] {sum(map(len, out))} tokens in {dt * 1e3:.1f} ms", file=sys.stderr)
    return 0


def cmd_demo(args) -> int:
    from ..demo import run_demo

    return run_demo(args.model, args.output, target=args.target, arch=args.arch, device=args.device,
                    batch=args.batch, new_tokens=args.new_tokens)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moec", description="Compile MoE language models into decode engines on Apache TVM.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("compile", help="compile an ONNX (.onnx) or torch.export (.pt2) MoE model into an artifact directory")
    p.add_argument("model", help="path to model.onnx or model.pt2 (exported with dynamic batch and sequence axes)")
    p.add_argument("-o", "--output", required=True, help="artifact directory to write (atomically)")
    p.add_argument("--target", choices=["llvm", "cuda"], default="llvm")
    p.add_argument("--arch", default=None, help="CUDA architecture, e.g. sm_90 (default for --target cuda)")
    p.add_argument("--debug-dump", default=None, help="write the IR after each pipeline phase into this directory")
    p.add_argument("--kv-cache-dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="element type of the paged KV cache (default: the model's dtype)")
    p.set_defaults(func=cmd_compile)

    p = sub.add_parser("inspect", help="print the recognised MoE structure of a model as a table")
    p.add_argument("model")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("generate", help="greedy generation from a compiled artifact")
    p.add_argument("artifact")
    p.add_argument("--prompt-ids", nargs="+", required=True, help="one comma-separated list of token ids per prompt")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("demo", help="export a built-in reference MoE, compile it, load it and generate, printing timings")
    p.add_argument("--model", default="tiny", help="named reference config (default: tiny)")
    p.add_argument("-o", "--output", default="artifacts/demo", help="artifact directory")
    p.add_argument("--target", choices=["llvm", "cuda"], default="llvm")
    p.add_argument("--arch", default=None)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=32)
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except MoecError as exc:
        print(f"moec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("moec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
