"""Soak the continuous-batching scheduler: many decode steps with random arrivals and departures.

  python bench/soak.py ARTIFACT [ARTIFACT ...] [--steps 10000] [--seed 0] [--json OUT]

Requests arrive at random (prompt lengths from 1 token to past the cache, random max_new_tokens,
stop tokens and sampling parameters), some are cancelled while running, the rest leave on a stop
token or their length limit. Throughout: the cache's accounting is checked (paged: TVM's free page
count against the engine's lengths; tiered: ``TieredPageTables.check()``), every finished stream is
checked against its request, and the process RSS is sampled. At the end the arrivals stop, the
scheduler drains, and every page must be back. Each request that can never fit must be refused
with ``RequestRefused`` at submit, and only those (plus queue-full refusals when the queue is full).

Prints steps, streams served, refused, pages leaked, peak and final RSS; ``soak()`` is also the CI
test's short version (tests/runtime/test_scheduler.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _free_pages(engine) -> tuple[int, ...]:
    if engine.tiered is not None:
        t = engine.tiered.tables
        return (t.t1.free, t.t2.free)
    import tvm

    return (int(tvm.get_global_func("vm.builtin.attention_kv_cache_get_num_available_pages")(engine.cache)),)


def _check_cache(engine, sched) -> None:
    """The cache holds exactly the admitted streams, within the scheduler's reservations."""
    seqs = {s.seq for s in sched.running}
    assert set(engine.lengths) == seqs, (set(engine.lengths), seqs)
    for s in sched.running:
        assert engine.lengths[s.seq] == s.prefilled + max(0, len(s.tokens) - 1), (s, engine.lengths[s.seq])  # last token unfed
    if engine.tiered is not None:
        t = engine.tiered.tables
        t.check()
        # after each step's re-ranks every stream is within its reservation (the bound admission relies on)
        for s in sched.running:
            q = t.seqs[engine.tiered.slot[s.seq]]
            assert len(q.t1_pages) <= s.need[0] and len(q.t2_pages) <= s.need[1], (s, len(q.t1_pages), len(q.t2_pages), s.need)
    else:
        used = sum(math.ceil(n / engine.page_size) for n in engine.lengths.values())
        assert used <= sched.reserved[0] <= sched.capacity[0], (used, sched.reserved)


def soak(engine, steps: int = 10000, seed: int = 0, max_prompt: int | None = None, prefill_chunk: int = 48,
         max_queue: int = 12, check_every: int = 25, progress: bool = False) -> dict:
    """Run ``steps`` decode steps of random traffic through a ``Scheduler`` on ``engine``; returns stats.

    Raises ``AssertionError`` on any accounting, output or refusal error.
    """
    from moec.runtime.sampling import SamplingParams
    from moec.runtime.scheduler import Request, RequestRefused, Scheduler

    rng = np.random.default_rng(seed)
    sched = Scheduler(engine, prefill_chunk=prefill_chunk, max_queue=max_queue)
    total = engine.max_total_tokens
    max_prompt = max_prompt or total + total // 4
    free0 = _free_pages(engine)
    live: dict = {}
    stats = dict(submitted=0, refused_never_fit=0, refused_queue_full=0, cancelled=0, finished_stop=0,
                 finished_length=0, tokens=0)
    rss, t0, arrivals_open = [], time.perf_counter(), True

    def check_finished(h) -> None:
        r = h.request
        assert 1 <= len(h.tokens) <= r.max_new_tokens or h.finish_reason == "cancelled", h
        if h.finish_reason == "stop":
            assert h.tokens[-1] in r.stop_tokens and not set(h.tokens[:-1]) & set(r.stop_tokens), h
            stats["finished_stop"] += 1
        elif h.finish_reason == "length":
            assert len(h.tokens) == r.max_new_tokens and not set(h.tokens) & set(r.stop_tokens), h
            stats["finished_length"] += 1
        else:
            assert h.finish_reason == "cancelled", h

    while True:
        if arrivals_open and sched.decode_calls >= steps:
            arrivals_open = False  # drain
        if not arrivals_open and sched.idle:
            break
        if arrivals_open:
            for _ in range(rng.poisson(0.2)):
                big = rng.random() < 0.08
                n = int(rng.integers(total // 2, max_prompt + 1)) if big else int(rng.integers(1, 96))
                prompt = rng.integers(0, engine.vocab_size, n).tolist()
                new = int(rng.integers(1, 80))
                kind = rng.integers(0, 3)
                sp = (SamplingParams() if kind == 0 else
                      SamplingParams(temperature=float(rng.uniform(0.5, 1.5)), top_k=int(rng.integers(0, 40)),
                                     top_p=float(rng.uniform(0.5, 1.0)), seed=int(rng.integers(1 << 30))))
                stop = rng.integers(0, engine.vocab_size, int(rng.integers(0, 3))).tolist()
                req = Request(prompt, new, stop_tokens=stop, sampling=sp)
                never = n + new - 1 > total or any(a > c for a, c in zip(sched.pages_needed(n + new - 1), sched.capacity))
                queue_full = len(sched.queue) >= max_queue
                stats["submitted"] += 1
                try:
                    h = sched.submit(req)
                except RequestRefused as exc:
                    msg = str(exc)
                    assert f"request {req.rid!r} refused" in msg, msg
                    if never:
                        assert "can never fit" in msg, msg
                        stats["refused_never_fit"] += 1
                    else:
                        assert queue_full and "max_queue" in msg, msg
                        stats["refused_queue_full"] += 1
                    continue
                assert not never, f"request of {n} + {new} tokens should have been refused"
                live[h.rid] = h
            if sched.running and rng.random() < 0.01:  # a client goes away mid-stream
                victim = sched.running[int(rng.integers(len(sched.running)))]
                sched.cancel(victim.rid)
                stats["cancelled"] += 1
        events = sched.step()
        stats["tokens"] += len(events)
        for rid in [r for r, h in live.items() if h.done]:
            check_finished(live.pop(rid))
        if sched.steps % check_every == 0:
            _check_cache(engine, sched)
            rss.append(_rss_mb())
            if progress and sched.steps % (check_every * 40) == 0:
                print(f"[soak] step {sched.steps}: {sched.decode_calls} decode steps, {sched.served} served, "
                      f"{len(sched.running)} running, {len(sched.queue)} queued, rss {rss[-1]:.1f} MB", flush=True)
    assert not live and not engine.lengths and sched.reserved == [0, 0]
    free1 = _free_pages(engine)
    if engine.tiered is not None:
        engine.tiered.tables.check()
    leaked = sum(a - b for a, b in zip(free0, free1))
    warm = rss[len(rss) // 5:] or rss or [_rss_mb()]
    return dict(stats, steps=sched.steps, decode_steps=sched.decode_calls, prefill_calls=sched.prefill_calls,
                served=sched.served, pages_leaked=leaked, free_pages_before=free0, free_pages_after=free1,
                rss_peak_mb=round(max(warm), 1), rss_after_warmup_mb=round(warm[0], 1),
                rss_growth_mb=round(max(warm) - warm[0], 1), seconds=round(time.perf_counter() - t0, 2),
                cache=engine.kv_cache, reranks=engine.tiered.reranks if engine.tiered is not None else 0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifacts", nargs="+", help="artifact directories (e.g. a bf16 paged and a tiered one)")
    ap.add_argument("--steps", type=int, default=10000, help="decode steps with arrivals open")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-total-tokens", type=int, default=1024)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import moec

    results = []
    for art in args.artifacts:
        engine = moec.load(art, device="cpu", max_batch=args.max_batch, max_total_tokens=args.max_total_tokens,
                           prefill_chunk=64, page_size=16)
        res = soak(engine, args.steps, args.seed, progress=True)
        res["artifact"] = str(art)
        print(f"[soak] {art} ({res['cache']}): {res['decode_steps']} decode steps ({res['steps']} steps), "
              f"{res['served']} streams served ({res['finished_stop']} stop, {res['finished_length']} length, "
              f"{res['cancelled']} cancelled), {res['refused_never_fit']} over-large refused, "
              f"{res['refused_queue_full']} refused on a full queue, {res['reranks']} re-ranks, {res['pages_leaked']} pages leaked, "
              f"peak RSS {res['rss_peak_mb']} MB (+{res['rss_growth_mb']} MB after warm-up), {res['seconds']} s",
              flush=True)
        results.append(res)
        if res["pages_leaked"] or res["rss_growth_mb"] > 32:
            print("[soak] FAILED: pages leaked or memory grew", file=sys.stderr)
            return 1
    if args.json:
        import subprocess

        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip()
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"command": " ".join(["python", "bench/soak.py", *sys.argv[1:]]),
                                               "commit": commit, "device": "cpu", "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
