"""End to end on CPU (llvm): compile -> artifact -> moec.load -> prefill + decode, against torch and onnxruntime."""

import json
from pathlib import Path
import shutil
import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest

import moec
from moec.compiler.errors import ArtifactError, MoecError
from moec.runtime.engine import CacheExhausted

from moec_testing import ATOL, ort_last_logits, torch_last_logits

MODELS = ["tiny", "tiny-shared-grouped", "hf-olmoe", "hf-mixtral", "hf-qwen2_moe"]
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [3, 1, 4, 1, 5]]
DECODE_STEPS = 8


@pytest.mark.parametrize("path", ["onnx", "pt2"])
@pytest.mark.parametrize("name", MODELS)
def test_prefill_and_decode_match_reference(zoo, name, path):
    model, vocab = zoo.model(name)
    engine = moec.load(zoo.artifact(name, path), device="cpu")
    session = ort.InferenceSession(str(zoo.source(name, "onnx"))) if path == "onnx" else None

    def reference(tokens):
        return ort_last_logits(session, tokens) if session else torch_last_logits(model, tokens)

    seqs, logits = engine.prefill(PROMPTS)
    histories = [list(p) for p in PROMPTS]
    for step in range(DECODE_STEPS + 1):
        for i, h in enumerate(histories):
            np.testing.assert_allclose(logits[i], reference(h), atol=ATOL, rtol=1e-4, err_msg=f"{name}/{path} step {step} seq {i}")
        if step == DECODE_STEPS:
            break
        nxt = logits.argmax(-1)
        for h, t in zip(histories, nxt):
            h.append(int(t))
        logits = engine.decode(seqs, nxt)
    for s in seqs:
        engine.release(s)
    assert not engine.lengths


@pytest.mark.parametrize("name", ["tiny", "hf-olmoe"])
def test_greedy_generation_equals_torch(zoo, name):
    model, _ = zoo.model(name)
    engine = moec.load(zoo.artifact(name, "onnx"))
    out = engine.generate(PROMPTS, max_new_tokens=6)
    for prompt, gen in zip(PROMPTS, out):
        h = list(prompt)
        for _ in range(6):
            h.append(int(torch_last_logits(model, h).argmax()))
        assert gen == h[len(prompt):]


def test_batch_independence_and_chunked_prefill(zoo):
    art = zoo.artifact("tiny", "onnx")
    alone = moec.load(art).generate([PROMPTS[1]], 5)[0]
    batched = moec.load(art).generate(PROMPTS, 5)[1]
    assert alone == batched
    chunked = moec.load(art, prefill_chunk=4).generate(PROMPTS, 5)[1]  # prompts split over several prefill calls
    assert chunked == alone


def test_prefill_chunks_are_enqueued_before_any_logits_are_read(zoo):
    """A chunked prefill keeps each chunk's logits on the device and reads them after the last chunk is enqueued, so
    the host prepares a chunk while the device runs the one before (one readback at the end, not one per chunk)."""
    art = zoo.artifact("tiny", "onnx")
    e = moec.load(art, prefill_chunk=4)
    events, run = [], e._run

    class Logged:
        def __init__(self, t):
            self.t = t

        def numpy(self):
            events.append("read")
            return self.t.numpy()

    def logged_run(*args, **kw):
        events.append("run")
        out = run(*args, **kw)
        return Logged(out) if kw.get("on_device") else out

    e._run = logged_run
    seqs, logits = e.prefill(PROMPTS)
    assert events.count("run") > 2 and events.index("read") > len(events) - 1 - events[::-1].index("run")
    want = moec.load(art).prefill(PROMPTS)[1]
    np.testing.assert_allclose(logits, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


def test_cache_exhausted_is_a_clear_error(zoo):
    engine = moec.load(zoo.artifact("tiny", "onnx"), max_total_tokens=64, page_size=16, max_batch=4)
    with pytest.raises(CacheExhausted, match="exhausted"):
        engine.prefill([[1] * 70])
    seqs, _ = engine.prefill([[1] * 60])  # fits in 4 pages
    with pytest.raises(CacheExhausted, match="exhausted"):
        for _ in range(10):
            engine.decode(seqs, [1])
    engine.release(seqs[0])
    assert engine.prefill([[2] * 10])[0]  # pages came back


def test_paged_cache_beyond_32_bit_indexing_is_refused(zoo):
    """The paged attention kernels index a layer's pages in 32 bits: a cache past 2^31 elements per layer is refused
    at load, before any weight is read, rather than failing with an illegal address in the first prefill."""
    art = zoo.artifact("tiny", "onnx")
    cfg = json.loads((art / "manifest.json").read_text())["model"]
    most = 2**31 // (2 * cfg["num_kv_heads"] * cfg["head_dim"])
    with pytest.raises(MoecError, match=f"more than the 2\\^31.*at most {most}"):
        moec.load(art, max_total_tokens=most + 1, page_size=16)
    assert moec.load(art, max_total_tokens=64, page_size=16).prefill([[1] * 10])[0]

def _copy(src, tmp_path):
    dst = tmp_path / "art"
    shutil.copytree(src, dst)
    return dst


def test_unchanged_files_are_hashed_once(zoo, tmp_path, monkeypatch):
    """A file found to match its digest is remembered by inode, size and mtime: a second load does not hash the
    weights again; a rewritten file (same size, new mtime) or a copy (new inode) is hashed again."""
    import os

    from moec.compiler import artifact

    monkeypatch.setenv("MOEC_CACHE_DIR", str(tmp_path / "cache"))
    art = _copy(zoo.artifact("tiny", "onnx"), tmp_path)
    hashed = []
    real = artifact.sha256_file
    monkeypatch.setattr(artifact, "sha256_file", lambda p, *a: hashed.append(Path(p).name) or real(p, *a))
    moec.load(art)
    assert "weights.safetensors" in hashed
    hashed.clear()
    moec.load(art)
    assert hashed == []
    w = art / "weights.safetensors"
    data = bytearray(w.read_bytes())
    data[-1] ^= 0xFF
    st = w.stat()
    w.write_bytes(bytes(data))
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # a later mtime, whatever the clock's resolution
    with pytest.raises(ArtifactError, match="SHA-256 does not match"):
        moec.load(art)
    assert hashed == ["weights.safetensors"]

def test_edited_manifest_is_refused(zoo, tmp_path):
    art = _copy(zoo.artifact("tiny", "onnx"), tmp_path)
    m = json.loads((art / "manifest.json").read_text())
    m["files"]["lib.so"] = "0" * 64
    (art / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match="lib.so: SHA-256 does not match"):
        moec.load(art)


def test_corrupt_weights_are_refused(zoo, tmp_path):
    art = _copy(zoo.artifact("tiny", "onnx"), tmp_path)
    with open(art / "weights.safetensors", "r+b") as f:
        f.seek(200)
        f.write(b"\x00garbage")
    with pytest.raises(ArtifactError, match="weights.safetensors: SHA-256"):
        moec.load(art)


def test_wrong_target_and_version_are_refused(zoo, tmp_path):
    art = _copy(zoo.artifact("tiny", "onnx"), tmp_path)
    with pytest.raises(ArtifactError, match="built for target 'llvm', cannot run on device 'cuda'"):
        moec.load(art, device="cuda")
    m = json.loads((art / "manifest.json").read_text())
    m["tvm_version"] = "0.1.0"
    (art / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match="built with TVM 0.1.0"):
        moec.load(art)
    with pytest.raises(ArtifactError, match="not an artifact directory"):
        moec.load(tmp_path / "missing")


def test_runtime_only_mode(zoo):
    """The engine runs with TVM's runtime library only (no compiler loaded)."""
    art = zoo.artifact("tiny", "onnx")
    code = (
        "import sys, moec, tvm\n"
        f"e = moec.load({str(art)!r})\n"
        "print(e.generate([[1,2,3]], 4)[0])\n"
        "assert not hasattr(tvm, 'relax'), 'compiler was imported'\n"
    )
    env = dict(__import__("os").environ, TVM_USE_RUNTIME_LIB="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    expected = moec.load(art).generate([[1, 2, 3]], 4)[0]
    assert out.stdout.strip().splitlines()[-1] == str(expected)


def test_fatbin_callback_is_given_back_after_loading(tmp_path):
    """A CUDA artifact's fatbins answer TVM's CUDA compile callback only while its library loads: afterwards
    the callback the process had (the compiler's nvcc in a process that also compiles) is back, or none is."""
    import hashlib

    import tvm_ffi

    from moec.runtime.engine import _CUDA_COMPILE, _register_fatbins

    (tmp_path / "k.fatbin").write_bytes(b"FATBIN")
    manifest = {"cuda_kernels": [{"file": "k.fatbin", "source_sha256": hashlib.sha256(b"src").hexdigest()}]}
    before = tvm_ffi.get_global_func(_CUDA_COMPILE, allow_missing=True)
    try:
        tvm_ffi.register_global_func(_CUDA_COMPILE, lambda code, *a: b"NVCC:" + str(code).encode(), override=True)
        restore = _register_fatbins(tmp_path, manifest)
        serve = tvm_ffi.get_global_func(_CUDA_COMPILE)
        assert bytes(serve("src")) == b"FATBIN"
        with pytest.raises(Exception, match="no precompiled fatbin"):
            serve("other source")
        restore()
        assert bytes(tvm_ffi.get_global_func(_CUDA_COMPILE)("x")) == b"NVCC:x"
        tvm_ffi.remove_global_func(_CUDA_COMPILE)
        restore = _register_fatbins(tmp_path, manifest)
        restore()
        assert tvm_ffi.get_global_func(_CUDA_COMPILE, allow_missing=True) is None
    finally:
        if before is not None:
            tvm_ffi.register_global_func(_CUDA_COMPILE, before, override=True)


@pytest.fixture(scope="module")
def tiny_tiered(zoo, tmp_path_factory):
    """``tiny`` compiled for llvm with the tiered cache, small pages and frequent re-ranks (shared by the greedy tests)."""
    from moec.passes.tiered_kv_attention import TieredOptions

    return moec.compile(zoo.source("tiny", "onnx"), tmp_path_factory.mktemp("tiered") / "art", kv_cache="tiered",
                        tiered_options=TieredOptions(t2_page=32, sink=2, recent=8, rerank_every=3))


@pytest.mark.parametrize("cache", ["paged", "tiered"])
def test_pipelined_greedy_steps_equal_the_step_loop(zoo, tiny_tiered, cache):
    """``decode_greedy_steps`` (each step's argmax fed to the next step on the device, read back a step late) yields
    the tokens of ``decode_greedy`` in a loop, step for step, through the tiered cache's re-ranks too, and leaves the
    same lengths; the argmax entry returns the decode's int64 token ids."""
    art = zoo.artifact("tiny", "onnx") if cache == "paged" else tiny_tiered
    prompts = [list(range(3, 3 + n)) for n in (70, 9, 41)]
    a, b = moec.load(art), moec.load(art)
    sa, la = a.prefill(prompts)
    sb, lb = b.prefill(prompts)
    np.testing.assert_array_equal(la, lb)
    first = la.argmax(-1)
    want, tok = [], first
    for _ in range(10):
        tok = a.decode_greedy(sa, list(tok))
        want.append(tok)
    got = list(b.decode_greedy_steps(sb, list(first), 10))
    assert len(got) == 10 and all(g.dtype == np.int64 and g.shape == (3,) for g in got)
    np.testing.assert_array_equal(np.stack(got), np.stack(want))
    assert a.lengths == b.lengths
    assert b.chained_steps == 9 and a.chained_steps == 0  # every step after the first took its ids on the device
    if cache == "tiered":
        assert b.tiered.reranks == a.tiered.reranks > 0
    assert list(b.decode_greedy_steps(sb, list(got[-1]), 0)) == []
    with pytest.raises(MoecError, match="one token per sequence"):
        next(b.decode_greedy_steps(sb, [1], 2))


@pytest.mark.parametrize("cache", ["paged", "tiered"])
def test_greedy_steps_take_the_greedy_graph(zoo, tiny_tiered, cache):
    """Which entry a step runs, on CPU with stand-ins for the graph entries (built for CUDA only): a greedy step within the
    graphs' bounds runs ``decode_graph_greedy`` and returns its tokens with no argmax after it, a step returning logits
    runs ``decode_graph``, a step beyond the bounds the plain ``decode`` and then the argmax; the tokens are the
    ungraphed engine's either way."""
    art = zoo.artifact("tiny", "onnx") if cache == "paged" else tiny_tiered
    e, ref = moec.load(art), moec.load(art)
    decode, argmax = e.vm["decode"], e.vm["argmax"]
    calls = []

    def graph(*args):
        calls.append("graph")
        return decode(*args)

    def greedy(*args):
        calls.append("greedy")
        out = decode(*args)
        return argmax(out) if hasattr(out, "shape") else [argmax(out[0])] + [out[i] for i in range(1, len(out))]

    real_argmax = e._argmax
    e._argmax = lambda logits: (calls.append("argmax"), real_argmax(logits))[1]
    e._decode_graph, e._greedy_graph, e.graph_bounds = graph, greedy, {"max_batch": 2}
    e.graph_widths = (1 << 20, 1 << 20) if cache == "tiered" else None
    prompts = [list(range(3, 3 + n)) for n in (70, 9, 41)]
    se, le = e.prefill(prompts)
    sr, lr = ref.prefill(prompts)
    tok = le.argmax(-1)
    calls.clear()
    got, want = e.decode_greedy(se, list(tok)), ref.decode_greedy(sr, list(tok))  # 3 streams: beyond the bounds
    np.testing.assert_array_equal(got, want)
    assert calls == ["argmax"] and e.graph_steps == 0
    e.release(se.pop())
    ref.release(sr.pop())
    tok = got[:2]
    calls.clear()
    got, want = e.decode_greedy(se, list(tok)), ref.decode_greedy(sr, list(tok))
    np.testing.assert_array_equal(got, want)
    assert calls == ["greedy"] and e.greedy_graph_steps == e.graph_steps == 1
    calls.clear()
    steps = list(e.decode_greedy_steps(se, list(got), 6))
    want = [ref.decode_greedy(sr, list(t)) for t in [got] + steps[:-1]]
    np.testing.assert_array_equal(np.stack(steps), np.stack(want))
    assert calls == ["greedy"] * 6 and e.greedy_graph_steps == 7 and e.chained_steps == 5
    calls.clear()
    np.testing.assert_allclose(e.decode(se, list(steps[-1])), ref.decode(sr, list(steps[-1])), rtol=0, atol=1e-5)
    assert calls == ["graph"] and e.graph_steps == 8 and e.greedy_graph_steps == 7


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["paged", "tiered", "tiered-graph"])
def test_pipelined_greedy_steps_on_gpu(zoo, tmp_path, cache):
    """On CUDA the pipelined loop's asynchronous input copies (page-locked stages, two a key) and token readback give
    the tokens of the synchronous loop, step for step, re-ranks included, also through the CUDA graphs."""
    from moec.passes.tiered_kv_attention import TieredOptions
    from moec_testing import require_cuda

    require_cuda()
    graph = cache.endswith("-graph")
    cache = cache.removesuffix("-graph")
    opts = TieredOptions(sink=2, recent=8, rerank_every=3) if cache == "tiered" else None  # (CUDA: 128-token pages)
    art = moec.compile(zoo.source("tiny", "onnx"), tmp_path / cache, target="cuda", kv_cache=cache, tiered_options=opts,
                       cuda_graph=graph)
    prompts = [[3 + i % 200 for i in range(n)] for n in (300, 9, 41, 520)]
    a, b = moec.load(art, device="cuda"), moec.load(art, device="cuda")
    sa, la = a.prefill(prompts)
    sb, lb = b.prefill(prompts)
    np.testing.assert_array_equal(la, lb)
    want, tok = [], la.argmax(-1)
    for _ in range(24):
        tok = a.decode_greedy(sa, list(tok))
        want.append(tok)
    got = list(b.decode_greedy_steps(sb, list(la.argmax(-1)), 24))
    np.testing.assert_array_equal(np.stack(got), np.stack(want))
    assert b.chained_steps == 23 and a.lengths == b.lengths
    assert (b.graph_steps >= 23) == graph and (b.greedy_graph_steps >= 23) == graph
    if graph:  # the greedy graph's tokens are the argmax of the ungraphed decode's logits
        c = moec.load(art, device="cuda", cuda_graph=False)
        sc, lc = c.prefill(prompts)
        tok = lc.argmax(-1)
        for w in want:
            tok = c.decode(sc, list(tok)).argmax(-1)
            np.testing.assert_array_equal(tok, w)
        assert c.graph_steps == 0


def test_input_buffers_grow_and_keep_their_front():
    """The step-input buffers: an array lands in a view of its key's buffer with its own shape; a larger array or
    another dtype gets a new buffer (next power of two), a smaller one reuses it; empty arrays copy nothing."""
    import tvm

    from moec.runtime.engine import _InputBuffers

    bufs = _InputBuffers(tvm, tvm.cpu())
    a = np.arange(12, dtype=np.int32).reshape(3, 4)
    v = bufs.put("t", a)
    assert tuple(v.shape) == (3, 4) and str(v.dtype) == "int32"
    np.testing.assert_array_equal(v.numpy(), a)
    first = bufs._bufs["t"]
    assert first.shape[0] == 16
    v2 = bufs.put("t", a[:2, :3].copy())  # smaller: the same buffer, a view of its front
    assert bufs._bufs["t"].same_as(first)
    np.testing.assert_array_equal(v2.numpy(), a[:2, :3])
    v3 = bufs.put("t", np.arange(40, dtype=np.int32).reshape(2, 20))  # larger: a new buffer of 64
    assert not bufs._bufs["t"].same_as(first) and bufs._bufs["t"].shape[0] == 64
    np.testing.assert_array_equal(v3.numpy(), np.arange(40).reshape(2, 20))
    v4 = bufs.put("t", np.arange(5, dtype=np.int64))  # another dtype: its own buffer
    assert str(v4.dtype) == "int64" and v4.numpy().tolist() == [0, 1, 2, 3, 4]
    assert tuple(bufs.put("t", np.zeros((4, 0), np.int32)).shape) == (4, 0)
    np.testing.assert_array_equal(bufs.put("u", a).numpy(), a)  # keys do not share buffers
    np.testing.assert_array_equal(v4.numpy(), np.arange(5))


def test_pinned_stages_wait_before_reuse():
    """``PinnedStages`` (the page-locked buffers of the asynchronous copies): buffers in turn, each handed out only
    after waiting on the event of its last copy, and grown (after waiting on every buffer's event) when too small."""
    from moec.runtime.cuda_driver import PinnedStages

    class FakeDriver:
        def __init__(self):
            self.waits, self.allocs, self.n = [], [], 0

        def bind(self):
            pass

        def pinned(self, nbytes, owner):
            self.allocs.append(nbytes)
            self.n += 1
            return np.zeros(nbytes, np.uint8), 1000 * self.n

        def event(self, owner):
            self.n += 1
            return self.n

        def wait_event(self, ev):
            self.waits.append(ev)

    drv = FakeDriver()
    st = PinnedStages(drv)
    a = st.take(5)
    b = st.take(8)
    assert drv.allocs == [8, 8] and a[1] != b[1] and a[2] != b[2]
    assert st.take(3)[1] == a[1] and drv.waits[-1] == a[2]  # the first buffer again, after its event
    drv.waits.clear()
    c = st.take(20)  # larger: both old events waited on, new buffers of 32
    assert drv.allocs[-2:] == [32, 32] and set(drv.waits[:2]) == {a[2], b[2]} and len(c[0]) == 32
