"""The minimal runtime: load an artifact with TVM's runtime library only and decode.

``load(DIR, device="cpu"|"cuda")`` verifies the manifest (hashes, target, TVM version), loads the
library and the weights once onto the device, creates the paged KV cache and returns an ``Engine``.
Sequences live in the cache between calls: ``prefill`` appends prompts (new or continuing sequences),
``decode`` appends one token per sequence, ``release`` frees a sequence's pages.

No compiler import happens here: this module runs with ``TVM_USE_RUNTIME_LIB=1``.
"""

from __future__ import annotations

import contextlib
import ctypes
import weakref
from pathlib import Path

import numpy as np

from ..compiler.artifact import LIBRARY, OFFLOADED_PREFIX, PREFETCH_PREFIX, WEIGHTS, read_manifest
from ..compiler.errors import ArtifactError, ContextTooLong, MoecError


from .cuda_driver import CudaDriver, PinnedStages, launch_stream
from .expert_cache import RESIDENCY_FUNC, OffloadedExperts
from .kv_cache import CacheExhausted  # noqa: F401 - re-exported: the error users catch


_CUDA_RUNTIME_LOADED = False
_FATBINS: dict[str, bytes] = {}
_CUDA_COMPILE = "tvm_callback_cuda_compile"
_RUN_OR_CAPTURE = "vm.builtin.cuda_graph.run_or_capture"


def _register_fatbins(directory: Path, manifest: dict):
    """Serve the artifact's ahead-of-time fatbins to TVM's CUDA loader (matched by source SHA-256).

    TVM's CUDA module asks ``tvm_callback_cuda_compile`` for device code when it is loaded; answering
    with the precompiled fatbin means nothing is compiled at load time (and no compiler is needed).
    """
    import hashlib

    import tvm_ffi

    kernels = manifest.get("cuda_kernels") or []
    if not kernels:
        raise ArtifactError(f"{directory / 'manifest.json'}: CUDA artifact lists no compiled kernels (cuda_kernels)")
    for k in kernels:
        _FATBINS[k["source_sha256"]] = (directory / k["file"]).read_bytes()
    previous = tvm_ffi.get_global_func(_CUDA_COMPILE, allow_missing=True)

    def serve(code, *_):
        digest = hashlib.sha256(str(code).encode()).hexdigest()
        if digest not in _FATBINS:
            raise ArtifactError(f"{directory}: no precompiled fatbin for a CUDA module (source {digest[:12]}): stale artifact, recompile")
        return bytes(_FATBINS[digest])

    tvm_ffi.register_global_func(_CUDA_COMPILE, serve, override=True)

    def restore() -> None:
        """Give the callback back (the compiler's nvcc, in a process that compiles too) once the library is loaded."""
        if previous is not None:
            tvm_ffi.register_global_func(_CUDA_COMPILE, previous, override=True)
        else:
            tvm_ffi.remove_global_func(_CUDA_COMPILE)

    return restore


def _predictors(manifest: dict, offload: dict, weights: dict, extra: int | None, fitted: dict | None = None) -> tuple:
    """``OffloadedExperts``' prefetch arguments: per offloaded layer its router (weight, bias) and the ratio of its
    post-attention norm weight to the previous MoE layer's, from the recorded structure (None: no prefetch). A
    layer with a calibrated predictor in ``fitted`` (MoE layer index -> ``(P [E, D], p [E])``, from ``moec
    calibrate``) takes it instead, applied to the previous layer's input as it is (ratio 1)."""
    if extra is None:
        return None, 0, 0
    chosen = ((manifest.get("options") or {}).get("prefetch") or {}).get("check") or {}  # calibration's per-layer figures
    by_w1 = {}
    for layer in manifest["structure"]["layers"]:
        router = layer.get("router") or {}
        mlp = [n["weight"] for n in layer.get("norms", []) if n.get("role") == "mlp"]
        for name in layer.get("experts") or {}:
            by_w1[name] = (router.get("weight"), router.get("bias"), mlp[0] if mlp else None, router.get("top_k"),
                           layer.get("index"))
    rows, top_k, index = [], 0, []
    e, d = int(offload["experts"]), int(offload["pools"][0]["shape"][2])
    for w1, *_ in offload["layers"]:
        router, bias, norm, k, li = by_w1.get(w1, (None, None, None, None, None))
        index.append(li)
        if router not in weights or norm not in weights:  # not recorded as expected: load on demand only
            return None, 0, 0
        w = np.asarray(weights[router], np.float32)
        w = w.T if w.shape == (d, e) else w
        if w.shape != (e, d) or np.asarray(weights[norm]).shape != (d,):
            return None, 0, 0
        rows.append((w, None if bias is None or bias not in weights else np.asarray(weights[bias], np.float32),
                     np.asarray(weights[norm], np.float32)))
        top_k = max(top_k, int(k or 0))
    preds = [None] + [(w, b, n / np.where(prev == 0, np.float32(1), prev))
                      for (w, b, n), (_, _, prev) in zip(rows[1:], rows[:-1])]
    for i in range(1, len(preds)):
        if fitted and index[i] in fitted:
            pw, pb = fitted[index[i]]
            if pw.shape != (e, d) or pb.shape != (e,):
                raise ArtifactError(f"{WEIGHTS}: prefetch predictor of layer {index[i]} is {list(pw.shape)} / {list(pb.shape)}, "
                                    f"not [{e}, {d}] / [{e}]")
            preds[i] = (np.asarray(pw, np.float32), np.asarray(pb, np.float32), np.float32(1))
    if extra == "auto":  # per layer: the calibration's choice for a fitted predictor, else none
        extra = [int(chosen.get(str(li), {}).get("check", {}).get("extra_for_target", 0)) if fitted and li in fitted else 0
                 for li in index]
    return preds, top_k, extra


# the offloaded experts of the engine whose forward is running, as a weak reference: a strong one kept the last
# engine's slot pools and pinned host weights alive after the engine was dropped, until the next engine's first
# forward replaced it and so paid for freeing them (1.4 s of a benchmark's TTFT for 11 GB of pinned host memory)
_ACTIVE_EXPERTS = None
_RESIDENCY_REGISTERED = False


def _register_residency() -> None:
    """The packed function the compiled graph calls before each MoE layer's experts (``RESIDENCY_FUNC``)."""
    global _RESIDENCY_REGISTERED
    if _RESIDENCY_REGISTERED:
        return
    import tvm_ffi

    def residency(ids, x, layer):
        experts = _ACTIVE_EXPERTS() if _ACTIVE_EXPERTS is not None else None
        if experts is None:
            raise MoecError("offloaded experts: the compiled model asked for expert residency outside an engine's forward")
        return experts.residency(ids, x, int(layer))

    tvm_ffi.register_global_func(RESIDENCY_FUNC, residency, override=True)
    _RESIDENCY_REGISTERED = True


def _load_cuda_runtime() -> None:
    """In runtime-only mode TVM does not autoload its CUDA backend: load it before a CUDA artifact."""
    global _CUDA_RUNTIME_LOADED
    if _CUDA_RUNTIME_LOADED:
        return
    import tvm

    lib = Path(tvm.__file__).parent / "lib" / "libtvm_runtime_cuda.so"
    if lib.exists():
        ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    _CUDA_RUNTIME_LOADED = True


class Engine:
    """Prefill and batched decode over a paged KV cache for one compiled artifact."""

    def __init__(self, directory: str | Path, device: str = "cpu", max_batch: int = 64, max_total_tokens: int = 8192,
                 prefill_chunk: int = 2048, page_size: int = 16, t1_pages: int | None = None, t2_pages: int | None = None,
                 cuda_graph: bool | None = None, expert_prefetch: int | str | None = "auto",
                 expert_prefetch_gate: bool | None = None) -> None:
        """``cuda_graph``: run decode steps through the artifact's CUDA graphs (``moec compile --cuda-graph``) when
        they fit its bounds. None (default): if the artifact has them and the device is CUDA; False: never; True:
        the artifact must have them. ``expert_prefetch`` (offloaded experts): None loads each layer's experts when
        its router has chosen; n >= 0 also prefetches the next layer's predicted top-k + n experts per token
        (``OffloadedExperts``); "auto" (default): per layer the fewest extra experts with which the calibration's
        check found 90% of the routed experts predicted, when the artifact was compiled with ``--calibration``,
        else 0. ``expert_prefetch_gate``: copy ahead only the predicted experts worth it (``PrefetchGate``: a
        prediction's measured precision against the copy time and the compute it can hide); None (default): on
        CUDA, where copies overlap compute; False: every predicted expert."""
        if expert_prefetch is not None and expert_prefetch != "auto" and (
                not isinstance(expert_prefetch, int) or isinstance(expert_prefetch, bool) or expert_prefetch < 0):
            raise MoecError(f"expert_prefetch must be None, 'auto' or a non-negative number of extra experts, got {expert_prefetch!r}")
        directory = Path(directory)
        manifest = read_manifest(directory, verify=True)
        self.manifest = manifest
        kind = manifest["target"]["kind"]
        want = {"cpu": "llvm", "cuda": "cuda"}.get(device)
        if want is None:
            raise MoecError(f"unknown device {device!r}: expected 'cpu' or 'cuda'")
        if want != kind:
            raise ArtifactError(f"{directory / 'manifest.json'}: artifact built for target {kind!r}, cannot run on device {device!r}")
        if manifest.get("options", {}).get("kv_cache", "paged") not in ("fp8", "tiered"):
            # TVM's paged attention kernels index a layer's pages in 32 bits: refuse a cache they would overrun
            # (the engine hands out at most max_total_tokens / page_size pages, lowest ids first)
            elems = -(-max_total_tokens // page_size) * page_size * 2 * manifest["model"]["num_kv_heads"] * manifest["model"]["head_dim"]
            if elems > 2**31:
                raise MoecError(f"{directory}: a {max_total_tokens}-token paged cache holds {elems} elements per layer, more "
                                "than the 2^31 that the paged attention kernels index; lower max_total_tokens (at most "
                                f"{2**31 // (2 * manifest['model']['num_kv_heads'] * manifest['model']['head_dim'])}) or compile with --kv-cache fp8 or tiered")
        import tvm
        import tvm_ffi

        if manifest["tvm_version"] != tvm.__version__:
            raise ArtifactError(
                f"{directory / 'manifest.json'}: built with TVM {manifest['tvm_version']}, this runtime is TVM {tvm.__version__}: recompile"
            )
        self._tvm, self._shape = tvm, tvm_ffi.Shape
        self.device = tvm.cuda(0) if device == "cuda" else tvm.cpu(0)
        driver = CudaDriver(self.device.index, "step inputs and token readback") if device == "cuda" else None
        self.inputs = _InputBuffers(tvm, self.device, driver)
        self._readback = _TokenReadback(driver)
        restore = None
        if device == "cuda":
            _load_cuda_runtime()
            restore = _register_fatbins(directory, manifest)
        offload = ((manifest.get("options") or {}).get("grouped_experts") or {}).get("offload")
        if offload:  # the VM resolves the graph's residency call when it loads
            _register_residency()
        try:
            lib = tvm.runtime.load_module(str(directory / LIBRARY))
            from tvm.runtime.vm import VirtualMachine

            self.vm = VirtualMachine(lib, self.device)
        except ArtifactError:
            raise
        except Exception as exc:
            raise ArtifactError(f"{directory / LIBRARY}: cannot load the compiled library: {str(exc).splitlines()[-1] if str(exc) else exc}") from None
        finally:
            if restore is not None:
                restore()
        from safetensors.numpy import load_file

        stored = load_file(str(directory / WEIGHTS))
        names = manifest["weights"]
        pools = {p["name"] for p in offload["pools"]} if offload else set()
        fitted = {}  # calibrated prefetch predictors (moec compile --calibration with offloaded experts)
        for k in [k for k in stored if k.startswith(PREFETCH_PREFIX)]:
            li, _, part = k[len(PREFETCH_PREFIX):].partition(".")
            if not li.isdigit() or part not in ("weight", "bias"):
                raise ArtifactError(f"{directory / WEIGHTS}: unexpected tensor {k!r}")
            fitted.setdefault(int(li), {})[part] = stored.pop(k)
        fitted = {li: (v["weight"], v["bias"]) for li, v in fitted.items() if {"weight", "bias"} <= set(v)}
        keys = sorted(k for k in stored if not k.startswith(OFFLOADED_PREFIX))
        if len(keys) != len(names) - len(pools):
            raise ArtifactError(f"{directory / WEIGHTS}: holds {len(keys)} tensors, manifest lists {len(names) - len(pools)}")
        self.experts = None  # offloaded experts (moec compile --expert-slots): host weights, device pools, residency
        if offload:
            # taken out of ``stored``: once staged (pinned on CUDA) the loaded copies are dropped
            host = {n: stored.pop(OFFLOADED_PREFIX + n, None) for pair in offload["layers"] for n in pair}
            missing = [n for n, a in host.items() if a is None]
            if missing:
                raise ArtifactError(f"{directory / WEIGHTS}: offloaded expert weights missing: {', '.join(missing[:3])}")
            try:
                self.experts = OffloadedExperts(tvm, self.device, offload, host, *_predictors(
                    manifest, offload, {n: stored[k] for n, k in zip([n for n in names if n not in pools], keys)},
                    expert_prefetch, fitted), gate=expert_prefetch_gate)
            except ValueError as exc:  # arrays that do not fit the manifest's pools
                raise ArtifactError(f"{directory / WEIGHTS}: {exc}") from None
            del host
        by_pool = dict(zip([p["name"] for p in offload["pools"]], self.experts.pools)) if offload else {}
        it = iter(keys)
        self.weights = [by_pool[n] if n in by_pool else tvm.runtime.tensor(stored[next(it)], self.device) for n in names]
        del stored
        cfg = manifest["model"]
        self.vocab_size = cfg["vocab_size"]
        # the model's smallest sliding window (None: causal everywhere): the paged attention spans whole sequences,
        # which equals the model's windowed attention only while a sequence holds at most that many tokens
        self.max_context = cfg.get("max_context")
        self.token_dtype = manifest.get("token_input_dtype", "int64")
        self.max_batch, self.max_total_tokens, self.page_size = max_batch, max_total_tokens, page_size
        self.prefill_chunk = prefill_chunk
        self.kv_cache = manifest.get("options", {}).get("kv_cache", "paged")
        self.tiered = None
        self._prefill = self.vm["prefill"]
        self._decode = self.vm["decode"]
        self._argmax = self.vm["argmax"] if "argmax" in manifest.get("entry_functions", {}) else None
        self._init_graph(manifest, directory, device, cuda_graph)
        self.lengths: dict[int, int] = {}
        self._next_id = 0
        if self.kv_cache in ("fp8", "tiered"):
            self.tiered = _TieredState(self, manifest["options"]["tiered"], t1_pages, t2_pages)
            return
        self.cache = self.vm["create_kv_cache"](
            self._shape([max_batch]), self._shape([max_total_tokens]), self._shape([prefill_chunk]), self._shape([page_size])
        )
        g = tvm.get_global_func
        self._add = g("vm.builtin.kv_state_add_sequence")
        self._remove = g("vm.builtin.kv_state_remove_sequence")
        self._begin = g("vm.builtin.kv_state_begin_forward")
        self._end = g("vm.builtin.kv_state_end_forward")

    def _init_graph(self, manifest: dict, directory: Path, device: str, cuda_graph: bool | None) -> None:
        """The ``decode_graph`` entry and its bounds, when used (see ``moec.passes.cuda_graph``)."""
        doc = (manifest.get("options") or {}).get("cuda_graph")
        if cuda_graph not in (None, True, False):
            raise MoecError(f"cuda_graph must be True, False or None, got {cuda_graph!r}")
        if cuda_graph and not doc:
            raise MoecError(f"{directory}: artifact has no CUDA graphs (compile it with --cuda-graph)")
        self._decode_graph, self._greedy_graph, self.graph_bounds, self.graph_widths = None, None, None, None
        self.graph_steps = 0  # decode steps that ran through the graphs
        self.greedy_graph_steps = 0  # of which through decode_graph_greedy (the argmax captured too)
        self.chained_steps = 0  # decode steps whose input ids were the previous step's argmax on the device
        if doc and device == "cuda" and cuda_graph is not False:
            self._decode_graph = self.vm[doc["entry"]]
            if doc.get("greedy_entry") and self._argmax is not None:  # (artifacts before it: the argmax after the graphs)
                self._greedy_graph = self.vm[doc["greedy_entry"]]
            self.graph_bounds = doc["bounds"]
            widths = doc.get("max_table_widths")
            self.graph_widths = (widths["t1"], widths["t2"]) if widths else None

    # ----------------------------------------------------------- sequences
    def add_sequence(self) -> int:
        if len(self.lengths) >= self.max_batch:
            raise CacheExhausted(f"KV cache holds at most {self.max_batch} sequences; release one first")
        seq = self._next_id
        if self.tiered is not None:
            self.tiered.add(seq)
        else:
            self._add(self.cache, seq)
        self._next_id += 1
        self.lengths[seq] = 0
        return seq

    @contextlib.contextmanager
    def kernel_profile(self):
        """Time every call the VM makes (kernels and ``vm.builtin`` helpers) while the block runs.

        Yields ``{symbol: [calls, seconds]}``, filled as calls finish. The device is synchronised before
        and after each call, so a kernel's time is its own (plus its launch); the forwards run slower
        than unprofiled ones, and only the split between kernels is meant to be read from it. With CUDA graphs a
        replayed region is one call (``vm.builtin.cuda_graph.run_or_capture``); the calls of a region being captured
        are neither synchronised (a capture forbids it) nor counted.
        """
        import time

        import tvm_ffi

        acc: dict[str, list] = {}
        started: dict[str, float] = {}
        sync = self.device.sync
        capturing = [0]  # depth of run_or_capture calls

        def instrument(func, symbol, before, ret, *args):
            name = str(symbol)
            graph = name == _RUN_OR_CAPTURE
            if capturing[0] and not (graph and not before):
                return 0
            if graph and not before:
                capturing[0] -= 1
                if capturing[0]:
                    return 0
            sync()
            if before:
                started[symbol] = time.perf_counter()
                capturing[0] += graph
            else:
                a = acc.setdefault(name, [0, 0.0])
                a[0] += 1
                a[1] += time.perf_counter() - started.pop(symbol)
            return 0  # VMInstrumentReturnKind: run the call

        self.vm.set_instrument(tvm_ffi.convert(instrument))
        try:
            yield acc
        finally:
            self.vm.set_instrument(None)

    def release(self, seq: int) -> None:
        if seq in self.lengths:
            if self.tiered is not None:
                self.tiered.remove(seq)
            else:
                self._remove(self.cache, seq)
            del self.lengths[seq]

    def _graph_max_batch(self) -> int:
        """The most streams a decode step may have to run through the CUDA graphs (0 when they are not used)."""
        return self.graph_bounds["max_batch"] if self._decode_graph is not None else 0

    def _pages(self, n: int) -> int:
        return -(-n // self.page_size)

    def _reserve(self, seq_ids, counts) -> None:
        for s in seq_ids:
            if s not in self.lengths:
                raise MoecError(f"unknown sequence id {s}")
        after = dict(self.lengths)
        for s, c in zip(seq_ids, counts):
            after[s] += c
        pages = sum(self._pages(n) for n in after.values())
        if pages * self.page_size > self.max_total_tokens:
            raise CacheExhausted(
                f"KV cache exhausted: {sum(after.values())} tokens in {pages} pages would exceed the "
                f"{self.max_total_tokens}-token cache; release sequences or load with a larger max_total_tokens"
            )

    def _run(self, fn, seq_ids, tokens_per_seq, logit_pos=None, on_device: bool = False, device_ids=None,
             greedy: bool = False):
        """One forward; the logits ``[b, V]`` on the host, or (``on_device``) the ``[1, b, V]`` device tensor.
        ``device_ids``: instead of ``tokens_per_seq``, one token a sequence already on the device (``[1, b]``, the
        token dtype: the previous step's ``argmax``). ``greedy`` (a decode step, with the device argmax): each row's
        greedy token instead, the ``[1, b]`` device tensor (through ``decode_graph_greedy`` where the graphs serve the
        step: no logits leave the graphs' memory)."""
        if self.experts is not None:  # the compiled graph asks this engine's expert store for residency
            global _ACTIVE_EXPERTS
            _ACTIVE_EXPERTS = weakref.ref(self.experts)
            self.experts.begin()
        counts = [1] * len(seq_ids) if device_ids is not None else [len(t) for t in tokens_per_seq]
        for s in seq_ids:
            if s not in self.lengths:
                raise MoecError(f"unknown sequence id {s}")
        if self.max_context is not None:  # (a sliding-window model; nothing a step otherwise)
            for s, c in zip(seq_ids, counts):
                self._check_context(s, self.lengths[s] + c)
        if device_ids is not None:  # (argmax's ids: in range by construction)
            flat = device_ids
        else:
            flat = np.concatenate([np.asarray(t, dtype=self.token_dtype) for t in tokens_per_seq])[None, :]
            if flat.size and (flat.min() < 0 or flat.max() >= self.vocab_size):
                raise MoecError(f"token ids must be in [0, {self.vocab_size})")
        graph = self._decode_graph if fn is self._decode and len(seq_ids) <= self._graph_max_batch() else None
        if greedy and graph is not None and self._greedy_graph is not None:
            graph = self._greedy_graph
        if self.tiered is not None:
            out, graphed = self.tiered.forward(fn, list(seq_ids), counts, flat, logit_pos, graph=graph)
            for s, c in zip(seq_ids, counts):
                self.lengths[s] += c
            if greedy:
                return self._greedy_tokens(out, graphed)
            return out if on_device else out.numpy()[0]
        self._reserve(seq_ids, counts)
        if graph is not None:
            fn = graph
            self.graph_steps += 1
        self._begin(self.cache, self._shape(list(seq_ids)), self._shape(counts))
        try:
            ids = self.inputs.put("ids", flat) if isinstance(flat, np.ndarray) else flat
            if logit_pos is None:
                out = fn(ids, self.cache, *self.weights)
            else:
                pos = self.inputs.put("logit_pos", np.asarray(logit_pos, dtype="int32"))
                out = fn(ids, pos, self.cache, *self.weights)
        finally:
            self._end(self.cache)
        for s, c in zip(seq_ids, counts):
            self.lengths[s] += c
        if greedy:
            return self._greedy_tokens(out, graph)
        return out if on_device else out.numpy()[0]

    def _greedy_tokens(self, out, graph):
        """A greedy step's tokens on the device: ``out`` itself if the greedy graph entry ran, else its logits' argmax."""
        if graph is not None and graph is self._greedy_graph:
            self.greedy_graph_steps += 1
            return out
        return self._argmax(out)

    # ----------------------------------------------------------- public API
    def fill_synthetic(self, lengths, seed: int = 0) -> list[int]:
        """Benchmarking only: new sequences whose caches hold ``lengths[i]`` tokens of random, well-formed entries,
        without running prefill (tiered and FP8 caches).

        The page tables are filled as prefill leaves them (appends of one prefill chunk, each followed by the
        re-rank's plan in the tiered cache), and every pool is overwritten with random values: FP8 codes without
        NaN, positive scales and 2-bit statistics, positions below each length. A decode step then reads exactly
        the bytes it reads after a real prefill of that length, so its time is measured without the prefill; what
        it computes is meaningless. Returns the sequence ids, to be decoded and released as usual.
        """
        if self.tiered is None:
            raise MoecError("fill_synthetic needs the tiered or FP8 cache (--kv-cache tiered|fp8)")
        lengths = [int(n) for n in lengths]
        if any(n < 1 for n in lengths):
            raise MoecError("fill_synthetic: every length must be positive")
        if len(self.lengths) + len(lengths) > self.max_batch:
            raise CacheExhausted(f"KV cache holds at most {self.max_batch} sequences; release some first")
        seqs = []
        try:
            for n in lengths:
                seqs.append(self.add_sequence())
                self.tiered.fill_tables(seqs[-1], n, self.prefill_chunk)
                self.lengths[seqs[-1]] = n
        except CacheExhausted:
            for s in seqs:
                self.release(s)
            raise
        self.tiered.fill_random_pools(max(lengths), np.random.default_rng(seed))
        return seqs

    def prefill(self, token_id_lists, seq_ids=None, logit_positions=None):
        """Append prompts (one per sequence; new sequences unless ``seq_ids`` given).

        Returns ``(seq_ids, logits[b, V])`` with the logits of each prompt's last token, or, with
        ``logit_positions`` (a list of positions per prompt, 0-based within the prompt),
        ``(seq_ids, [logits[len(positions_i), V] for each prompt])``.
        Prompts longer than the prefill chunk are processed in chunks.
        """
        token_id_lists = [list(map(int, t)) for t in token_id_lists]
        if any(len(t) == 0 for t in token_id_lists):
            raise MoecError("every prompt needs at least one token")
        if logit_positions is None:
            want = [[len(t) - 1] for t in token_id_lists]
        else:
            if len(logit_positions) != len(token_id_lists):
                raise MoecError("logit_positions needs one list of positions per prompt")
            want = [sorted(set(map(int, p))) for p in logit_positions]
            for i, (p, t) in enumerate(zip(want, token_id_lists)):
                if p and not (0 <= p[0] and p[-1] < len(t)):
                    raise MoecError(f"logit position out of range for prompt {i} of {len(t)} tokens")
        for i, t in enumerate(token_id_lists if self.max_context is not None else ()):  # before any sequence grows
            have = 0 if seq_ids is None or i >= len(seq_ids) or seq_ids[i] not in self.lengths else self.lengths[seq_ids[i]]
            self._check_context(None if seq_ids is None else seq_ids[i], have + len(t))
        if seq_ids is None and self.tiered is None:
            need = sum(self._pages(len(t)) for t in token_id_lists) * self.page_size
            used = sum(self._pages(n) for n in self.lengths.values()) * self.page_size
            if used + need > self.max_total_tokens:
                raise CacheExhausted(f"KV cache exhausted: prompts need {need} token slots, {self.max_total_tokens - used} free")
        if seq_ids is None:
            if len(self.lengths) + len(token_id_lists) > self.max_batch:
                raise CacheExhausted(f"KV cache holds at most {self.max_batch} sequences; release some first")
            seq_ids = [self.add_sequence() for _ in token_id_lists]
        logits = [[] for _ in seq_ids]
        # chunk so that no call exceeds the prefill chunk size; (index, seq, tokens, offset in prompt)
        pending = [(i, s, t, 0) for i, (s, t) in enumerate(zip(seq_ids, token_id_lists))]
        outs = []  # (device logits of a chunk, the prompt of each row)
        while pending:
            batch, budget, rest = [], self.prefill_chunk, []
            for i, s, t, off in pending:
                if budget <= 0:
                    rest.append((i, s, t, off))
                    continue
                take = t[:budget]
                batch.append((i, s, take, off))
                budget -= len(take)
                if len(take) < len(t):
                    rest.append((i, s, t[len(take):], off + len(take)))
            pos, owners, base = [], [], 0
            for i, _, take, off in batch:
                for p in want[i]:
                    if off <= p < off + len(take):
                        pos.append(base + p - off)
                        owners.append(i)
                base += len(take)
            # the logits stay on the device until every chunk is enqueued: the host prepares chunk i + 1 (page tables,
            # input copies, launches) while the device runs chunk i, instead of waiting for it
            outs.append((self._run(self._prefill, [s for _, s, _, _ in batch], [t for _, _, t, _ in batch], pos or [base - 1],
                                   on_device=True), owners))
            pending = rest
            if self.tiered is not None:
                self.tiered.rerank([s for _, s, _, _ in batch])  # the prompt's tokens compete for tier 1 now
        for out, owners in outs:
            host = out.numpy()[0]
            for row, i in enumerate(owners):
                logits[i].append(host[row])
        if logit_positions is None:
            return list(seq_ids), np.stack([rows[0] for rows in logits])
        vocab = self.vocab_size
        return list(seq_ids), [np.stack(rows) if rows else np.zeros((0, vocab), np.float32) for rows in logits]

    def decode(self, seq_ids, tokens) -> np.ndarray:
        """Append one token per sequence; returns logits[b, V]."""
        return self._decode_step(seq_ids, tokens, on_device=False)

    def decode_greedy(self, seq_ids, tokens) -> np.ndarray:
        """Append one token per sequence; returns each sequence's greedy next token (int64 ``[b]``).

        The argmax runs on the device (the artifact's ``argmax`` entry), so only ``b`` token ids cross
        to the host; an artifact built before that entry existed takes the argmax of host logits."""
        if self._argmax is None:
            return self.decode(seq_ids, tokens).argmax(-1)
        return self._decode_step(seq_ids, tokens, on_device=True, greedy=True).numpy()[0].astype(np.int64)

    def decode_greedy_steps(self, seq_ids, tokens, steps: int):
        """``steps`` greedy decode steps of the same sequences from ``tokens`` (one a sequence); yields each step's
        tokens (int64 ``[b]``), as ``decode_greedy`` called in a loop would return them.

        Pipelined: each step's argmax stays on the device as the next step's input ids, and its copy to the host
        is read only after the next step has been enqueued, so the host's work for step i + 1 (page tables, their
        copies, the kernel launches) overlaps step i on the device instead of following it. The caller sees a
        step's tokens one step late, so a sequence that should stop has one more token appended than it keeps
        (``release`` frees it alike). Artifacts without the device argmax, or whose argmax is not of the token
        dtype, run the plain loop."""
        seq_ids = list(seq_ids)
        if len(seq_ids) != len(tokens):
            raise MoecError("decode needs one token per sequence")
        if steps < 0:
            raise MoecError(f"steps must be >= 0, got {steps}")
        if self._argmax is None:
            for _ in range(steps):
                tokens = self.decode_greedy(seq_ids, tokens)
                yield tokens
            return
        ids, pending = None, None
        for _ in range(steps):
            if ids is None:
                ids = self._decode_step(seq_ids, tokens, on_device=True, greedy=True)
            else:
                ids = self._decode_step(seq_ids, None, on_device=True, device_ids=ids, greedy=True)
                self.chained_steps += 1
            if str(ids.dtype) != self.token_dtype:  # an older artifact's int32 argmax: through the host
                tokens, ids = ids.numpy()[0].astype(np.int64), None
                yield tokens
                continue
            handle = self._readback.start(ids)
            if pending is not None:
                yield self._readback.fetch(pending)
            pending = handle
        if pending is not None:
            yield self._readback.fetch(pending)

    def _check_context(self, seq, length: int) -> None:
        """Refuses growing sequence ``seq`` (None: a new one) to ``length`` tokens past ``max_context``."""
        if self.max_context is not None and length > self.max_context:
            layers = [layer["index"] for layer in self.manifest["structure"]["layers"]
                      if layer["attention"].get("sliding_window") == self.max_context]
            raise ContextTooLong(
                f"{'a new sequence' if seq is None else f'sequence {seq}'} would hold {length} tokens; the model's "
                f"attention sees at most {self.max_context} (the sliding window of layer{'s' * (len(layers) > 1)} "
                f"{', '.join(map(str, layers))}) and the compiled attention spans whole sequences: longer ones are refused")

    def _decode_step(self, seq_ids, tokens, on_device: bool, device_ids=None, greedy: bool = False):
        if device_ids is None and len(seq_ids) != len(tokens):
            raise MoecError("decode needs one token per sequence")
        per_seq = None if device_ids is not None else [[int(t)] for t in tokens]
        out = self._run(self._decode, list(seq_ids), per_seq, on_device=on_device, device_ids=device_ids, greedy=greedy)
        if self.tiered is not None:
            self.tiered.after_decode_step(list(seq_ids))
        return out

    def generate(self, token_id_lists, max_new_tokens: int, stop_token: int | None = None) -> list[list[int]]:
        """Greedy generation for a batch of prompts; returns the new tokens of each. Without a stop token the batch
        never changes, and the steps run pipelined (``decode_greedy_steps``)."""
        for t in token_id_lists:  # refused before any work: the prompt and all but the last new token are cached
            self._check_context(None, len(t) + max(0, int(max_new_tokens) - 1))
        seq_ids, logits = self.prefill(token_id_lists)
        try:
            if stop_token is None:
                first = logits.argmax(-1)
                steps = np.stack([first] + list(self.decode_greedy_steps(seq_ids, list(first), max(0, max_new_tokens - 1))))
                return [[int(t) for t in steps[: max(0, max_new_tokens), j]] for j in range(len(seq_ids))]
            outs = [[] for _ in seq_ids]
            active = list(range(len(seq_ids)))
            nxt = logits.argmax(-1)
            for step in range(max_new_tokens):
                for j, i in enumerate(active):
                    outs[i].append(int(nxt[j]))
                active_next = [i for j, i in enumerate(active) if stop_token is None or int(nxt[j]) != stop_token]
                nxt_tokens = [int(nxt[j]) for j, i in enumerate(active) if i in active_next]
                active = active_next
                if step + 1 == max_new_tokens or not active:
                    break
                nxt = self.decode_greedy([seq_ids[i] for i in active], nxt_tokens)
            return outs
        finally:
            for s in seq_ids:
                self.release(s)


class _TieredState:
    """The tiered FP8 + 2-bit cache of an engine: pools on the device, page tables on the host.

    Each forward reserves tier-1 slots for its tokens (all or nothing; ``CacheExhausted`` otherwise),
    passes the page tables and the tokens' slots, positions and visible tier-1 prefixes to the entry
    function, which quantizes and appends K/V, attends and accumulates importance in place. ``rerank``
    demotes the least important tier-1 tokens of a sequence over its budget into 2-bit pages: after each
    prefill call of the sequence, and after every ``rerank_every`` of its own decode steps since its last
    re-rank. The counts are per sequence (as the reference decoder's for one sequence), so when a stream's
    cache is re-ranked does not depend on when other streams joined the batch.

    Pool sizes (pages of ``t1_page`` / ``t2_page`` tokens, shared by all layers) default to what
    ``max_total_tokens`` tokens in ``max_batch`` sequences can need: tier 2 for all of them; tier 1
    for the budget share plus, per sequence, the sink and window, one tier-2 page of not yet demoted
    excess, the tokens of ``rerank_every`` steps and a partial page, plus one prefill chunk.
    """

    def __init__(self, engine: "Engine", opts: dict, t1_pages: int | None, t2_pages: int | None) -> None:
        from .kv_cache import POOLS, TieredPageTables, pool_specs

        self.e, self.opts = engine, opts
        self.mode = opts["mode"]
        cfg = engine.manifest["model"]
        ps1, ps2 = opts["t1_page"], opts["t2_page"]
        total, batch = engine.max_total_tokens, engine.max_batch
        full1 = -(-total // ps1) + batch
        if t1_pages is None:
            if self.mode == "fp8":
                t1_pages = full1
            else:
                per_seq = opts["sink"] + opts["recent"] + ps2 + opts["rerank_every"] + ps1
                t1_pages = min(full1, -(-int(opts["tier1_fraction"] * total + batch * per_seq + engine.prefill_chunk) // ps1))
        if t2_pages is None:
            t2_pages = max(1, total // ps2) if self.mode == "tiered" else 1
        fraction = opts["tier1_fraction"] if self.mode == "tiered" else 1.0
        self.tables = TieredPageTables(t1_pages, t2_pages, ps1, ps2, max_sequences=batch, tier1_fraction=fraction,
                                       sink=opts["sink"], recent=opts["recent"])
        tvm = engine._tvm
        specs = pool_specs(cfg["num_layers"], t1_pages, t2_pages, cfg["num_kv_heads"], cfg["head_dim"], ps1, ps2)
        # zeroed once: the kernels read whole pages and tiles, and mask the slots past a row's length by their weight
        # (0 x value), which garbage from recycled device memory (an FP8 NaN byte) would turn into NaN. Everything the
        # kernels write is finite, so a page freed by one sequence and reused by another is harmless.
        self.pools = [_zeroed(tvm, specs[name][0], specs[name][1], engine.device) for name in POOLS]
        self.pool_bytes = sum(int(np.prod(shape)) * np.dtype(dt).itemsize for shape, dt in specs.values())
        self._rerank = engine.vm["rerank"] if self.mode == "tiered" else None
        self.slot: dict[int, int] = {}
        self.decoded: dict[int, int] = {}  # sequence -> its decode steps since its last re-rank
        self.reranks = 0

    def add(self, seq: int) -> None:
        self.slot[seq] = self.tables.add_sequence()
        self.decoded[seq] = 0

    def remove(self, seq: int) -> None:
        self.tables.remove_sequence(self.slot.pop(seq))
        self.decoded.pop(seq, None)

    def _tensor(self, a, key):
        return self.e.inputs.put(key, a)

    def forward(self, fn, seq_ids, counts, flat, logit_pos, graph=None):
        """One forward; ``graph`` (a graph entry, for a decode step of few enough rows) runs it instead of ``fn`` when
        the page tables fit its widths, with the widths rounded up to powers of two (fewer captures). Returns the first
        output on the device and the graph entry that ran, or None."""
        pt = self.tables
        slots = [self.slot[s] for s in seq_ids]
        decode_step = all(n == 1 for n in counts)  # one token a row: every input array at once, below
        before = None if decode_step else {s: (pt.seqs[s].length, pt.seqs[s].t1_len) for s in slots}
        pt.append(dict(zip(slots, counts)))  # all or nothing: raises CacheExhausted before any change
        tab = pt.tables(slots)
        t1_rows = tab["t1_table"]  # unpadded, for the decode step's append slots
        if graph is not None:
            w1, w2 = self.e.graph_widths
            t1, t2 = tab["t1_table"], tab["t2_table"]
            if t1.shape[1] <= w1 and t2.shape[1] <= w2:
                tab = dict(tab, t1_table=_pad_width(t1, w1), t2_table=_pad_width(t2, w2))
                fn = graph
                self.e.graph_steps += 1
        if decode_step:
            rows = np.arange(len(slots), dtype=np.int32)
            q_t1 = tab["t1_len"]  # after the append: the new token is the last tier-1 token of its row
            q_slot = pt.last_slots(t1_rows, q_t1)
            cache = [tab["length"] - 1, q_slot, rows, q_t1, np.arange(len(slots) + 1, dtype=np.int32),
                     tab["t1_table"], tab["t2_table"], tab["t2_np"]]
        else:
            q_pos, q_slot, q_row, q_t1 = [], [], [], []
            for row, (s, n) in enumerate(zip(slots, counts)):
                length, t1 = before[s]
                q_pos.append(np.arange(length, length + n, dtype=np.int32))
                q_slot.append(pt.append_slots(s, n))
                q_row.append(np.full(n, row, np.int32))
                q_t1.append(np.arange(t1 + 1, t1 + n + 1, dtype=np.int32))
            indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
            cache = [np.concatenate(q_pos), np.concatenate(q_slot), np.concatenate(q_row), np.concatenate(q_t1), indptr,
                     tab["t1_table"], tab["t2_table"], tab["t2_np"]]
        args = [self._tensor(flat, "ids") if isinstance(flat, np.ndarray) else flat]
        if logit_pos is not None:
            args.append(self._tensor(np.asarray(logit_pos, dtype=np.int32), "logit_pos"))
        args += [self._tensor(a, f"step{i}") for i, a in enumerate(cache)] + self.pools
        # (logits, *pools updated in place), or the greedy graph's (tokens, *pools): on the device; and the graph run
        return fn(*args, *self.e.weights)[0], (graph if fn is graph else None)

    def fill_tables(self, seq: int, n: int, chunk: int) -> None:
        """Page tables of ``seq`` as a prefill of ``n`` tokens in ``chunk``-token calls leaves them (no kernel runs)."""
        slot = self.slot[seq]
        for c in range(0, n, chunk):
            self.tables.append({slot: min(chunk, n - c)})
            if self._rerank is not None:
                self.tables.plan_rerank(slot)

    def fill_random_pools(self, max_length: int, rng) -> None:
        """Every pool overwritten with random, well-formed values (see ``Engine.fill_synthetic``): a random block of at
        most 16M elements repeated over each pool."""
        from .kv_cache import POOLS

        for name, pool in zip(POOLS, self.pools):
            shape = tuple(int(x) for x in pool.shape)
            dtype = np.dtype(str(pool.dtype))
            block = min(int(np.prod(shape)), 1 << 24)
            if name.endswith("_pos"):
                vals = rng.integers(0, max_length, block, dtype=np.int32)
            elif dtype == np.uint8:  # FP8 codes without NaN (tier 1), 2-bit codes (tier 2)
                vals = rng.integers(0, 256, block, dtype=np.uint8) & (0x77 if name.startswith("t1_") else 0xFF)
            elif name == "t1_mass":
                vals = rng.uniform(0.0, 1.0, block)
            else:  # FP8 scales, 2-bit means and deviations
                vals = rng.uniform(0.01, 0.1, block)
            pool.copyfrom(np.resize(vals.astype(dtype), shape))

    def after_decode_step(self, seq_ids) -> None:
        """One decode step of ``seq_ids`` done: re-rank those with ``rerank_every`` decode steps since their last."""
        every = self.opts["rerank_every"]
        for s in seq_ids:
            self.decoded[s] += 1
        self.rerank([s for s in seq_ids if self.decoded[s] >= every])

    def rerank(self, seq_ids) -> None:
        """Demote what is over budget in these sequences (the tables before the plan go to the kernel)."""
        for s in seq_ids:
            self.decoded[s] = 0
        if self._rerank is None or not seq_ids:
            return
        pt = self.tables
        slots = [self.slot[s] for s in seq_ids]
        tab = pt.tables(slots)
        plans = [pt.plan_rerank(s) for s in slots]
        rows = [i for i, p in enumerate(plans) if p.demote]
        if not rows:
            return
        width = max(len(plans[i].new_t2_pages) for i in rows)
        new = np.zeros((len(rows), width), np.int32)
        for j, i in enumerate(rows):
            new[j, : len(plans[i].new_t2_pages)] = plans[i].new_t2_pages
        t1_table = tab["t1_table"][rows]
        args = [t1_table, tab["t1_len"][rows], tab["length"][rows], np.array([plans[i].demote for i in rows], np.int32), new]
        self._rerank(*[self._tensor(a, f"rerank{i}") for i, a in enumerate(args)], *self.pools)
        self.reranks += 1


class _InputBuffers:
    """Device buffers the per-call inputs (token ids, positions, page tables) are copied into, kept from call to call.

    A fresh device tensor per input and call costs a device allocation, and its release a free that on CUDA waits
    for the device; a step copies about ten such arrays. Each input key keeps one buffer, grown to the next power of
    two when an array outgrows it, and an array is copied into a view of the buffer's front with its own shape.

    On CUDA (``driver``) an array goes through page-locked host memory with an asynchronous copy enqueued on the
    kernels' stream, so the host does not wait for the device: the copy runs after the kernels enqueued before it
    (the previous call's readers of the buffer) and before the next call's. Each key has two host stages used in
    turn, each with an event recorded after its copy; a stage is rewritten only once its last copy has run."""

    def __init__(self, tvm, device, driver=None) -> None:
        self._tvm, self._device, self._bufs = tvm, device, {}
        self._drv = driver
        self._stream = launch_stream() if driver is not None else 0
        self._stages: dict = {}  # key -> PinnedStages (two)

    def put(self, key, a: np.ndarray):
        a = np.ascontiguousarray(a)
        buf = self._bufs.get(key)
        if buf is None or str(buf.dtype) != str(a.dtype) or buf.shape[0] < a.size:
            cap = 1 << max(0, a.size - 1).bit_length()
            buf = self._bufs[key] = self._tvm.runtime.empty((max(cap, 1),), str(a.dtype), self._device)
        view = buf._create_view(a.shape)  # (the front of the buffer: no byte offset, which kernels refuse)
        if not a.size:
            return view
        if self._drv is None:
            view.copyfrom(a)
            return view
        stages = self._stages.get(key)
        if stages is None:
            stages = self._stages[key] = PinnedStages(self._drv)
        host, addr, ev = stages.take(a.nbytes)
        host[: a.nbytes] = a.reshape(-1).view(np.uint8)
        self._drv.htod(buf.data_ptr(), addr, a.nbytes, self._stream)
        self._drv.record(ev, self._stream)
        return view


class _TokenReadback:
    """Token ids read back from the device without waiting for the kernels enqueued after them: an asynchronous
    copy into page-locked host memory and an event (two buffers used in turn). On the CPU, a plain copy."""

    def __init__(self, driver=None) -> None:
        self._drv = driver
        self._stages = PinnedStages(driver) if driver is not None else None
        self._stream = launch_stream() if driver is not None else 0

    def start(self, tokens):
        """Enqueue the copy of ``tokens`` (a device tensor [1, n]); returns a handle for ``fetch``."""
        if self._drv is None:
            return tokens.numpy()[0].astype(np.int64)
        n = int(np.prod([int(x) for x in tokens.shape]))
        nbytes = n * np.dtype(str(tokens.dtype)).itemsize
        host, addr, ev = self._stages.take(nbytes)
        self._drv.dtoh(addr, tokens.data_ptr(), nbytes, self._stream)
        self._drv.record(ev, self._stream)
        return (host, ev, n, str(tokens.dtype))

    def fetch(self, handle) -> np.ndarray:
        """The token ids [n] (int64) of a ``start``: waits for that copy only."""
        if self._drv is None:
            return handle
        host, ev, n, dtype = handle
        self._drv.wait_event(ev)
        return host[: n * np.dtype(dtype).itemsize].view(dtype).astype(np.int64)


def _zeroed(tvm, shape, dtype: str, device):
    """A device tensor of zeros (one host-to-device copy from calloc'ed, untouched pages)."""
    out = tvm.runtime.empty(shape, dtype, device)
    out.copyfrom(np.zeros(shape, dtype))
    return out


def _pad_width(table: np.ndarray, bound: int) -> np.ndarray:
    """``table`` widened with page 0 to the next power of two (at most ``bound``): the kernels read only each row's own
    pages, and a graph is captured per distinct width."""
    width = min(bound, 1 << max(0, table.shape[1] - 1).bit_length())
    if width == table.shape[1]:
        return table
    out = np.zeros((table.shape[0], width), table.dtype)
    out[:, : table.shape[1]] = table
    return out


def load(directory: str | Path, device: str = "cpu", **kwargs) -> Engine:
    """Load an artifact directory onto ``device`` ("cpu" or "cuda")."""
    return Engine(directory, device, **kwargs)
