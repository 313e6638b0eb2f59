"""Offloaded experts (``moec compile --expert-slots``): the IR the pass leaves, the runtime's residency (host weights,
device slot pools, LRU reuse) and numerics identical to the all-resident model."""

import numpy as np
import pytest
from tvm import relax

import moec
from moec.compiler.errors import MoecError
from moec.runtime.expert_cache import RESIDENCY_FUNC, HostCopies
from moec_testing import require_cuda


@pytest.fixture(scope="module")
def arts(zoo, tmp_path_factory):
    """Tiny HF OLMoE (2 layers, 8 experts, top-2): all experts resident (the zoo's default build, test_engine's), and
    offloaded into 8 slots; then the model as the zoo imported it (``moec.compile`` takes it as it takes the export:
    the import is most of a compile's time here, so every build of this file starts from it)."""
    model, _ = zoo.model("hf-olmoe")  # tiny_hf_model("olmoe")
    imported = zoo.imported("hf-olmoe", "pt2")
    root = tmp_path_factory.mktemp("offload")
    return model, zoo.artifact("hf-olmoe", "pt2"), moec.compile(imported, root / "slots8", target="llvm", expert_slots=8), imported


def _run(art, prompts, steps, copier=None, **kw):
    """Greedy decode of the prompts in one batch; the logits of every call. ``copier(engine)``: the expert copier to
    use instead of the device's own."""
    e = moec.load(art, max_batch=4, max_total_tokens=512, **kw)
    if copier is not None:
        e.experts.copier = copier(e)
    seqs, logits = e.prefill(prompts)
    out, toks = [np.asarray(logits)], np.asarray(logits).argmax(-1)
    for _ in range(steps):
        lg = np.asarray(e.decode(seqs, toks.tolist()))
        out.append(lg)
        toks = lg.argmax(-1)
    return e, out


def test_offloaded_decode_equals_resident(arts):
    model, resident, slots, _ = arts
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 128, n).tolist() for n in (9, 5, 13)]
    _, want = _run(resident, prompts, 6)
    e, got = _run(slots, prompts, 6, expert_prefetch=None)  # on demand only
    for w, g in zip(want, got):  # the same kernels read the same weights from other places: the same numbers
        np.testing.assert_array_equal(g, w)
    # 8 slots hold one layer's experts: every call moves experts between the two layers, least recently used first
    st = e.experts.cache.stats
    assert e.experts.copies == st.stalls > 8 and st.evictions > 0 and st.hits > 0 and st.prefetched == 0
    assert e.experts.copy_bytes == e.experts.copies * 3 * 64 * 32 * 4  # W1 (2I x D) + W2 (D x I), float32
    e.experts.cache.check()
    # prefetch (the default): layer 1's router on layer 0's expert input loads most of what layer 1 then routes to
    ep, got = _run(slots, prompts, 6)
    for w, g in zip(want, got):  # prefetching never changes results
        np.testing.assert_array_equal(g, w)
    sp = ep.experts.cache.stats
    assert sp.prefetched > 0 and sp.prefetch_used > 0 and sp.stalls < st.stalls
    assert ep.experts.copies == sp.stalls + sp.prefetched
    with pytest.raises(MoecError, match="expert_prefetch must be"):
        moec.load(slots, expert_prefetch=-1)
    doc = e.manifest["options"]["grouped_experts"]["offload"]
    assert doc["slots"] == 8 and len(doc["layers"]) == 2 and [p["shape"] for p in doc["pools"]] == [[8, 64, 64], [8, 64, 32]]


def test_ir_residency_call_and_pools(arts):
    """Before each layer's expert GEMMs the graph asks the runtime where the routed experts are; the layers'
    expert weights leave the entries' signatures, two pools join them."""
    from moec.compiler.targets import make_target
    from moec.passes.grouped_experts import InsertGroupedExperts
    from moec.passes.pipeline import moec_pipeline

    imported = arts[3]
    tgt = make_target("llvm", None)
    grouped = InsertGroupedExperts(tgt, "tiny", expert_slots=8)
    pipeline, _ = moec_pipeline(imported.num_inputs, tgt, "tiny", None, None, None, None, grouped_experts=grouped, phases=1)
    with tgt:
        mod = pipeline(imported.mod)
    offloaded = {n for pair in grouped.offload["layers"] for n in pair}
    assert len(offloaded) == 4
    for name in ("prefill", "decode"):
        func = mod[name]
        params = [p.name for p in func.params]
        assert params[-2:] == ["experts.pool.w1", "experts.pool.w2"] and not offloaded & set(params)
        calls = []

        def visit(e):
            if isinstance(e, relax.Call) and len(e.args) and isinstance(e.args[0], relax.ExternFunc) and \
                    e.args[0].global_symbol == RESIDENCY_FUNC:
                calls.append(int(e.args[3].value))
        relax.analysis.post_order_visit(func.body, visit)
        assert sorted(calls) == [0, 1]  # one per layer, numbered by their weights' order


def test_refusals(arts, tmp_path):
    model = arts[3]  # the imported model (refused in the pipeline, after the import)
    with pytest.raises(MoecError, match="cannot hold one layer's 8"):
        moec.compile(model, tmp_path / "a", target="llvm", expert_slots=7)
    with pytest.raises(MoecError, match="expert slots must be a positive integer"):
        moec.compile(model, tmp_path / "b", target="llvm", expert_slots=0)
    with pytest.raises(MoecError, match="need the grouped experts"):
        moec.compile(model, tmp_path / "d", target="llvm", expert_slots=8, grouped_experts=False)
    assert not (tmp_path / "a").exists() and not (tmp_path / "d").exists()


def test_fp8_offloaded_experts_equal_fp8_resident(arts, tmp_path):
    """``--expert-weights fp8`` with expert slots: the slots hold e4m3 codes and their scales (four pools, about a
    quarter of float32's bytes per copy here), and decode equals the all-resident FP8 model's exactly, on demand and
    with prefetch; a device memory budget counts the FP8 bytes of a slot (the kernels' CUDA forms with FP8 slots:
    tests/schedules/test_grouped_experts.py::test_fp8_slot_forms_build_for_sm90)."""
    imported = arts[3]
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 128, n).tolist() for n in (6, 12)]
    want = _run(moec.compile(imported, tmp_path / "r8", target="llvm", expert_weights="fp8"), prompts, 4)[1]
    art = moec.compile(imported, tmp_path / "s8", target="llvm", expert_weights="fp8", expert_slots=8)
    for prefetch in (None, 0):
        e, got = _run(art, prompts, 4, expert_prefetch=prefetch)
        for w, g in zip(want, got):
            np.testing.assert_array_equal(g, w)
        slot = 3 * 64 * 32 + 4 * (2 * 32 + 64)  # codes of W1 and W2, float32 scales per output channel
        assert e.experts.copies > 8 and e.experts.copy_bytes == e.experts.copies * slot
        assert (e.experts.cache.stats.prefetched > 0) == (prefetch == 0)
    doc = e.manifest["options"]["grouped_experts"]["offload"]
    assert [(p["shape"], p["dtype"]) for p in doc["pools"]] == [([8, 64, 64], "uint8"), ([8, 64], "float32"),
                                                                ([8, 64, 32], "uint8"), ([8, 64], "float32")]
    assert doc["weights"] == "fp8" and doc["slot_bytes"] == slot and all(len(names) == 4 for names in doc["layers"])
    # a budget (the pass's plan, phase 1): the resident weights as imported, then slots of FP8 bytes
    from moec.compiler.targets import make_target
    from moec.passes.grouped_experts import InsertGroupedExperts
    from moec.passes.pipeline import moec_pipeline

    total = sum(int(w.nbytes) for w in imported.weights)
    resident = total - 2 * 8 * 3 * 64 * 32 * 4
    tgt = make_target("llvm", None)
    grouped = InsertGroupedExperts(tgt, "tiny", "fp8", dict(zip(imported.weight_names(), imported.weights)),
                                   memory_budget=(resident + 11 * slot + 5, total))
    pipeline, _ = moec_pipeline(imported.num_inputs, tgt, "tiny", None, None, None, None, grouped_experts=grouped, phases=1)
    with tgt:
        pipeline(imported.mod)
    assert grouped.offload["slots"] == 11 and grouped.offload["slot_bytes"] == slot


def test_malformed_offloaded_arrays_are_refused(arts, tmp_path):
    """An artifact whose offloaded arrays do not fit the manifest's pools is refused, naming the weights file."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    from moec.compiler.artifact import OFFLOADED_PREFIX, write_manifest
    from moec.compiler.errors import ArtifactError

    art = tmp_path / "s"
    shutil.copytree(arts[2], art)  # the file's 8-slot artifact, altered in a copy
    w = load_file(str(art / "weights.safetensors"))
    name = json.loads((art / "manifest.json").read_text())["options"]["grouped_experts"]["offload"]["layers"][0][0]
    w[OFFLOADED_PREFIX + name] = w[OFFLOADED_PREFIX + name][:, :, :5].copy()
    save_file(w, str(art / "weights.safetensors"))
    manifest = json.loads((art / "manifest.json").read_text())
    write_manifest(art, {k: v for k, v in manifest.items() if k not in ("files", "format")})  # consistent hashes
    with pytest.raises(ArtifactError, match="weights.safetensors: .*but pool experts.pool.w1 takes 8 experts"):
        moec.load(art)


def test_tiered_cache_and_cuda_build(arts, tmp_path):
    """With the tiered KV cache too (its own forward path), and the CUDA build (slot-pool kernels, the residency
    call) compiles; running it needs a GPU."""
    model = arts[3]
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 128, n).tolist() for n in (7, 11)]
    want = _run(moec.compile(model, tmp_path / "t", target="llvm", kv_cache="tiered"), prompts, 3)[1]
    e, got = _run(moec.compile(model, tmp_path / "ts", target="llvm", kv_cache="tiered", expert_slots=9), prompts, 3)
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g, w)
    assert e.experts.copies > 0
    art = moec.compile(model, tmp_path / "cuda", target="cuda", kv_cache="tiered", expert_slots=8)
    import json

    doc = json.loads((art / "manifest.json").read_text())
    assert doc["options"]["grouped_experts"]["offload"]["slots"] == 8 and doc["cuda_kernels"]


def test_memory_budget_picks_the_slots(arts, tmp_path):
    """``gpu_memory_budget``: the slots are what the budget leaves after the weights that stay on the device (the
    pass's arithmetic, phase 1 only; the compiled slot form is the tests' above)."""
    from moec.compiler.cli import _bytes
    from moec.compiler.targets import make_target
    from moec.passes.grouped_experts import InsertGroupedExperts
    from moec.passes.pipeline import moec_pipeline

    model = imported = arts[3]
    total = sum(int(w.nbytes) for w in imported.weights)
    per_expert, experts = 3 * 64 * 32 * 4, 2 * 8 * 3 * 64 * 32 * 4  # float32: one expert, and every layer's
    resident = total - experts
    tgt = make_target("llvm", None)

    def plan(budget):
        grouped = InsertGroupedExperts(tgt, "tiny", memory_budget=(budget, total))
        pipeline, _ = moec_pipeline(imported.num_inputs, tgt, "tiny", None, None, None, None, grouped_experts=grouped, phases=1)
        with tgt:
            pipeline(imported.mod)
        return grouped

    g = plan(resident + 9 * per_expert + 100)
    assert g.offload["slots"] == 9 and f"{resident} bytes of resident weights, 9 expert slots" in g.budget_note
    assert plan(total).offload is None  # everything fits: nothing offloaded
    with pytest.raises(Exception, match=f"give at least {resident + 8 * per_expert} bytes"):
        plan(resident + 7 * per_expert)
    with pytest.raises(MoecError, match="either expert slots or a device memory budget"):
        moec.compile(model, tmp_path / "d", target="llvm", gpu_memory_budget=total, expert_slots=8)
    with pytest.raises(MoecError, match="positive number of bytes"):
        moec.compile(model, tmp_path / "e", target="llvm", gpu_memory_budget=0)
    assert _bytes("40G") == 40 << 30 and _bytes("1.5GiB") == 3 << 29 and _bytes("4096") == 4096


class _DeferredCopies(HostCopies):
    """A copy stream on the CPU: copies are queued and made only when the compute side waits for them (``wait``,
    ``synchronize``), the latest a CUDA copy stream could finish. ``honest=False`` drops the wait, as a runtime that
    forgot it would: the layers then read slots whose copies have not happened."""

    asynchronous = True

    def __init__(self, engine, honest=True):
        super().__init__(engine._tvm, engine.device)
        self.queue, self.honest, self.flushes = [], honest, 0

    def copy(self, pool, offset, src, index, nbytes):
        self.queue.append((pool, offset, src, index, nbytes))

    def ready(self):
        return not self.queue

    def _flush(self):
        for args in self.queue:
            HostCopies.copy(self, *args)
        self.flushes += bool(self.queue)
        self.queue = []

    def wait(self):
        if self.honest:
            self._flush()

    def synchronize(self):
        self._flush()


def test_copies_in_flight_are_waited_for(arts):
    """With copies that finish as late as a copy stream may, the layers whose experts are still in flight make the
    compute side wait, and the numbers stay the resident model's, on demand and with prefetch. Without that wait
    they do not (the check can fail)."""
    _, resident, slots, _ = arts
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 128, n).tolist() for n in (6, 10)]
    _, want = _run(resident, prompts, 5)
    for prefetch in (None, 0):
        e, got = _run(slots, prompts, 5, copier=_DeferredCopies, expert_prefetch=prefetch)
        for w, g in zip(want, got):
            np.testing.assert_array_equal(g, w)
        assert e.experts.waits > 0 and e.experts.copier.flushes == e.experts.waits and e.experts.ready == 0
        if prefetch is not None:
            assert e.experts.cache.stats.prefetch_used > 0
    _, got = _run(slots, prompts, 5, copier=lambda eng: _DeferredCopies(eng, honest=False))
    assert any(not np.array_equal(g, w) for w, g in zip(want, got))


def test_finished_copies_are_not_waited_for(arts):
    """Copies already done when a layer's router has chosen (``ready``): no wait is enqueued."""

    class Done(HostCopies):
        asynchronous = True

    _, resident, slots, _ = arts
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6]]
    _, want = _run(resident, prompts, 3)
    e, got = _run(slots, prompts, 3, copier=lambda eng: Done(eng._tvm, eng.device))
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g, w)
    counts = e.experts.counts()
    assert counts["copies_ready"] > 0 and counts["copy_waits"] == 0 and counts["copies"] == counts["stalls"] + counts["prefetched"]
    assert e.experts.copy_bandwidth(repeats=2) > 0
    host = counts["host_ms"]  # the residency calls' host time, by part (predicting includes the gate's measurement)
    assert host["total"] + 0.01 >= host["ids"] + host["predict"] and host["predict"] > 0 and host["ids"] > 0
    calls = e.experts.timeline(e.experts.calls[0][1])  # one row per residency call: layer, entered, ids read, returned
    layers = len(e.experts.layers)
    assert [c[0] for c in calls] == list(range(layers)) * (len(calls) // layers) and len(calls) % layers == 0
    assert calls[0][1] == 0 and all(c[1] <= c[2] <= c[3] for c in calls)
    assert all(a[3] <= b[1] for a, b in zip(calls, calls[1:]))  # one after the other
    assert sum(c[4] for c in calls) == counts["copies"] and all(c[5] == 0 for c in calls)  # prefetches included
    e.experts.reset_counts()
    assert e.experts.counts()["copies"] == 0 and e.experts.cache.stats.stalls == 0 and e.experts.calls == []
    assert set(e.experts.counts()["host_ms"].values()) == {0.0}


def test_prefetch_gate(arts):
    """The gate (``expert_prefetch_gate=True``) holds back the predictions not worth a copy: with copies that take
    far longer than a layer computes, it copies ahead little (only before a layer was timed); with free copies, every
    prediction, as the ungated prefetch does. Numbers stay the resident model's either way."""
    from moec.runtime.expert_cache import PrefetchGate

    _, resident, slots, _ = arts
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 128, n).tolist() for n in (7, 11)]
    _, want = _run(resident, prompts, 5)
    ungated = _run(slots, prompts, 5, expert_prefetch=0, expert_prefetch_gate=False)[0].experts.counts()
    runs = {}
    for copy_s in (1e3, 0.0):
        e = moec.load(slots, max_batch=4, max_total_tokens=512, expert_prefetch=0, expert_prefetch_gate=True)
        e.experts.gate = PrefetchGate(copy_s, ranks=2)  # (else made at the first prefetch from a measured copy)
        seqs, logits = e.prefill(prompts)
        got, toks = [np.asarray(logits)], np.asarray(logits).argmax(-1)
        for _ in range(5):
            got.append(np.asarray(e.decode(seqs, toks.tolist())))
            toks = got[-1].argmax(-1)
        for w, g in zip(want, got):
            np.testing.assert_array_equal(g, w)
        runs[copy_s] = e.experts.counts()
        g = runs[copy_s]["gate"]
        assert g["overlap_ms_by_rows"] and min(g["overlap_ms_by_rows"].values()) > 0
        assert len(g["precision_by_rank"]) == 2 and 0 <= g["eviction_reuse"] <= 1
        assert "2" in g["overlap_ms_by_rows"]  # the decode steps' layers (two streams) are timed on their own
    slow, free = runs[1e3], runs[0.0]
    assert slow["prefetch_skipped"] > 0 and free["prefetch_skipped"] == 0 and slow["prefetched"] < free["prefetched"]
    assert free["prefetched"] == ungated["prefetched"] and free["stalls"] == ungated["stalls"] and "gate" not in ungated


@pytest.mark.gpu
def test_cuda_stream_copies_match_resident_on_gpu(arts, tmp_path):
    """On the GPU: pinned host weights, copies on the copy stream, the compute stream waiting where a layer's
    experts are in flight; the logits equal the all-resident CUDA model's, on demand and with prefetch."""
    require_cuda()
    model = arts[3]
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 128, n).tolist() for n in (9, 5, 13)]
    want = _run(moec.compile(model, tmp_path / "r", target="cuda"), prompts, 6, device="cuda")[1]
    art = moec.compile(model, tmp_path / "s", target="cuda", expert_slots=8)
    for prefetch in (None, 0):
        e, got = _run(art, prompts, 6, device="cuda", expert_prefetch=prefetch)
        assert type(e.experts.copier).__name__ == "CudaStreamCopies" and e.experts.layers[0][0].device.dlpack_device_type() == 3
        for w, g in zip(want, got):
            np.testing.assert_array_equal(g, w)
        # this model's copies are 24 KB, bound by latency: 0.94 GB/s on the H200 (bench/results/gpu_tests_h200_5c1bc86.json)
        assert e.experts.waits + e.experts.ready > 0 and e.experts.copy_bandwidth() > 1e8


def test_dropped_engine_frees_its_experts(arts):
    """An engine's offloaded experts (slot pools, pinned host weights) go with the engine: the residency hook keeps
    only a weak reference, so a later engine's first forward does not pay for freeing the last one's."""
    import gc
    import weakref

    _, _, slots8, _ = arts
    e, _ = _run(slots8, [[1, 2, 3]], 1)
    store = weakref.ref(e.experts)
    del e
    gc.collect()
    assert store() is None
    e2, out = _run(slots8, [[1, 2, 3]], 1)  # the next engine's residency is its own
    assert e2.experts.copies > 0 and np.isfinite(out[-1]).all()
