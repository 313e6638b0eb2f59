"""What `moec tune` buys: the whole decode step compiled with the schedule rules alone against the same model
compiled with a MetaSchedule database tuned in the same run.

    python bench/tune_decode.py --shape olmoe-1b-7b --device cuda --trials 8 --buckets 1,128 \
        --streams 128 --context 512 --json tune_decode.json

The model is a named `moec bench` shape with seeded random weights (HF's class), exported with
torch.export (reusing ``--work``'s ``model.pt2`` when there is one, e.g. the one `moec bench` wrote).
It runs `moec tune` into a fresh database in ``--work``, then compiles twice: ``--tuning-db none``
(the rules: dlight and the hand-written kernels) and that database. Each engine prefills the same
``--streams`` random prompts of ``--context - steps`` tokens and decodes ``--steps`` greedy steps, the two engines
taking turns step by step (drift in clocks or host load falls on both alike);
the JSON gives the median step time of each, the tasks, the trials and records applied, and the time
tuning took. The hand-written kernels (experts, dense GEMMs, norm + router, attention) are not tuned:
the tasks are the rest. ``--layers`` shortens the model (the tasks do not depend on the depth).
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


def _decode_ms(arts: dict, device: str, prompts: np.ndarray, steps: int) -> dict:
    """Prefill the same prompts into each artifact's engine, then decode ``steps`` greedy steps, the engines taking
    turns step by step (so clock and thermal drift fall on all of them alike); per engine the median step time."""
    import moec

    engines, state = {}, {}
    for name, art in arts.items():
        e = engines[name] = moec.load(art, device=device, max_batch=len(prompts),
                                      max_total_tokens=len(prompts) * (prompts.shape[1] + steps + 16))
        seqs, logits = e.prefill([list(p) for p in prompts])
        state[name] = [seqs, logits.argmax(-1), []]
    for _ in range(steps):
        for name, e in engines.items():
            seqs, nxt, times = state[name]
            t = time.perf_counter()
            state[name][1] = e.decode_greedy(seqs, list(nxt))
            times.append(time.perf_counter() - t)
    out = {}
    for name, e in engines.items():
        seqs, nxt, times = state[name]
        ms = 1e3 * np.asarray(times[1:] if steps > 2 else times)  # the first step may still load modules
        out[name] = {"step_ms_median": float(np.median(ms)), "step_ms_min": float(ms.min()),
                     "last_tokens": [int(x) for x in nxt], "tuning_applied": e.manifest["tuning"]["applied"]}
        for s in seqs:
            e.release(s)
    return out


def main(argv=None) -> int:
    import moec
    from moec.compiler.serve_bench import SHAPES, build_hf
    from moec.models.export import save_pt2
    from moec.schedules.tune import tune

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="olmoe-1b-7b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="keep this many layers of the shape")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--kv-cache", default="tiered", choices=["bf16", "fp8", "tiered", "paged"])
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--buckets", default="1,128")
    ap.add_argument("--streams", type=int, default=128)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--work", default="/tmp/moec-bench")
    ap.add_argument("--json", required=True)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--strategy", default="evolutionary", choices=["evolutionary", "replay-trace"])
    ap.add_argument("--workers", type=int, default=0, help="builder processes (0: build in the tuning process)")
    ap.add_argument("--only", default=None, help="tune only kernels whose name contains one of these (comma-separated)")
    ap.add_argument("--tune-timeout", type=float, default=None,
                    help="seconds: run `moec tune` in a child process and stop it then (the database keeps what it measured)")
    a = ap.parse_args(argv)
    target = "cuda" if a.device == "cuda" else "llvm"
    family, kw = SHAPES[a.shape]
    shape = a.shape
    if a.layers is not None:
        shape = f"{a.shape}-{a.layers}l"
        SHAPES[shape] = (family, {**kw, "num_hidden_layers": a.layers})
    work = Path(a.work) / f"{shape}-{a.dtype}"
    work.mkdir(parents=True, exist_ok=True)
    pt2 = work / "model.pt2"
    if not pt2.exists():
        model = build_hf(shape, a.dtype, "cpu")
        save_pt2(model, model.config.vocab_size, pt2, max_seq=a.context + a.steps + 8)
        vocab = model.config.vocab_size
        del model
    else:
        vocab = SHAPES[shape][1]["vocab_size"]
    from moec.compiler.importers import import_model

    source = import_model(pt2)
    db = work / f"tuning-{target}-{a.kv_cache}"
    shutil.rmtree(db, ignore_errors=True)
    t = time.perf_counter()
    timed_out = False
    if a.tune_timeout is None:
        tuned = tune(source, target=target, trials=a.trials, buckets=a.buckets, database=db, workers=a.workers,
                     progress=True, kv_cache=a.kv_cache, strategy=a.strategy, only=a.only.split(",") if a.only else None)
    else:  # `moec tune` in a child process, stopped after the timeout: the compile uses what its database holds by then
        listed = tune(source, target=target, trials=a.trials, buckets=a.buckets, database=db, dry_run=True,
                      progress=False, kv_cache=a.kv_cache, only=a.only.split(",") if a.only else None)
        cmd = [sys.executable, "-m", "moec.compiler.cli", "tune", str(pt2), "--target", target, "--trials", str(a.trials),
               "--buckets", a.buckets, "--db", str(db), "--workers", str(a.workers), "--kv-cache", a.kv_cache,
               "--strategy", a.strategy] + (["--only", a.only] if a.only else [])
        try:
            subprocess.run(cmd, check=True, timeout=a.tune_timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            print(f"[tune_decode] tuning stopped after {a.tune_timeout} s", flush=True)
        from moec.schedules.database import read_meta

        done = read_meta(db).get("tasks", {})
        tuned = {"buckets": listed["buckets"], "tasks": listed["tasks"], "tuned": len(done),
                 "trials": sum(int(v.get("records", 0)) for v in done.values())}
    tune_s = time.perf_counter() - t
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, vocab, (a.streams, a.context - a.steps))
    arts = {}
    for name, spec in (("rules", "none"), ("tuned", str(db))):
        art = arts[name] = work / f"art-tune-{name}-{a.kv_cache}-{target}"
        shutil.rmtree(art, ignore_errors=True)
        moec.compile(source, art, target=target, kv_cache=a.kv_cache, tuning_db=spec, progress=True)
    runs = _decode_ms(arts, a.device, prompts, a.steps)
    for name, r in runs.items():
        print(f"[tune_decode] {name}: decode step {r['step_ms_median']:.3f} ms ({r['tuning_applied']} tuned kernels)",
              flush=True)
    commit = a.commit or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                        cwd=Path(__file__).resolve().parent).stdout.strip()
    if a.device == "cuda":
        import torch

        device = torch.cuda.get_device_name(0)
    else:
        device = platform.processor() or platform.machine()
    doc = {"benchmark": "tune_decode", "command": "python bench/tune_decode.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "git_commit": commit, "device": device, "shape": shape, "kv_cache": a.kv_cache, "streams": a.streams,
           "context": a.context, "decode_steps": a.steps,
           "tuning": {"trials_per_task": a.trials, "strategy": a.strategy, "only": a.only, "buckets": tuned["buckets"], "tasks": len(tuned["tasks"]),
                      "tuned": tuned.get("tuned"), "new_trials": tuned.get("trials"), "seconds": tune_s,
                      "timed_out": timed_out, "baseline_errors": tuned.get("baseline_errors", {})},
           "rules": runs["rules"], "tuned": runs["tuned"],
           "speedup": runs["rules"]["step_ms_median"] / runs["tuned"]["step_ms_median"],
           "same_tokens": runs["rules"]["last_tokens"] == runs["tuned"]["last_tokens"]}
    Path(a.json).write_text(json.dumps(doc, indent=2))
    print(f"[tune_decode] rules {runs['rules']['step_ms_median']:.3f} ms, tuned {runs['tuned']['step_ms_median']:.3f} ms "
          f"({doc['speedup']:.2f}x), same tokens: {doc['same_tokens']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
