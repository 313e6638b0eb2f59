"""Continuous batching on CPU (llvm): join/leave, chunked prefill, batch-independent outputs, sampling, refusals, soak."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

import moec
from moec.compiler.errors import MoecError
from moec.runtime.engine import CacheExhausted
from moec.runtime.sampling import Sampler, SamplingParams
from moec.runtime.scheduler import Request, RequestRefused, Scheduler

ROOT = Path(__file__).resolve().parents[2]
RNG = np.random.default_rng(7)
PROMPTS = [RNG.integers(0, 256, n).tolist() for n in (37, 5, 70, 1, 20, 12)]


@pytest.fixture(scope="module")
def arts(zoo, tmp_path_factory):
    """fp32 paged (the zoo's), bf16 paged and tiered artifacts of the tiny model."""
    from moec.passes.tiered_kv_attention import TieredOptions

    root = tmp_path_factory.mktemp("sched")
    src = zoo.source("tiny", "onnx")
    return {"fp32": zoo.artifact("tiny", "onnx"), "bf16": moec.compile(src, root / "bf16", kv_cache="bf16"),
            "tiered": moec.compile(src, root / "tiered", kv_cache="tiered",
                                   tiered_options=TieredOptions(t2_page=64, sink=2, recent=16, rerank_every=4))}


def _alone(art, prompt, n, **kw):
    return moec.load(art, **kw).generate([prompt], n)[0]


@pytest.mark.parametrize("cache", ["fp32", "bf16"])
def test_staggered_greedy_streams_equal_each_stream_alone(arts, cache):
    """Streams arrive between decode steps, prompts are prefilled in chunks interleaved with decoding
    (several chunks for the long ones) and leave at different times: each stream's greedy tokens are
    those of the same prompt generated alone by ``Engine.generate``."""
    art = arts[cache]
    new = [9, 4, 12, 7, 3, 10]
    want = [_alone(art, p, n) for p, n in zip(PROMPTS, new)]
    sched = Scheduler(moec.load(art, max_batch=4, max_total_tokens=1024), prefill_chunk=16)
    arrive = {0: [0, 1], 2: [2], 3: [3, 4], 9: [5]}  # step -> requests arriving before it
    handles, overlap = {}, False
    while len(handles) < len(PROMPTS) or not sched.idle:
        for i in arrive.get(sched.steps, []):
            handles[i] = sched.submit(Request(PROMPTS[i], new[i], rid=f"r{i}"))
        states = {s.state for s in sched.running}
        overlap |= {"prefill", "decode"} <= states  # a new arrival prefills while others decode
        sched.step()
        for h in handles.values():  # a stream that left holds no pages any more
            assert h.seq is None if h.state in ("done", "queued") else h.seq in sched.engine.lengths
    assert overlap and sched.prefill_calls > len(PROMPTS)  # chunked: more prefill calls than prompts
    for i, h in handles.items():
        assert h.tokens == want[i], f"stream {i}"
        assert h.finish_reason == "length"
    assert not sched.engine.lengths and sched.reserved == [0, 0]


def test_tiered_streams_do_not_depend_on_the_batch(arts):
    """The tiered cache re-ranks a stream after its own prefill calls and every ``rerank_every`` of its own decode
    steps (past 64 decoded tokens, so pages are demoted while decoding), so staggered arrivals give each stream the
    greedy tokens it gets alone, its prompt prefilled in one call either way (the scheduler's chunking of prompts
    that arrive together depends on the batch, and where a prefill is cut changes what is demoted)."""
    art = arts["tiered"]
    prompts = [RNG.integers(0, 256, n).tolist() for n in (300, 180, 420, 90, 260, 350)]  # long enough to demote
    new = [130, 70, 140, 100, 80, 120]  # past 64 decoded tokens: demotions between prefills (t2_page 64)

    def sched():
        return Scheduler(moec.load(art, max_batch=4, max_total_tokens=4096), prefill_chunk=512)  # prompts unsplit

    want = [sched().generate([Request(p, n, rid="x")])["x"] for p, n in zip(prompts, new)]
    s = sched()
    arrive = {0: [0, 1], 2: [2], 3: [3, 4], 9: [5]}
    handles = {}
    while len(handles) < len(prompts) or not s.idle:
        for i in arrive.get(s.steps, []):
            handles[i] = s.submit(Request(prompts[i], new[i], rid=f"r{i}"))
        s.step()
    assert s.engine.tiered.reranks > len(prompts)
    for i, h in handles.items():
        assert h.tokens == want[i], f"stream {i}"


def test_join_leave_stop_tokens_and_waiting_for_room(arts):
    """A stop token ends a stream at once; a request that does not fit *now* waits in the queue
    (first come, first served) and runs when pages come back; cancel frees a running stream."""
    art = arts["fp32"]
    ref = _alone(art, PROMPTS[0], 8)
    engine = moec.load(art, max_batch=4, max_total_tokens=128, page_size=16)  # 8 pages
    sched = Scheduler(engine)
    a = sched.submit(Request(PROMPTS[0], 8, stop_tokens=[ref[2]]))  # 37 + 7 tokens: 3 pages
    b = sched.submit(Request(PROMPTS[2], 20))  # 70 + 19 tokens: 6 pages, waits for a
    c = sched.submit(Request(PROMPTS[1], 4))  # fits next to a, but b came first
    sched.step()
    assert a.state == "decode" and b.state == "queued" and c.state == "queued"
    cut = ref.index(ref[2])
    while not a.done:
        assert b.state == "queued" and c.state == "queued"
        sched.step()
    assert a.tokens == ref[: cut + 1] and a.finish_reason == "stop"
    assert a.seq is None and not engine.lengths and sched.reserved == [0, 0]  # a's pages back in the step it stopped
    sched.step()
    assert b.state == "decode" and c.state == "decode"  # both joined once a left (6 + 1 of 8 pages)
    while not b.done:
        sched.step()
        if len(b.tokens) == 5 and not b.done:
            sched.cancel(b.rid)
    assert b.finish_reason == "cancelled" and b.tokens == _alone(art, PROMPTS[2], 5)
    assert c.done and c.tokens == _alone(art, PROMPTS[1], 4) and not engine.lengths and sched.idle
    with pytest.raises(MoecError, match="no such stream"):
        sched.cancel(b.rid)


def test_over_large_requests_are_refused_without_disturbing_others(arts):
    art = arts["fp32"]
    want = _alone(art, PROMPTS[4], 6)
    engine = moec.load(art, max_batch=2, max_total_tokens=128, page_size=16)
    sched = Scheduler(engine, max_queue=1)
    h = sched.submit(Request(PROMPTS[4], 6, rid="ok"))
    sched.step()
    before = lambda: (dict(engine.lengths), [q.rid for q in sched.queue], list(sched.reserved))  # noqa: E731
    b0 = before()
    with pytest.raises(RequestRefused, match=r"request 'huge' refused: a prompt of 120 tokens \+ 10 new tokens .* can never fit"):
        sched.submit(Request([1] * 120, 10, rid="huge"))  # 129 cached tokens > 128
    assert before() == b0 and isinstance(RequestRefused("x"), CacheExhausted)
    sched.submit(Request([2] * 100, 29, rid="fits-later"))  # exactly 128 tokens: fits, waits for room
    b1 = before()
    with pytest.raises(RequestRefused, match="request 'third' refused: 1 requests already wait"):
        sched.submit(Request([3], 2, rid="third"))  # the queue (max_queue=1) is full
    for bad, msg in ((Request([], 3, rid="e"), "'e': the prompt needs"), (Request([999], 3, rid="v"), r"'v': prompt token ids"),
                     (Request([1], 0, rid="z"), "'z': max_new_tokens"), (Request([1], 2, rid="ok"), "'ok': a stream with this id")):
        with pytest.raises(MoecError, match=msg):
            sched.submit(bad)
    with pytest.raises(MoecError, match="top_p"):
        SamplingParams(temperature=1.0, top_p=0.0)
    assert before() == b1 and b1[1] == ["fits-later"]
    out = {}
    for rid, tok in sched.stream():
        out.setdefault(rid, []).append(tok)
    assert h.tokens == want and out["ok"] == want[1:]  # its first token came from the step before
    assert len(out["fits-later"]) == 29 and not engine.lengths


def test_sampling_is_seeded_and_independent_of_the_batch(arts):
    art = arts["fp32"]
    engine = moec.load(art, max_batch=4, max_total_tokens=1024)
    sp = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=11)

    def run(requests):
        return Scheduler(engine, prefill_chunk=24).generate(requests)

    alone = run([Request(PROMPTS[0], 16, sampling=sp, rid="s")])["s"]
    assert run([Request(PROMPTS[0], 16, sampling=sp, rid="s")])["s"] == alone  # same seed, same tokens
    other = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=12)
    assert run([Request(PROMPTS[0], 16, sampling=other, rid="s")])["s"] != alone
    greedy = run([Request(PROMPTS[0], 16, rid="g")])["g"]
    assert alone != greedy
    mixed = run([Request(PROMPTS[2], 9, sampling=SamplingParams(temperature=0.7, seed=1)), Request(PROMPTS[0], 16, sampling=sp, rid="s"),
                 Request(PROMPTS[1], 20), Request(PROMPTS[3], 5, sampling=SamplingParams(temperature=2.0, seed=5))])
    assert mixed["s"] == alone  # other streams (and their draws) do not change this stream's tokens
    assert run([Request(PROMPTS[0], 16, sampling=SamplingParams(temperature=1.0, top_k=1, seed=3), rid="k")])["k"] == greedy


def test_sampler_distribution_top_k_and_top_p():
    """Host sampler: temperature-softmax frequencies, top-k and top-p supports."""
    logits = np.log(np.array([0.4, 0.3, 0.15, 0.1, 0.05]))
    n = 6000

    def draw(**kw):
        sampler = Sampler(SamplingParams(seed=1, **kw))
        return np.bincount([sampler(logits) for _ in range(n)], minlength=5)

    f = draw(temperature=1.0) / n
    np.testing.assert_allclose(f, [0.4, 0.3, 0.15, 0.1, 0.05], atol=0.025)
    assert (draw(temperature=1.0, top_k=2)[2:] == 0).all()
    f = draw(temperature=1.0, top_p=0.8)  # 0.4 + 0.3 < 0.8 <= 0.85: the top three
    assert (f[3:] == 0).all() and abs(f[2] / f[:3].sum() - 0.15 / 0.85) < 0.025
    hot = draw(temperature=4.0) / n
    assert hot.max() - hot.min() < 0.2 and hot[4] > 0.1  # flatter than the softmax at 1
    assert Sampler(SamplingParams())(logits[::-1]) == 4


def test_tiered_cache_streams(arts):
    """The tiered FP8 + 2-bit cache under the scheduler: chunked prefill with re-ranks, pages all back."""
    engine = moec.load(arts["tiered"], max_batch=4, max_total_tokens=1024)
    sched = Scheduler(engine, prefill_chunk=32)
    long = RNG.integers(0, 256, 300).tolist()
    hs = [sched.submit(Request(long, 30)), sched.submit(Request(PROMPTS[1], 12))]
    toks = list(hs[1])  # the per-request iterator drives the scheduler
    assert toks == hs[1].tokens and len(toks) == 12 and not hs[0].done
    for _ in sched.stream():
        engine.tiered.tables.check()
    assert len(hs[0].tokens) == 30 and engine.tiered.reranks > 0
    t = engine.tiered.tables
    assert t.t1.free == t.t1.num_pages and t.t2.free == t.t2.num_pages


def _soak_module():
    spec = importlib.util.spec_from_file_location("moec_bench_soak", ROOT / "bench" / "soak.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("cache", ["bf16", "tiered"])
def test_soak_short(arts, cache):
    """bench/soak.py for 300 decode steps: random arrivals, departures, cancellations and over-large
    requests; every page back at the end, memory steady."""
    engine = moec.load(arts[cache], max_batch=8, max_total_tokens=1024, prefill_chunk=64)
    res = _soak_module().soak(engine, steps=300, seed=1)
    assert res["pages_leaked"] == 0 and res["free_pages_after"] == res["free_pages_before"]
    assert res["decode_steps"] >= 300 and res["served"] >= 30 and res["refused_never_fit"] >= 1
    assert res["finished_length"] and res["finished_stop"] and res["cancelled"]
    assert res["rss_growth_mb"] < 32
    if cache == "tiered":
        assert res["reranks"] > 10


def test_generate_cli_streams_tokens(arts, capsys):
    """``moec generate``: tokens stream as "<prompt>\\t<token>" lines, then one JSON line per prompt;
    greedy equals ``Engine.generate``, a seed makes sampling reproducible, a request over the cache exits 2."""
    import json

    from moec.compiler.cli import main

    art = str(arts["fp32"])

    def run(*extra):
        code = main(["generate", art, "--prompt-ids", "1,2,3", "4,5", "--max-new-tokens", "5", *extra])
        out = capsys.readouterr()
        lines = out.out.splitlines()
        streamed = [tuple(map(int, x.split("\t"))) for x in lines if "\t" in x]
        final = [json.loads(x) for x in lines if x.startswith("{")]
        for i, f in enumerate(final):
            assert [t for r, t in streamed if r == i] == f["generated"]
        return code, [f["generated"] for f in final], out.err

    code, greedy, _ = run()
    assert code == 0 and greedy == moec.load(art).generate([[1, 2, 3], [4, 5]], 5)
    sampled = run("--temperature", "1.0", "--top-k", "40", "--seed", "3")[1]
    assert sampled == run("--temperature", "1.0", "--top-k", "40", "--seed", "3")[1] != greedy
    code, _, err = run("--max-new-tokens", "9000")
    assert code == 2 and "request 0 refused" in err.strip().splitlines()[-1]


@pytest.mark.parametrize("cache", ["bf16", "tiered"])
def test_greedy_on_device_equals_argmax_of_logits(arts, cache):
    """``decode_greedy`` (the artifact's argmax entry on the device) picks the argmax of the logits ``decode``
    returns, step for step through re-ranks of the tiered cache, on two engines fed the same tokens."""
    a, b = moec.load(arts[cache]), moec.load(arts[cache])
    sa, la = a.prefill(PROMPTS[:3])
    sb, _ = b.prefill(PROMPTS[:3])
    nxt = la.argmax(-1)
    for _ in range(9):  # rerank_every=4: two re-ranks on the way
        logits = a.decode(sa, list(nxt))
        got = b.decode_greedy(sb, list(nxt))
        np.testing.assert_array_equal(got, logits.argmax(-1))
        nxt = got
