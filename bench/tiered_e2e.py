"""Models compiled with the tiered KV cache, on the GPU: correctness against the reference and quality at 4096.

  python bench/tiered_e2e.py prepare DIR --tiny TINY_MODEL_DIR --small SMALL.onnx --corpus BPE_CORPUS_DIR
        # here: compile CUDA (sm_90) artifacts; the small model's weights travel as float16 chunks
  python3 bench/tiered_e2e.py run DIR --json OUT --commit SHA      # GPU machine, runtime-only TVM

Part 1 (correctness): the trained tiny reference model compiled with ``--kv-cache fp8`` and
``--kv-cache tiered`` decodes two held-out windows (prefill 300 tokens, 100 teacher-forced steps with
re-ranks) on CUDA; its logits are compared with ``moec.models.kv_reference.TieredDecoder`` (same
policy, same formats) on the same tokens.

Part 2 (quality at 4096): the small reference model (BPE, trained on the GPU; its weights rounded to
float16 values so that they travel in half the bytes, the same weights for every row) compiled with
each cache: paged bf16, fp8, 2-bit (tiered with no FP8 budget, sink or window), tiered by importance
(attention mass over the uniform share, or the cached key's norm) and tiered by random choice at the
same budget. Each decodes the same held-out windows (prefill
``context - stride`` tokens, then ``stride`` teacher-forced decode steps) through the runtime engine;
the JSON holds each cache's perplexity and its change against bf16.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

TINY_MODES = ("fp8", "tiered")
TINY_POLICY = dict(sink=4, recent=32, rerank_every=8)
# name: (kv_cache, TieredOptions overrides)
SMALL_MODES = {
    "bf16": ("bf16", {}),
    "fp8": ("fp8", {}),
    "2bit": ("tiered", dict(tier1_fraction=0.0, sink=0, recent=0)),
    "tiered-mass": ("tiered", dict(importance="mass")),
    "tiered-keynorm": ("tiered", dict(importance="keynorm")),
    "tiered-random": ("tiered", dict(importance="random")),
}
CHUNK = 48 << 20


def _round_onnx(src: Path, dst: Path) -> None:
    """A copy of the ONNX model with every float32 initializer rounded to a float16 value."""
    import onnx
    from onnx import numpy_helper

    m = onnx.load(str(src))
    for init in m.graph.initializer:
        if init.data_type == onnx.TensorProto.FLOAT:
            a = numpy_helper.to_array(init)
            init.CopyFrom(numpy_helper.from_array(a.astype(np.float16).astype(np.float32), init.name))
    onnx.save(m, str(dst))


def prepare(out: Path, tiny: Path, small: Path | None, corpus: Path | None) -> None:
    import moec
    from moec.passes.tiered_kv_attention import TieredOptions

    out.mkdir(parents=True, exist_ok=True)
    (out / "tiny-model").mkdir(exist_ok=True)
    for f in ("config.json", "model.safetensors"):
        shutil.copy(tiny / f, out / "tiny-model" / f)
    from moec.models.train import corpus_of, load_trained

    toks = np.asarray(corpus_of(load_trained(tiny)[1]).tokens("heldout"))
    np.save(out / "tiny-windows.npy", np.stack([toks[1000:1401], toks[5000:5401]]))  # two held-out windows
    for mode in TINY_MODES:
        moec.compile(tiny / "model.onnx", out / f"tiny-{mode}", target="cuda", arch="sm_90", progress=True,
                     kv_cache=mode, tiered_options=TieredOptions(**TINY_POLICY))
    moec.compile(tiny / "model.onnx", out / "tiny-tiered-ragged", target="cuda", arch="sm_90", progress=True,
                 kv_cache="tiered", tiered_options=TieredOptions(decode_kernel="ragged", **TINY_POLICY))
    if small is None:
        return
    rounded = out / "small-f16.onnx"
    _round_onnx(small, rounded)
    for name, (kv, over) in SMALL_MODES.items():
        opts = TieredOptions(**over) if kv in ("fp8", "tiered") else None
        moec.compile(rounded, out / f"small-{name}", target="cuda", arch="sm_90", progress=True, kv_cache=kv, tiered_options=opts)
        if opts is not None:  # the fallback if the split decode kernel fails its check there
            moec.compile(rounded, out / f"small-{name}-ragged", target="cuda", arch="sm_90", progress=True, kv_cache=kv,
                         tiered_options=TieredOptions(decode_kernel="ragged", **over))
    rounded.unlink()
    # one float16 copy of the (identical) weights, in chunks: the safetensors header, then each tensor's
    # values as float16 in file order (exact: they are float16 values), rebuilt byte for byte there
    raw = (out / "small-bf16" / "weights.safetensors").read_bytes()
    hlen = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + hlen])
    (out / "small-weights.header").write_bytes(raw[:8 + hlen])
    blob = bytearray()
    for name, meta in sorted(((k, v) for k, v in header.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"][0]):
        a, b = meta["data_offsets"]
        if meta["dtype"] != "F32":  # integer constants travel as they are
            blob += raw[8 + hlen + a:8 + hlen + b]
            continue
        x = np.frombuffer(raw, np.float32, (b - a) // 4, 8 + hlen + a)
        if not np.array_equal(x.astype(np.float16).astype(np.float32), x):
            raise SystemExit(f"{name}: not float16 values")
        blob += x.astype(np.float16).tobytes()
    data = bytes(blob)
    for i in range(0, len(data), CHUNK):
        part = out.parent / f"{out.name}-w{i // CHUNK}"
        part.mkdir(exist_ok=True)
        (part / "part").write_bytes(data[i:i + CHUNK])
    for d in out.glob("small-*"):
        if (d / "weights.safetensors").exists():
            (d / "weights.safetensors").unlink()
    if corpus is not None:
        shutil.copytree(corpus, out / "corpus", dirs_exist_ok=True)  # load_corpus checks every file
    print(f"[bench] prepared {out}; weight chunks: {sorted(p.name for p in out.parent.glob(out.name + '-w*'))}")


def _restore_weights(root: Path, parts: Path) -> None:
    head = (root / "small-weights.header").read_bytes()
    header = json.loads(head[8:])
    blob = b"".join(p.read_bytes() for p in sorted(parts.glob("part*"), key=lambda p: int(p.name[4:] or 0)))
    # the stream holds the tensors back to back in file order (float32 ones as float16): walk it
    out = bytearray(head)
    pos = 0
    for _, meta in sorted(((k, v) for k, v in header.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"][0]):
        a, b = meta["data_offsets"]
        out += b"\0" * (len(head) + a - len(out))
        if meta["dtype"] != "F32":
            out += blob[pos:pos + b - a]
            pos += b - a
            continue
        n = (b - a) // 4
        out += np.frombuffer(blob, np.float16, n, pos).astype(np.float32).tobytes()
        pos += 2 * n
    for d in root.glob("small-*"):
        if d.is_dir():
            (d / "weights.safetensors").write_bytes(bytes(out))


def _tiny_check(root: Path) -> dict:
    from moec.models.kv_reference import TieredDecoder, TierPolicy
    from moec.models.train import load_trained
    from moec.runtime.engine import load

    model, _ = load_trained(root / "tiny-model")
    w = np.load(root / "tiny-windows.npy")
    n0, length = 300, w.shape[1]
    out = {}
    for name in TINY_MODES + ("tiered-ragged",):
        mode = name.split("-")[0]
        want = TieredDecoder(model, TierPolicy.named(mode, page_tokens=128, score="uniform", **TINY_POLICY)).run(w.copy(), n0)
        engine = load(root / f"tiny-{name}", device="cuda", max_batch=4, max_total_tokens=2048)
        t = time.perf_counter()
        seqs, first = engine.prefill([list(w[0, :n0]), list(w[1, :n0])])
        got = np.stack([first] + [engine.decode(seqs, list(w[:, i])) for i in range(n0, length - 1)], 1)
        err = np.abs(got - want)
        out[name] = {"max_abs_logit_error": float(err.max()), "mean_abs_logit_error": float(err.mean()),
                     "argmax_agreement": float((got.argmax(-1) == want.argmax(-1)).mean()),
                     "reranks": engine.tiered.reranks, "seconds": round(time.perf_counter() - t, 2)}
        # the CPU test's bounds (tests/passes/test_tiered_kv_attention.py), but for the fp8 mean: 5e-4
        # here, where float32 sums run in another order (measured on the H200: 1.2e-4)
        out[name]["passed"] = bool(err.max() < (1e-2 if mode == "fp8" else 0.1) and err.mean() < (5e-4 if mode == "fp8" else 1e-3)
                                   and out[name]["argmax_agreement"] > 0.99)
        print(f"[bench] tiny {name}: {out[name]}", flush=True)
    return out


def run(root: Path, parts: Path | None, json_out: Path, commit: str, context: int, stride: int, max_tokens: int) -> int:
    import torch

    from moec.models.corpus import load_corpus
    from moec.models.evaluate import ArtifactSubject, evaluate

    result = {"benchmark": "tiered_e2e", "command": " ".join(["python3"] + sys.argv), "git_commit": commit,
              "device": torch.cuda.get_device_name(0), "host": platform.node(), "python": platform.python_version()}
    try:
        result["tiny_vs_reference"] = tiny = _tiny_check(root)
        split_ok = tiny["fp8"]["passed"] and tiny["tiered"]["passed"]
    except Exception as exc:  # noqa: BLE001 - recorded: the fallback decode kernel is then used
        result["tiny_vs_reference"] = {"error": repr(exc)[:2000]}
        split_ok = False
    result["decode_kernel"] = "split" if split_ok else "ragged"
    if parts is not None:
        _restore_weights(root, parts)
        corpus = load_corpus(root / "corpus")
        rows = {}
        for name in SMALL_MODES:
            art = root / (f"small-{name}" if split_ok or name == "bf16" else f"small-{name}-ragged")
            subject = ArtifactSubject(art, device="cuda", mode="decode", batch_size=16)
            t = time.perf_counter()
            try:
                rep = evaluate(subject, corpus, "heldout", context=context, stride=stride, max_tokens=max_tokens)
            except Exception as exc:  # noqa: BLE001 - recorded, the other rows still run
                rows[name] = {"error": repr(exc)[:2000]}
                print(f"[bench] small {name}: {rows[name]}", flush=True)
                continue
            rows[name] = {"perplexity": rep["perplexity"], "artifact": art.name, "seconds": round(time.perf_counter() - t, 1),
                          "tier1_share": float(np.mean(subject.tier1_share)) if subject.tier1_share else None}
            print(f"[bench] small {name}: {rows[name]}", flush=True)
        base = rows["bf16"].get("perplexity")
        for r in rows.values():
            if base and "perplexity" in r:
                r["perplexity_delta_vs_bf16"] = r["perplexity"] / base - 1
        result["quality"] = {"model": "small reference (BPE 4096), weights rounded to float16 values", "context": context,
                             "stride": stride, "tokens_scored": max_tokens, "rows": rows}
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("out", type=Path)
    p.add_argument("--tiny", type=Path, required=True)
    p.add_argument("--small", type=Path, default=None)
    p.add_argument("--corpus", type=Path, default=None)
    p = sub.add_parser("run")
    p.add_argument("root", type=Path)
    p.add_argument("--parts", type=Path, default=None, help="directory holding the weight chunks part0, part1, ...")
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--commit", default=None)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--stride", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=8192)
    args = ap.parse_args()
    if args.cmd == "prepare":
        prepare(args.out, args.tiny, args.small, args.corpus)
        return 0
    commit = args.commit or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    return run(args.root, args.parts, args.json, commit, args.context, args.stride, args.max_tokens)


if __name__ == "__main__":
    sys.exit(main())
