"""The ``moec`` command line: parses arguments and calls the typed Python API.

Bad input gets a one-line reason on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import numpy as np

from .errors import MoecError


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _bytes(text: str) -> int:
    """A byte count: digits, optionally with K, M, G or T (powers of 1024) and a trailing B."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1:] if t[-1:] in _UNITS else ""
    try:
        value = float(t[: len(t) - len(unit)])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r} (e.g. 40G, 512M, 1073741824)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"not a positive byte count: {text!r}")
    return int(value * _UNITS[unit])


def _print_args(args) -> None:
    shown = {k: v for k, v in vars(args).items() if k not in ("func", "argv")}
    print(f"[moec] {args.command}: " + " ".join(f"{k}={v}" for k, v in shown.items() if k != "command"), flush=True)


def cmd_compile(args) -> int:
    from .build import compile as moec_compile

    _print_args(args)
    tiered = None
    if args.kv_cache in ("fp8", "tiered"):
        from ..passes.tiered_kv_attention import TieredOptions

        tiered = TieredOptions(mode=args.kv_cache, t1_page=args.t1_page, t2_page=args.t2_page, sink=args.sink, recent=args.recent,
                               tier1_fraction=args.tier1_fraction, rerank_every=args.rerank_every, importance=args.importance,
                               t2_fit=args.t2_fit, decode_kernel=args.decode_kernel, prefill_kernel=args.prefill_kernel)
    moec_compile(args.model, args.output, target=args.target, arch=args.arch, debug_dump=args.debug_dump, progress=True,
                 kv_cache_dtype=args.kv_cache_dtype, kv_cache=args.kv_cache, tiered_options=tiered,
                 cascade_groups=args.cascade_groups, cascade_keep=args.cascade_keep,
                 fuse_router_norm=args.fuse_router_norm, calibration=args.calibration,
                 grouped_experts=args.grouped_experts, expert_weights=args.expert_weights, tuning_db=args.tuning_db,
                 expert_slots=args.expert_slots, gpu_memory_budget=args.gpu_memory_budget,
                 dense_gemm=args.dense_gemm, rms_norm=args.rms_norm, cuda_graph=_graph_bounds(args),
                 prefill_gemm=args.prefill_gemm, pdl=args.pdl)
    if args.report_schedules:
        from ..schedules.rules import format_schedule_report
        from .artifact import read_manifest

        print(format_schedule_report(read_manifest(args.output, verify=False)["schedules"]))
    return 0


def _graph_bounds(args):
    """``--cuda-graph`` / ``--no-cuda-graph`` with the bounds as ``moec.compile``'s ``cuda_graph``; neither: the default
    (on for --target cuda unless the experts are offloaded)."""
    from ..passes.cuda_graph import GraphBounds
    from .build import graphs_by_default

    if args.cuda_graph is False:
        return False
    if args.cuda_graph is None and not graphs_by_default(args.target, args.expert_slots is not None
                                                         or args.gpu_memory_budget is not None):
        return False

    return GraphBounds(max_batch=args.graph_max_batch, max_context=args.graph_max_context)


def cmd_tune(args) -> int:
    from ..schedules.tune import tune

    _print_args(args)
    only = [x for x in args.only.split(",") if x] if args.only else None
    res = tune(args.model, target=args.target, arch=args.arch, trials=args.trials, buckets=args.buckets, database=args.db,
               workers=args.workers, only=only, dry_run=args.dry_run, strategy=args.strategy, progress=True,
               kv_cache=args.kv_cache, fuse_router_norm=args.fuse_router_norm, grouped_experts=args.grouped_experts,
               cascade_groups=args.cascade_groups, cascade_keep=args.cascade_keep)
    if args.dry_run:
        print("\n".join(res["tasks"]))
    print(f"[moec] {res['database']}: {res['tuned']} tasks tuned ({res['trials']} new trials, "
          f"{res.get('baselines', 0)} rule schedules measured as records), {res['skipped']} already "
          f"tuned, of {len(res['tasks'])}; {res['seconds']:.1f}s")
    return 0


def cmd_schedules(args) -> int:
    import tempfile

    from ..schedules.rules import format_schedule_report
    from .artifact import MANIFEST, read_manifest
    from .build import compile as moec_compile

    path = Path(args.model)
    if path.is_dir() and (path / MANIFEST).is_file():
        manifest = read_manifest(path, verify=False)
        if "schedules" not in manifest:
            raise MoecError(f"{path}: the manifest has no schedule report (built before moec recorded one); recompile it")
        sources = manifest["schedules"]
    else:
        with tempfile.TemporaryDirectory(prefix="moec-schedules-") as tmp:
            moec_compile(path, Path(tmp) / "artifact", target=args.target, arch=args.arch, tuning_db=args.tuning_db,
                         kv_cache=args.kv_cache, fuse_router_norm=args.fuse_router_norm,
                         grouped_experts=args.grouped_experts)
            sources = read_manifest(Path(tmp) / "artifact", verify=False)["schedules"]
    print(json.dumps(sources, indent=2) if args.json else format_schedule_report(sources))
    return 0


def cmd_calibrate(args) -> int:
    from .calibrate import calibrate, format_summary, load_calibration

    _print_args(args)
    groups = [int(x) for x in args.groups.split(",") if x.strip()] if args.groups else None
    out = calibrate(args.model, args.data, args.output, groups=groups, corpus=args.corpus, context=args.context,
                    max_tokens=args.max_tokens or None, check_every=args.check_every, batch_size=args.batch_size,
                    seed=args.seed, progress=True, device=args.device)
    print(format_summary(load_calibration(out)))
    print(f"[moec] wrote {out}")
    return 0


def cmd_inspect(args) -> int:
    from .importers import import_model
    from .moe_structure import analyze

    imported = import_model(args.model)
    structure = analyze(imported.main, imported.num_inputs, imported.source_name).find_windows(
        imported.main, imported.num_inputs, imported.source_name)
    if args.json:
        print(json.dumps(structure.to_dict(), indent=2))
    else:
        print(f"{imported.source_name}: {imported.source_kind} model, {structure.num_layers} layers, {len(structure.moe_layers)} MoE")
        print(structure.table())
    return 0


def cmd_generate(args) -> int:
    from ..runtime.engine import load
    from ..runtime.sampling import SamplingParams
    from ..runtime.scheduler import Request, Scheduler

    engine = load(args.artifact, device=args.device)
    try:
        prompts = [[int(t) for t in p.split(",") if t.strip()] for p in args.prompt_ids]
        stop = [int(t) for t in args.stop_ids.split(",") if t.strip()] if args.stop_ids else []
    except ValueError as exc:
        raise MoecError(f"--prompt-ids / --stop-ids take comma-separated integers: {exc}") from None
    sched = Scheduler(engine)
    handles = [sched.submit(Request(p, args.max_new_tokens, stop, rid=i, sampling=SamplingParams(
        args.temperature, args.top_k, args.top_p, None if args.seed is None else args.seed + i))) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    for rid, token in sched.stream():  # tokens as they come: "<prompt index>\t<token>"
        print(f"{rid}\t{token}", flush=True)
    dt = time.perf_counter() - t0
    for p, h in zip(prompts, handles):
        print(json.dumps({"prompt": p, "generated": h.tokens, "finish_reason": h.finish_reason}))
    print(f"[moec] {sum(len(h.tokens) for h in handles)} tokens in {dt * 1e3:.1f} ms", file=sys.stderr)
    return 0


def cmd_demo(args) -> int:
    from ..demo import run_demo

    return run_demo(args.model, args.output, target=args.target, arch=args.arch, device=args.device,
                    batch=args.batch, new_tokens=args.new_tokens)


def cmd_corpus(args) -> int:
    from ..models.corpus import build_corpus

    _print_args(args)
    corpus = build_corpus(args.output, args.tokenizer, args.vocab_size, args.heldout_percent)
    sp = corpus.meta["splits"]
    print(f"[moec] corpus {corpus.id}: train {sp['train']['files']} files / {sp['train']['tokens']} tokens, "
          f"held-out {sp['heldout']['files']} files / {sp['heldout']['tokens']} tokens, "
          f"unigram held-out perplexity {corpus.meta['unigram_heldout_perplexity']:.3f}")
    return 0


def cmd_train_reference(args) -> int:
    from ..models.train import train_reference

    _print_args(args)
    export = tuple(x for x in args.export.split(",") if x) if args.export != "none" else ()
    train_reference(args.size, args.output, seed=args.seed, device=args.device, steps=args.steps,
                    corpus_dir=args.corpus, export=export, seq_len=args.seq_len, batch_size=args.batch_size)
    print(f"[moec] wrote {args.output}")
    return 0


def cmd_eval(args) -> int:
    from ..models.corpus import load_corpus
    from ..models.evaluate import evaluate, format_report, load_subject
    from ..models.train import corpus_of

    _print_args(args)
    subject = load_subject(args.model, device=args.device, mode=args.mode, batch_size=args.batch_size)
    reference = load_subject(args.reference, device=args.device, mode=args.mode, batch_size=args.batch_size) if args.reference else None
    if args.corpus:
        corpus = load_corpus(args.corpus)
    else:
        trained = next((s for s in (subject, reference) if s is not None and hasattr(s, "meta")), None)
        if trained is None:
            raise MoecError("an artifact does not record its tokenizer: give --corpus DIR or --reference TRAINED_MODEL_DIR")
        corpus = corpus_of(trained.meta)
    tokens = None
    split = args.data
    if args.data not in ("heldout", "train"):
        path = Path(args.data)
        files = sorted(path.rglob("*.py")) + sorted(path.rglob("*.txt")) if path.is_dir() else [path]
        if not files or not all(f.is_file() for f in files):
            raise MoecError(f"{path}: --data is neither 'heldout', 'train' nor a readable text file or directory")
        ids = []
        for f in files:
            ids += corpus.tokenizer.encode(f.read_text(errors="replace")) + [corpus.tokenizer.eot_id]
        tokens, split = np.asarray(ids, dtype=np.int64), "heldout"
    report = evaluate(subject, corpus, split, context=args.context, stride=args.stride, max_tokens=args.max_tokens or None,
                      reference=reference, tokens=tokens)
    report["command"] = "moec " + " ".join(shlex.quote(a) for a in args.argv)
    print(format_report(report))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moec", description="Compile MoE language models into decode engines on Apache TVM.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("compile", help="compile an ONNX (.onnx) or torch.export (.pt2) MoE model into an artifact directory")
    p.add_argument("model", help="path to model.onnx or model.pt2 (exported with dynamic batch and sequence axes)")
    p.add_argument("-o", "--output", required=True, help="artifact directory to write (atomically)")
    p.add_argument("--target", choices=["llvm", "cuda"], default="llvm")
    p.add_argument("--arch", default=None, help="CUDA architecture, e.g. sm_90 (default for --target cuda)")
    p.add_argument("--debug-dump", default=None, help="write the IR after each pipeline phase into this directory")
    p.add_argument("--kv-cache", choices=["paged", "bf16", "fp8", "tiered"], default="paged",
                   help="paged: paged cache of --kv-cache-dtype elements; bf16: paged bfloat16; tiered: FP8 pages for "
                        "the important tokens, 2-bit pages for the rest, re-ranked every --rerank-every steps; fp8: "
                        "the tiered cache with every token in FP8")
    p.add_argument("--kv-cache-dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="element type of the paged KV cache (default: the model's dtype)")
    g = p.add_argument_group("tiered KV cache (--kv-cache tiered|fp8)")
    g.add_argument("--tier1-fraction", type=float, default=0.15, help="share of each sequence's tokens kept in FP8")
    g.add_argument("--rerank-every", type=int, default=16, help="decode steps between re-ranks")
    g.add_argument("--sink", type=int, default=4, help="first tokens always kept in FP8 (attention sinks)")
    g.add_argument("--recent", type=int, default=64, help="newest tokens always kept in FP8")
    g.add_argument("--t1-page", type=int, default=16, help="tokens per FP8 page")
    g.add_argument("--t2-page", type=int, default=128, help="tokens per 2-bit page (a multiple of the head dimension)")
    g.add_argument("--importance", choices=["mass", "keynorm", "random"], default="mass",
                   help="re-rank score: attention mass over the uniform share, the cached key's norm, or random "
                        "(a baseline for comparison)")
    g.add_argument("--decode-kernel", choices=["split", "split-half2", "split-fields", "split-mma", "split-paired", "ragged"],
                   default="split",
                   help="decode attention: the split kernel in the CUDA form measured faster for the model's heads (tensor "
                        "cores from 4 query heads per KV head, else half2), or that kernel with the 2-bit codes summed in "
                        "float16 pairs, in float32, or on tensor cores (head_dim 128), or both tiers in float16 pairs "
                        "(split-paired); or the prefill kernels")
    g.add_argument("--prefill-kernel", choices=["auto", "tensor-cores", "tiled"], default="auto",
                   help="CUDA prefill attention and importance sums: tensor cores (mma.sync, the model's bfloat16 or "
                        "float16 as operands), tiled float32 dot products, or auto: tensor cores for 16-bit models")
    g.add_argument("--t2-fit", choices=["lloyd", "moments"], default="lloyd",
                   help="2-bit statistics of a demoted page: least-squares refit to the codes' levels (lower error) "
                        "or the plain mean and standard deviation")
    g = p.add_argument_group("cascade gating (off unless --cascade-groups is given)")
    g.add_argument("--cascade-groups", type=int, default=None, metavar="G",
                   help="split each MoE layer's experts into G equal groups (data-free: balanced clustering of the "
                        "router rows); a coarse router picks each token's best groups and only their experts are "
                        "scored. G must divide the expert count")
    g.add_argument("--cascade-keep", type=int, default=None, metavar="g",
                   help="groups kept per token, 1..G (default: the calibration's choice for G, a group-limited "
                        "router's own kept groups, else G); g = G reproduces the original routing")
    g.add_argument("--calibration", default=None, metavar="CALIB_DIR",
                   help="from `moec calibrate` (made for this model): groups and coarse routers for G instead of "
                        "the data-free ones, and with offloaded experts the fitted prefetch predictors")
    p.add_argument("--fuse-router-norm", action=argparse.BooleanOptionalAction, default=True,
                   help="compute each router matmul (the coarse one with cascade gating) in one kernel with the "
                        "RMSNorm before it (default: on; same results up to float rounding)")
    p.add_argument("--grouped-experts", action=argparse.BooleanOptionalAction, default=True,
                   help="run the routed experts as grouped expert GEMMs: tokens sorted by expert, each active "
                        "expert's weights read once (default: on; --no-grouped-experts keeps the export's form)")
    p.add_argument("--expert-weights", choices=["bf16", "fp8"], default=None,
                   help="store the grouped experts' weights as bf16, or FP8 e4m3 with per-output-channel scales "
                        "(default: the model's dtype)")
    p.add_argument("--expert-slots", type=int, default=None, metavar="N",
                   help="offload the routed experts: their weights stay in host memory and the device holds N expert "
                        "slots (at least one layer's experts), filled as each layer's router chooses, least recently "
                        "used slots reused; for models whose experts do not fit in device memory. With --expert-weights "
                        "fp8 the host holds and copies FP8 codes and scales: about half the bytes of bf16 per copy")
    p.add_argument("--gpu-memory-budget", type=_bytes, default=None, metavar="BYTES",
                   help="device memory for the weights (e.g. 40G, 512M or a byte count): if they do not fit, the "
                        "experts are offloaded into as many slots as remain after the other weights (the KV cache is "
                        "not counted)")
    p.add_argument("--dense-gemm", action=argparse.BooleanOptionalAction, default=True,
                   help="run linear layers with a transposed bf16/fp16 weight (attention projections, LM head) as "
                        "dense GEMM kernels (tensor cores on CUDA) that read the weight as stored (default: on)")
    p.add_argument("--prefill-gemm", choices=["auto", "streamed", "tiled"], default="auto",
                   help="CUDA prefill GEMMs (dense projections and experts): streamed, the decode kernels' forms with "
                        "64-token passes over each weight; tiled, 128 tokens x 128 rows a block with both operands in "
                        "shared memory; auto (default): dense projections tiled, experts streamed")
    p.add_argument("--rms-norm", action=argparse.BooleanOptionalAction, default=True,
                   help="run each RMSNorm not fused with a router as one kernel, one pass over the row (default: on)")
    p.add_argument("--tuning-db", default="auto", metavar="auto|PATH|none",
                   help="MetaSchedule records from `moec tune`: auto (default) uses the target's database in the moec "
                        "cache if there is one; kernels without records keep the dlight rules")
    g = p.add_argument_group("CUDA graphs (--target cuda)")
    g.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="also build the decode step as CUDA graphs (captured once per batch size and table widths, then "
                        "replayed: no per-kernel launch or VM work); the engine uses them for steps within the bounds. "
                        "Default: on for --target cuda unless the experts are offloaded (--expert-slots, "
                        "--gpu-memory-budget)")
    g.add_argument("--graph-max-batch", type=int, default=128, help="most streams in a step the graphs serve (memory is "
                                                                      "planned for it; default 128)")
    g.add_argument("--graph-max-context", type=int, default=4096,
                   help="most tokens of one stream the graphs serve (sizes the tiered page tables; default 4096)")
    p.add_argument("--pdl", action="store_true",
                   help="CUDA sm_90+, fp8 and tiered caches: launch every kernel with programmatic dependent launch "
                        "(each waits for the grid before it in its first instruction, so the next launch overlaps the "
                        "kernel before it); measured slower at the headline point on an H100, so off by default")
    p.add_argument("--report-schedules", action="store_true", help="print each kernel's schedule source afterwards")
    p.set_defaults(func=cmd_compile)

    p = sub.add_parser("tune", help="tune the model's kernels with MetaSchedule at static token/batch buckets")
    p.add_argument("model", help="path to model.onnx or model.pt2 (as for compile)")
    p.add_argument("--target", choices=["llvm", "cuda"], default="llvm")
    p.add_argument("--arch", default=None, help="CUDA architecture, e.g. sm_90 (default for --target cuda)")
    p.add_argument("--trials", type=int, default=64, help="MetaSchedule trials per task")
    p.add_argument("--buckets", default="1,16,128", help="token/batch sizes to tune at (prefill tokens, decode batch)")
    p.add_argument("--db", default=None, help="database directory (default: <moec cache>/tuning/<target key>/)")
    p.add_argument("--workers", type=int, default=1, help="builder processes (0: build in this process)")
    p.add_argument("--strategy", choices=["evolutionary", "replay-trace"], default="evolutionary",
                   help="MetaSchedule search: evolutionary with a cost model, or random samples of the space")
    p.add_argument("--only", default=None, metavar="NAME[,NAME]", help="tune only kernels whose name contains one of these")
    p.add_argument("--dry-run", action="store_true", help="list the tasks (e.g. for cuda without a GPU) and tune nothing")
    p.add_argument("--kv-cache", choices=["paged", "bf16", "fp8", "tiered"], default="paged",
                   help="as the model will be compiled (the kernels depend on it)")
    p.add_argument("--fuse-router-norm", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--grouped-experts", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--cascade-groups", type=int, default=None, metavar="G")
    p.add_argument("--cascade-keep", type=int, default=None, metavar="g")
    p.set_defaults(func=cmd_tune)

    p = sub.add_parser("schedules", help="list each kernel of a compiled model with its schedule source")
    p.add_argument("model", help="an artifact directory (reads its manifest) or a model file (compiled to a temporary directory)")
    p.add_argument("--target", choices=["llvm", "cuda"], default="llvm")
    p.add_argument("--arch", default=None)
    p.add_argument("--tuning-db", default="auto", metavar="auto|PATH|none")
    p.add_argument("--kv-cache", choices=["paged", "bf16", "fp8", "tiered"], default="paged")
    p.add_argument("--fuse-router-norm", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--grouped-experts", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--json", action="store_true", help="print the kernel -> source map as JSON")
    p.set_defaults(func=cmd_schedules)

    p = sub.add_parser("calibrate", help="fit cascade-gating groups, coarse routers and expert-prefetch predictors on "
                                         "calibration text")
    p.add_argument("model", help="trained model directory (PyTorch reference) or model.onnx / model.pt2")
    p.add_argument("-o", "--output", required=True, help="calibration directory to write (atomically)")
    p.add_argument("--data", default="train",
                   help="'train' / 'heldout' (corpus split), a .npy / .bin token file, or a text file / directory")
    p.add_argument("--corpus", default=None, help="corpus directory (default: the one a trained model used)")
    p.add_argument("--groups", default=None, metavar="G[,G...]",
                   help="group counts to calibrate (default: every divisor of the expert count from 2 to E/2)")
    p.add_argument("--context", type=int, default=1024, help="window length in tokens")
    p.add_argument("--max-tokens", type=int, default=65536, help="tokens to run (0: all of the data)")
    p.add_argument("--check-every", type=int, default=10, help="every N-th window is held out of the fit for the check")
    p.add_argument("--batch-size", type=int, default=4, help="windows run together")
    p.add_argument("--seed", type=int, default=0, help="seed of the partition's random starts")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where a trained model directory runs")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("inspect", help="print the recognised MoE structure of a model as a table")
    p.add_argument("model")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("generate", help="generate from a compiled artifact, streaming tokens (continuous batching)")
    p.add_argument("artifact")
    p.add_argument("--prompt-ids", nargs="+", required=True, help="one comma-separated list of token ids per prompt")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--stop-ids", default=None, help="comma-separated token ids that end a stream")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample among the most likely tokens up to this mass")
    p.add_argument("--seed", type=int, default=None, help="prompt i samples with seed SEED + i (default: unseeded)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("corpus", help="build the offline text corpus (stdlib sources, split by file) with its tokenizer")
    p.add_argument("-o", "--output", required=True, help="corpus directory to write")
    p.add_argument("--tokenizer", choices=["bytes", "bpe"], default="bytes")
    p.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size")
    p.add_argument("--heldout-percent", type=int, default=5, help="share of files held out (by hash of path)")
    p.set_defaults(func=cmd_corpus)

    p = sub.add_parser("train-reference", help="train the reference MoE on the stdlib corpus (tiny: CPU minutes, small: GPU)")
    p.add_argument("--size", choices=["tiny", "small"], default="tiny")
    p.add_argument("-o", "--output", required=True, help="directory for weights, config, tokenizer and exports")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=None, help="override the size's number of optimisation steps")
    p.add_argument("--seq-len", type=int, default=None, help="override the size's training sequence length (the "
                   "evaluation context is capped to it)")
    p.add_argument("--batch-size", type=int, default=None, help="override the size's sequences per step")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available")
    p.add_argument("--corpus", default=None, help="corpus directory (default: built once in the moec cache)")
    p.add_argument("--export", default="onnx,pt2", help="comma-separated exports to write (onnx, pt2) or 'none'")
    p.set_defaults(func=cmd_train_reference)

    p = sub.add_parser("eval", help="held-out perplexity, next-token agreement and routing statistics")
    p.add_argument("model", help="trained model directory (PyTorch) or compiled artifact directory")
    p.add_argument("--reference", default=None, help="a second model or artifact scored on the same windows (deltas)")
    p.add_argument("--data", default="heldout", help="'heldout', 'train', or a text file / directory of .py/.txt files")
    p.add_argument("--corpus", default=None, help="corpus directory (default: the one the trained model used)")
    p.add_argument("--context", type=int, default=1024, help="window length in tokens")
    p.add_argument("--stride", type=int, default=None, help="targets scored per window (default: context / 2)")
    p.add_argument("--max-tokens", type=int, default=65536, help="targets to score (0: the whole split)")
    p.add_argument("--mode", choices=["prefill", "decode"], default="prefill",
                   help="artifacts: score from prefill logits, or from decode steps over the KV cache")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--batch-size", type=int, default=None, help="windows scored together")
    p.add_argument("--json", default=None, help="write the report as JSON here")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("demo", help="export a built-in reference MoE, compile it, load it and generate, printing timings")
    p.add_argument("--model", default="tiny", help="named reference config (default: tiny)")
    p.add_argument("-o", "--output", default="artifacts/demo", help="artifact directory")
    p.add_argument("--target", choices=["llvm", "cuda"], default="llvm")
    p.add_argument("--arch", default=None)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=32)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("bench", help="decode latency (TPOT, TTFT) of moec and HF transformers side by side, on the "
                                     "same random weights, over a grid of streams x contexts; JSON and a PNG plot")
    p.add_argument("--shape", default="tiny-olmoe", help="named model shape: olmoe-1b-7b, mixtral-8x7b, tiny-olmoe, tiny-mixtral")
    p.add_argument("--streams", default="1,16,64,128", help="comma-separated concurrent streams")
    p.add_argument("--contexts", default="512,1024,2048,4096", help="comma-separated context lengths (tokens)")
    p.add_argument("--systems", default="moec-bf16,moec-fp8,moec-tiered,hf-compile",
                   help="comma-separated: moec-paged, moec-bf16, moec-fp8, moec-tiered (on CUDA with CUDA graphs, as "
                        "moec compile's default; each also as moec-<cache>-nograph: built with --no-cuda-graph, and "
                        "moec-<cache>-offload / -prefetch: experts offloaded into "
                        "--expert-slots slots, loaded on demand / also prefetched; -offload-fp8 / -prefetch-fp8: the "
                        "same with FP8 experts; moec-<cache>-fp8experts: experts stored as FP8, all resident; "
                        "moec-<cache>-ptiled / -pstreamed: --prefill-gemm tiled / streamed; moec-fp8-pdl, moec-tiered-pdl and "
                        "their -fp8experts forms: --pdl), "
                        "moec-tiered-fields (--decode-kernel "
                        "split-fields), moec-tiered-half2 / -mma / -paired (--decode-kernel split-half2 / split-mma / "
                        "split-paired), hf-eager, hf-compile")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32", help="weights")
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per point")
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers (default: the shape's); fewer give the per-layer split of a step in less time")
    p.add_argument("--tie-layers", action="store_true",
                   help="every decoder layer uses the first layer's weights: a step reads as many weight bytes as the "
                        "full model, while host memory, disk and artifacts hold one layer (for shapes that do not fit)")
    p.add_argument("--synthetic-kv", action="store_true",
                   help="moec tiered and fp8 systems: no prefill; the caches are filled with random entries as a prefill of "
                        "each context would leave them, and decode is timed over them (TTFT not measured); for shapes whose "
                        "prefill takes too long here")
    p.add_argument("--profile", action="store_true",
                   help="moec systems: the last decode step of each point runs untimed with every kernel timed alone "
                        "(the point's 'profile': top kernels, VM helpers, host share), and so does one prefill chunk of a fresh "
                        "stream after the point; on CUDA one more step and chunk run under the device activity tracer "
                        "('trace': each kernel's own time, the device's busy and idle time in the step)")
    p.add_argument("--expert-slots", type=int, default=None, metavar="N",
                   help="moec-<cache>-offload and -prefetch systems: the device slots of the offloaded experts")
    p.add_argument("--sync-steps", action="store_true",
                   help="moec systems: each decode step ends with its tokens on the host before the next starts (default: "
                        "pipelined, the next step enqueued before the previous step's tokens are read back)")
    p.add_argument("--prefill-chunk", type=int, default=None, metavar="TOKENS",
                   help="moec systems: prompt tokens per prefill call (default 2048); prompts are packed into calls of "
                        "that many tokens, so a larger chunk prefills several streams per call")
    p.add_argument("--prefetch-gate", choices=("auto", "off"), default="auto",
                   help="-prefetch systems: auto (default) copies ahead only the predicted experts whose expected saving "
                        "exceeds the cost of a wrong copy; off copies every predicted expert")
    p.add_argument("--work", default="/tmp/moec-bench", help="exports and compiled artifacts are kept here")
    p.add_argument("--json", required=True)
    p.add_argument("--plot", default=None, help="PNG of TPOT against context")
    p.add_argument("--commit", default=None, help="git commit to record (default: this checkout's HEAD)")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("bench-merge", help="one bench result (JSON and PNG) from several runs of the same shape, dtype "
                                           "and device, e.g. one system per run")
    p.add_argument("files", nargs="+", help="`moec bench --json` files")
    p.add_argument("--json", required=True, help="merged result to write")
    p.add_argument("--plot", default=None, help="PNG of TPOT against context, every system")
    p.set_defaults(func=cmd_bench_merge)
    return parser


def cmd_bench(args) -> int:
    from .serve_bench import main as bench_main

    return bench_main(args)


def cmd_bench_merge(args) -> int:
    from .serve_bench import main_merge

    return main_merge(args)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
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
