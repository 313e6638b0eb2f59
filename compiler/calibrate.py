"""``moec calibrate MODEL --data ... -o DIR``: expert groups and coarse routers for cascade gating, from data.

Calibration text runs through the model; per MoE layer the router inputs x [T, D] (the RMSNorm
output the router reads) are recorded, and with the router weight W [E, D] the flat top-k set of
every token. Then, for each requested group count G:

  * groups: the expert co-activation graph (nodes experts, edge weight the number of tokens whose
    top-k holds both) is cut into G groups of E/G experts by recursive Kernighan-Lin bisection
    (``networkx``, sizes kept balanced by its pairwise swaps, several random starts and the
    data-free grouping as one more), then polished by the best pairwise swaps between any two groups;
    the grouping with most co-activations inside groups wins;
  * coarse router: per group, the least-squares fit (tiny ridge, bias free) of the group's
    log-sum-exp of fine logits on [x, 1]: ``x @ Cr_g + b_g ~ logsumexp(x @ W_g^T)``;
  * a check on held-out calibration windows (every ``check_every``-th window is kept out of the fit):
    top-k set agreement of the cascade (``models.cascade.cascade_route``, the pass's numerics) with
    the flat router on the same hidden states, for every g, both for these groups and for the
    data-free ones ``moec compile`` uses without calibration; and ``keep_default``, the fewest groups
    kept whose agreement reaches ``target`` in every layer (G if none).

And for offloaded experts (``moec compile --expert-slots N --calibration DIR``), per MoE layer l after the
first, a prefetch predictor of its experts from the previous MoE layer's router input: the ridge fit
``x_{l-1} @ P_l^T + p_l ~ x_l @ W_l^T`` of layer l's router logits on the fit windows (its top-k is what the
router's softmax or sigmoid picks), with the recall of its top-k + 0 / 1 / 2 on the check windows beside
that of the uncalibrated predictor (layer l's router on ``x_{l-1}`` rescaled by the two norms' weights).

MODEL is a trained reference directory (``moec train-reference``: the PyTorch reference runs the
text, router inputs from forward hooks) or an ONNX / ``.pt2`` file, as ``moec compile`` takes it:
there the router inputs that ``moe_structure.analyze`` finds become outputs of the imported forward,
compiled for and run on the CPU by TVM (``compiler.probe``), so the routers calibrated are the ones
CascadeGating rewrites, found by structure, whatever exported the file.

DIR (written atomically) holds ``calibration.json`` (format ``moec-calibration/1``: the model's
router signature with the SHA-256 of each router weight, the data, per G the groups, fit and check
figures, the SHA-256 of the tensor file) and ``coarse.safetensors`` (``G{G}.layer{i}.coarse`` [G, D],
``G{G}.layer{i}.bias`` [G], ``layer{i}.coactivation`` [E, E], ``prefetch.layer{i}.weight`` [E, D] and
``prefetch.layer{i}.bias`` [E]). ``moec compile --calibration DIR`` with ``--cascade-groups G`` and / or
offloaded experts reads them (``load_calibration``) and refuses a calibration made for another model,
for other group counts, or whose files are missing or corrupt.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .artifact import atomic_directory, read_json_document, sha256_file
from .errors import MoecError

FORMAT = "moec-calibration/1"
CALIBRATION = "calibration.json"
TENSORS = "coarse.safetensors"
TARGET_AGREEMENT = 0.99


# ---------------------------------------------------------------------------- grouping and fit


def coactivation(topk_ids: np.ndarray, num_experts: int) -> np.ndarray:
    """``[E, E]`` counts of tokens whose top-k set holds both experts (zero diagonal)."""
    onehot = np.zeros((topk_ids.shape[0], num_experts), dtype=np.float64)  # T, E
    np.put_along_axis(onehot, np.asarray(topk_ids, dtype=np.int64), 1.0, axis=1)
    counts = onehot.T @ onehot
    np.fill_diagonal(counts, 0.0)
    return counts


def within_share(counts: np.ndarray, groups) -> float:
    """Share of the co-activations (pairs in one token's top-k) that fall inside a group."""
    total = counts.sum()
    inside = sum(counts[np.ix_(g, g)].sum() for g in np.asarray(groups, dtype=np.int64))
    return float(inside / total) if total else 0.0


def _swap_refine(counts: np.ndarray, groups: list[list[int]], max_rounds: int = 1000) -> list[list[int]]:
    """Best-improvement pairwise swaps between groups until none adds co-activations inside groups."""
    e = counts.shape[0]
    assign = np.empty(e, dtype=np.int64)
    for gi, grp in enumerate(groups):
        assign[grp] = gi
    onehot = np.eye(len(groups))[assign]  # E, G
    for _ in range(max_rounds):
        link = counts @ onehot  # E, G: co-activations of each expert with each group
        own = link[np.arange(e), assign]  # E
        # gain of swapping a (group p) with b (group q): link[a,q] - own[a] + link[b,p] - own[b] - 2 c[a,b]
        gain = link[np.arange(e)[:, None], assign[None, :]] - own[:, None]  # E, E: a moved into b's group
        gain = gain + gain.T - 2 * counts
        gain[assign[:, None] == assign[None, :]] = -np.inf
        a, b = np.unravel_index(int(np.argmax(gain)), gain.shape)
        if gain[a, b] <= 1e-9:
            break
        assign[a], assign[b] = assign[b], assign[a]
        onehot = np.eye(len(groups))[assign]
    return [sorted(int(i) for i in np.flatnonzero(assign == gi)) for gi in range(len(groups))]


def _bisect(graph, nodes: list[int], parts: int, size: int, rng: np.random.Generator) -> list[list[int]]:
    from networkx.algorithms.community import kernighan_lin_bisection

    if parts == 1:
        return [sorted(nodes)]
    left = parts // 2
    perm = [int(i) for i in rng.permutation(nodes)]
    a, b = kernighan_lin_bisection(graph.subgraph(nodes), partition=(set(perm[: left * size]), set(perm[left * size:])),
                                   max_iter=50, weight="weight")
    if len(a) != left * size:  # the sides come back in either order; swaps keep their sizes
        a, b = b, a
    return _bisect(graph, sorted(a), left, size, rng) + _bisect(graph, sorted(b), parts - left, size, rng)


def coactivation_groups(counts: np.ndarray, num_groups: int, seed: int = 0, restarts: int = 8,
                        init: list | None = None) -> list[list[int]]:
    """Balanced partition of the co-activation graph into ``num_groups`` groups of E/G experts.

    Recursive Kernighan-Lin bisection from ``restarts`` random balanced starts (and ``init``, e.g. the
    data-free groups), each polished by pairwise swaps; the one with most co-activations inside
    groups. Deterministic given ``seed``. Groups are returned sorted.
    """
    import networkx as nx

    e = counts.shape[0]
    if e % num_groups:
        raise MoecError(f"{e} experts do not split into {num_groups} equal groups")
    size = e // num_groups
    graph = nx.Graph()
    graph.add_nodes_from(range(e))
    iu, ju = np.triu_indices(e, 1)
    graph.add_weighted_edges_from((int(i), int(j), float(counts[i, j])) for i, j in zip(iu, ju) if counts[i, j] > 0)
    starts = [_bisect(graph, list(range(e)), num_groups, size, np.random.default_rng([seed, r])) for r in range(restarts)]
    if init is not None:
        starts.append([sorted(int(i) for i in grp) for grp in init])
    best, best_share = None, -1.0
    for start in starts:
        groups = _swap_refine(counts, start)
        share = within_share(counts, groups)
        if share > best_share + 1e-12:
            best, best_share = groups, share
    return sorted(best)


def group_lse(logits: np.ndarray, groups) -> np.ndarray:
    """``[T, G]`` log-sum-exp of each group's fine logits (float64)."""
    out = []
    for grp in np.asarray(groups, dtype=np.int64):
        z = logits[:, grp].astype(np.float64)
        m = z.max(axis=1, keepdims=True)
        out.append(m[:, 0] + np.log(np.exp(z - m).sum(axis=1)))
    return np.stack(out, axis=1)


def fit_coarse_lstsq(x: np.ndarray, logits: np.ndarray, groups, ridge: float = 1e-6) -> tuple[np.ndarray, np.ndarray]:
    """Coarse router ``(Cr [G, D], b [G])``: least squares of each group's log-sum-exp on ``[x, 1]``.

    ``ridge`` (relative to the mean diagonal of X^T X, not applied to the bias) keeps the solve
    well-posed with few tokens or collinear hidden dimensions.
    """
    x64 = np.asarray(x, dtype=np.float64)
    t, d = x64.shape
    y = group_lse(logits, groups)  # T, G
    x1 = np.concatenate([x64, np.ones((t, 1))], axis=1)  # T, D+1
    gram = x1.T @ x1
    reg = ridge * max(float(np.trace(gram[:d, :d])) / d, 1e-12)
    gram[np.arange(d), np.arange(d)] += reg
    beta = np.linalg.solve(gram, x1.T @ y)  # D+1, G
    return beta[:d].T.copy(), beta[d].copy()


PREFETCH_RIDGE = 1e-3  # of the mean diagonal of [x, 1]^T [x, 1]
PREFETCH_TARGET = 0.9  # share of a layer's routed experts its prefetch should find ("extra_for_target")
PREFETCH_MAX_EXTRA = 6  # most extra experts per token the check considers


def fit_prefetch(x_prev: np.ndarray, logits: np.ndarray, ridge: float = PREFETCH_RIDGE) -> tuple[np.ndarray, np.ndarray]:
    """``(P [E, D], p [E])``: the ridge least-squares fit ``x_prev @ P^T + p ~ logits`` (float64 normal equations)."""
    xa = np.hstack([x_prev.astype(np.float64), np.ones((x_prev.shape[0], 1))])
    gram = xa.T @ xa
    lam = ridge * float(np.trace(gram)) / gram.shape[0]
    sol = np.linalg.solve(gram + lam * np.eye(gram.shape[0]), xa.T @ logits.astype(np.float64))  # [D + 1, E]
    return np.ascontiguousarray(sol[:-1].T, dtype=np.float32), sol[-1].astype(np.float32)  # (C order: safetensors stores the buffer)


def prefetch_recall(scores: np.ndarray, routed: np.ndarray, top_k: int, extra: int) -> float:
    """Mean over tokens of the share of the routed experts ``routed`` [T, K] among the ``top_k + extra`` best
    ``scores`` [T, E]."""
    k = min(top_k + extra, scores.shape[1])
    top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    hit = (top[:, :, None] == routed[:, None, :]).any(axis=1)  # T, K
    return float(hit.mean())


def _fit_quality(x: np.ndarray, logits: np.ndarray, groups, coarse: np.ndarray, bias: np.ndarray) -> dict:
    y = group_lse(logits, groups)
    pred = x.astype(np.float64) @ coarse.T + bias
    err = ((pred - y) ** 2).mean()
    var = ((y - y.mean(axis=0)) ** 2).mean()
    top = float((np.argmax(pred, 1) == np.argmax(y, 1)).mean())
    return {"lse_rmse": round(float(np.sqrt(err)), 6), "lse_r2": round(float(1 - err / var), 6) if var > 0 else None,
            "best_group_match": round(top, 6)}


# ---------------------------------------------------------------------------- recording router inputs


@dataclass
class RouterRecord:
    """One MoE layer's router: its weight rows [E, D], top-k, score, and the recorded inputs x [T, D]."""

    index: int
    rows: np.ndarray
    top_k: int
    score: str
    norm_weight: np.ndarray | None
    x: list = field(default_factory=list)

    @property
    def num_experts(self) -> int:
        return int(self.rows.shape[0])

    def inputs(self) -> np.ndarray:
        return np.concatenate(self.x) if self.x else np.zeros((0, self.rows.shape[1]), np.float32)


def rows_sha256(rows: np.ndarray) -> str:
    arr = np.ascontiguousarray(rows, dtype=np.float32)
    return hashlib.sha256(str(arr.shape).encode() + arr.tobytes()).hexdigest()


def router_rows(func, num_inputs: int, layer, weights: dict) -> np.ndarray:
    """A layer's router weight as ``[E, D]`` rows, from how the graph feeds it to the router matmul."""
    from .graph import DataflowGraph

    g = DataflowGraph(func, num_inputs)
    rhs = g.call(layer.router.linear_var).args[1]
    w = np.asarray(weights[layer.router.weight])
    return w if g.op(rhs) == "relax.permute_dims" else w.T


def _windows(tokens: np.ndarray, context: int, max_tokens: int | None) -> np.ndarray:
    """Non-overlapping windows of ``context`` tokens spread evenly over the stream, ``[N, context]``."""
    n_all = tokens.size // context
    if n_all < 2:
        raise MoecError(f"calibration data has {tokens.size} tokens: fewer than two windows of {context} (use --context)")
    n = n_all if not max_tokens else max(2, min(n_all, max_tokens // context))
    starts = np.linspace(0, tokens.size - context, n).astype(np.int64)
    return np.stack([tokens[s:s + context] for s in starts])


def _record_torch(path: Path, windows: np.ndarray, batch: int, progress: bool,
                  device: str = "cpu") -> tuple[list[RouterRecord], dict]:
    import torch

    from ..models.reference import Experts, Router
    from ..models.train import load_trained

    model, meta = load_trained(path)
    cfg = model.config
    if cfg.vocab_size <= int(windows.max()):
        raise MoecError(f"calibration data holds token id {int(windows.max())}, beyond the model's vocabulary {cfg.vocab_size}")
    records, handles = [], []
    for i, layer in enumerate(model.layers):
        r = layer.moe.router
        if not isinstance(r, Router):
            continue
        _check_flat(f"{path}: layer {i}", cfg.n_group, r.bias is not None, cfg.router_score)
        rec = RouterRecord(i, r.weight.detach().float().numpy().copy(), cfg.top_k, cfg.router_score,
                           layer.post_attention_norm.weight.detach().float().numpy().copy())
        records.append(rec)
        handles.append(r.register_forward_pre_hook(
            lambda _m, args, _rec=rec: _rec.x.append(args[0].detach().float().cpu().numpy())))
    for mod in model.modules():
        if isinstance(mod, Experts):
            mod.grouped = True  # the same function without the gathered expert weights
    model.to(device)
    try:
        with torch.no_grad():
            for s in _progress(range(0, len(windows), batch), progress, "calibrate (torch)"):
                ids = torch.from_numpy(windows[s:s + batch]).to(device)
                model(input_ids=ids, attention_mask=torch.ones_like(ids))
    finally:
        for h in handles:
            h.remove()
    info = {"kind": "trained", "path": str(path), "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size}
    return records, info


def _record_tvm(path: Path, windows: np.ndarray, batch: int, progress: bool,
                device: str = "cpu") -> tuple[list[RouterRecord], dict]:
    from .graph import DataflowGraph
    from .importers import import_model
    from .moe_structure import analyze
    from .probe import probe

    imported = import_model(path)
    func = imported.main
    structure = analyze(func, imported.num_inputs, imported.source_name)
    if structure.vocab_size <= int(windows.max()):
        raise MoecError(f"calibration data holds token id {int(windows.max())}, beyond the model's vocabulary {structure.vocab_size}")
    weights = dict(zip(imported.weight_names(), imported.weights))
    g = DataflowGraph(func, imported.num_inputs)
    records, xs = [], []
    for layer in structure.moe_layers:
        r = layer.router
        _check_flat(f"{path}: layer {layer.index} (router {r.weight})", r.n_group, r.bias is not None, r.score)
        norm = next((nm for nm in layer.norms if nm.role == "mlp"), None)
        nw = weights.get(norm.weight) if norm is not None else None
        records.append(RouterRecord(layer.index, router_rows(func, imported.num_inputs, layer, weights).astype(np.float32),
                                    r.top_k, r.score, None if nw is None else np.asarray(nw, np.float32).reshape(-1)))
        xs.append(g.call(r.linear_var).args[0])
    run = probe(func, xs)
    for s in _progress(range(0, len(windows), batch), progress, "calibrate (tvm)"):
        ids = windows[s:s + batch]
        outs = run([ids, np.ones_like(ids)][: imported.num_inputs], imported.weights)
        for rec, out in zip(records, outs):
            rec.x.append(out.reshape(-1, out.shape[-1]).astype(np.float32))
    info = {"kind": imported.source_kind, "path": str(path), "sha256": imported.source_hash,
            "num_layers": structure.num_layers, "hidden_size": structure.hidden_size, "vocab_size": structure.vocab_size}
    return records, info


def _check_flat(where: str, n_group: int, biased: bool, score: str) -> None:
    if n_group > 1:
        raise MoecError(f"{where}: the router is group-limited: its cascade is exact with its own groups "
                        "(moec compile --cascade-groups n_group), there is nothing to calibrate")
    if biased:
        raise MoecError(f"{where}: the router adds a bias to its scores before the top-k: cascade gating supports plain routers")
    if score not in ("softmax", "sigmoid"):
        raise MoecError(f"{where}: cascade gating needs softmax or sigmoid scores, got {score!r}")


def _progress(it, progress: bool, desc: str):
    if not progress:
        return it
    from tqdm import tqdm

    return tqdm(it, desc=desc, mininterval=2.0)


# ---------------------------------------------------------------------------- data


def load_tokens(data: str | Path, corpus=None) -> tuple[np.ndarray, dict]:
    """Calibration tokens: a corpus split (``train``/``heldout``), a token file (``.npy`` ids or ``.bin``
    little-endian uint16 as a corpus stores them), or text (a file, or a directory of .py/.txt files)
    encoded with the corpus tokenizer. Returns the stream and a description for the record."""
    if str(data) in ("train", "heldout"):
        if corpus is None:
            raise MoecError(f"--data {data} needs a corpus: give --corpus DIR (or calibrate a trained model directory)")
        return corpus.tokens(str(data)), {"kind": "corpus", "corpus": corpus.id, "split": str(data),
                                          "sha256": corpus.meta["splits"][str(data)]["sha256"]}
    path = Path(data)
    if not path.exists():
        raise MoecError(f"{path}: --data is neither 'train', 'heldout' nor an existing token or text file / directory")
    if path.is_file() and path.suffix in (".npy", ".bin"):
        try:
            arr = np.load(path) if path.suffix == ".npy" else np.fromfile(path, dtype="<u2")
        except Exception as exc:  # noqa: BLE001 - unreadable token file
            raise MoecError(f"{path}: cannot read tokens ({type(exc).__name__}: {exc})") from None
        if not np.issubdtype(arr.dtype, np.integer) or arr.size == 0 or arr.min() < 0:
            raise MoecError(f"{path}: expected non-negative integer token ids, got {arr.dtype} x {arr.size}")
        return arr.astype(np.int64).reshape(-1), {"kind": "tokens", "path": str(path), "sha256": sha256_file(path)}
    if corpus is None:
        raise MoecError(f"{path}: text needs a tokenizer: give --corpus DIR (or calibrate a trained model directory)")
    files = sorted(path.rglob("*.py")) + sorted(path.rglob("*.txt")) if path.is_dir() else [path]
    if not files:
        raise MoecError(f"{path}: no .py or .txt files")
    ids: list[int] = []
    for f in files:
        ids += corpus.tokenizer.encode(f.read_text(errors="replace")) + [corpus.tokenizer.eot_id]
    return np.asarray(ids, dtype=np.int64), {"kind": "text", "path": str(path), "files": len(files), "corpus": corpus.id}


# ---------------------------------------------------------------------------- calibrate


def _valid_keeps(num_experts: int, num_groups: int, top_k: int) -> list[int]:
    return [g for g in range(1, num_groups + 1) if g * (num_experts // num_groups) >= top_k]


def _agreement(x, rows, spec, top_k, score) -> float:
    import torch

    from ..models.cascade import cascade_route, flat_topk, set_agreement

    xt, wt = torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.ascontiguousarray(rows))
    with torch.no_grad():
        _, ids = cascade_route(xt, wt, spec, top_k, score)
        exact, _ = set_agreement(ids.numpy(), flat_topk(xt, wt, top_k).numpy())
    return round(exact, 6)


def calibrate(model, data, output_dir, groups=None, corpus=None, context: int = 1024, max_tokens: int | None = 65536,
              check_every: int = 10, batch_size: int = 4, seed: int = 0, target: float = TARGET_AGREEMENT,
              progress: bool = False, device: str = "cpu") -> Path:
    """Calibrate cascade gating for ``model`` on ``data`` and write ``output_dir`` (see the module docstring).

    Parameters
    ----------
    model : str | Path
        A trained reference directory, or an ONNX / ``.pt2`` file.
    data : str | Path
        ``"train"`` / ``"heldout"`` (a corpus split), a ``.npy`` / ``.bin`` token file, or text.
    groups : list[int], optional
        Group counts G to calibrate (default: every divisor of the expert count from 2 to E/2).
    corpus : str | Path | Corpus, optional
        The corpus for splits and text (default for a trained directory: the one it was trained on).
    context : int
        Window length in tokens; windows are spread evenly over the data.
    max_tokens : int, optional
        Tokens to run (``None``: all); every ``check_every``-th window is held out of the fit for the check.
    device : str
        Where a trained reference runs ("cpu" or "cuda"); ONNX / .pt2 models run on the CPU.
    """
    from ..models.corpus import Corpus, load_corpus
    from ..models.train import corpus_of, is_trained_dir
    from ..passes.cascade_gating import CascadeSpec, data_free_groups, fit_coarse

    t0 = time.perf_counter()
    model = Path(model)
    trained = is_trained_dir(model)
    if not trained and model.suffix not in (".onnx", ".pt2", ".pt"):
        raise MoecError(f"{model}: neither a trained model directory (config.json) nor an ONNX / .pt2 file")
    if corpus is not None and not isinstance(corpus, Corpus):
        corpus = load_corpus(corpus)
    if corpus is None and trained and Path(str(data)).suffix not in (".npy", ".bin"):
        corpus = corpus_of(json.loads((model / "config.json").read_text()))
    tokens, data_info = load_tokens(data, corpus)
    if check_every < 2:
        raise MoecError(f"check_every must be >= 2, got {check_every}")
    windows = _windows(tokens, context, max_tokens)
    if device != "cpu" and not trained:
        raise MoecError(f"{model}: ONNX / .pt2 models calibrate on the CPU (device {device!r} is for trained directories)")
    records, model_info = (_record_torch if trained else _record_tvm)(model, windows, batch_size, progress, device)
    if not records:
        raise MoecError(f"{model}: no MoE router found to calibrate")
    e = records[0].num_experts
    if any(r.num_experts != e for r in records):
        raise MoecError(f"{model}: MoE layers with different expert counts: calibrate supports one count")
    if groups is None:
        groups = [gg for gg in range(2, e // 2 + 1) if e % gg == 0]
    groups = sorted({int(gg) for gg in groups})
    for gg in groups:
        if gg < 2 or e % gg:
            raise MoecError(f"--groups {gg}: G must be >= 2 and divide the {e} experts")
        if not _valid_keeps(e, gg, max(r.top_k for r in records)):
            raise MoecError(f"--groups {gg}: no number of kept groups leaves top-k candidates")
    per_window = context
    check = np.zeros(len(windows), dtype=bool)
    check[check_every - 1::check_every] = True
    tok_check = np.repeat(check, per_window)
    tensors: dict[str, np.ndarray] = {}
    layers_meta, groupings = [], {str(gg): {"layers": {}} for gg in groups}
    prefetch: dict[str, dict] = {}
    prev = None  # (record, inputs) of the previous MoE layer: the prefetch predictor's source
    for rec in sorted(records, key=lambda r: r.index):
        x = rec.inputs()
        logits = x @ rec.rows.T  # T, E (float32, as the router computes them)
        flat = np.argsort(-logits, axis=1, kind="stable")[:, : rec.top_k]
        x_fit, x_chk = x[~tok_check], x[tok_check]
        if prev is not None:
            prec, px = prev
            pw, pb = fit_prefetch(px[~tok_check], logits[~tok_check])
            ratio = (rec.norm_weight / np.where(prec.norm_weight == 0, 1, prec.norm_weight)
                     if rec.norm_weight is not None and prec.norm_weight is not None else np.float32(1))
            fitted, plain = px[tok_check] @ pw.T + pb, (px[tok_check] * ratio) @ rec.rows.T
            tensors[f"prefetch.layer{rec.index}.weight"], tensors[f"prefetch.layer{rec.index}.bias"] = pw, pb
            extras = range(min(PREFETCH_MAX_EXTRA, e - rec.top_k) + 1)
            rc = {str(n): round(prefetch_recall(fitted, flat[tok_check], rec.top_k, n), 6) for n in extras}
            prefetch[str(rec.index)] = {
                "from": prec.index, "weight": f"prefetch.layer{rec.index}.weight", "bias": f"prefetch.layer{rec.index}.bias",
                "check": {"tokens": int(x_chk.shape[0]), "recall": rc,
                          "recall_uncalibrated": {str(n): round(prefetch_recall(plain, flat[tok_check], rec.top_k, n), 6)
                                                  for n in extras},
                          # the fewest extra experts reaching the target (the most considered if none does)
                          "extra_for_target": next((n for n in extras if rc[str(n)] >= PREFETCH_TARGET), extras[-1])}}
        prev = (rec, x)
        counts = coactivation(flat[~tok_check], e)
        counts_chk = coactivation(flat[tok_check], e)
        tensors[f"layer{rec.index}.coactivation"] = counts.astype(np.float32)
        layers_meta.append({"index": rec.index, "num_experts": e, "top_k": rec.top_k, "score": rec.score,
                            "router_sha256": rows_sha256(rec.rows)})
        for gg in groups:
            free = np.asarray(data_free_groups(rec.rows, gg))
            free_cr, free_b = fit_coarse(rec.rows, free, rec.norm_weight)
            cal = np.asarray(coactivation_groups(counts, gg, seed=seed, init=free.tolist()))
            cr, b = fit_coarse_lstsq(x_fit, logits[~tok_check], cal)
            tensors[f"G{gg}.layer{rec.index}.coarse"] = cr.astype(np.float32)
            tensors[f"G{gg}.layer{rec.index}.bias"] = b.astype(np.float32)
            keeps = _valid_keeps(e, gg, rec.top_k)
            agree = {str(k): _agreement(x_chk, rec.rows, CascadeSpec(cal, cr.astype(np.float32), b.astype(np.float32), k),
                                        rec.top_k, rec.score) for k in keeps}
            agree_free = {str(k): _agreement(x_chk, rec.rows, CascadeSpec(free, free_cr.astype(np.float32),
                                                                            free_b.astype(np.float32), k),
                                             rec.top_k, rec.score) for k in keeps}
            groupings[str(gg)]["layers"][str(rec.index)] = {
                "groups": cal.tolist(),
                "coarse": f"G{gg}.layer{rec.index}.coarse", "bias": f"G{gg}.layer{rec.index}.bias",
                "check": {
                    "tokens": int(x_chk.shape[0]),
                    "coactivation_within": {"calibrated": round(within_share(counts_chk, cal), 6),
                                            "data_free": round(within_share(counts_chk, free), 6)},
                    "coarse_fit": {"calibrated": _fit_quality(x_chk, logits[tok_check], cal, cr, b),
                                   "data_free": _fit_quality(x_chk, logits[tok_check], free, free_cr, free_b)},
                    "topk_agreement": {"calibrated": agree, "data_free": agree_free},
                },
            }
        rec.x.clear()
    for gg in groups:
        lay = groupings[str(gg)]["layers"]
        keeps = _valid_keeps(e, gg, max(r.top_k for r in records))
        ok = [k for k in keeps if all(lay[str(r.index)]["check"]["topk_agreement"]["calibrated"][str(k)] >= target
                                      for r in records)]
        groupings[str(gg)]["keep_default"] = ok[0] if ok else gg
    from safetensors.numpy import save_file

    from .. import __version__

    output_dir = Path(output_dir)
    with atomic_directory(output_dir) as tmp:
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp / TENSORS))  # (safetensors writes the buffer as laid out)
        meta = {
            "format": FORMAT, "moec_version": __version__,
            "model": {**model_info, "moe_layers": layers_meta},
            "data": {**data_info, "tokens": int(windows.size), "windows": int(len(windows)), "context": context,
                     "fit_tokens": int((~tok_check).sum()), "check_tokens": int(tok_check.sum()), "check_every": check_every},
            "target_agreement": target, "seed": seed,
            "groupings": groupings,
            "prefetch": {"ridge": PREFETCH_RIDGE, "target": PREFETCH_TARGET, "layers": prefetch},
            "files": {TENSORS: sha256_file(tmp / TENSORS)},
            "seconds": round(time.perf_counter() - t0, 2),
        }
        (tmp / CALIBRATION).write_text(json.dumps(meta, indent=2))
    return output_dir


# ---------------------------------------------------------------------------- reading it back


@dataclass
class Calibration:
    """A calibration directory, checked on load (format, files, hashes, tensor shapes)."""

    root: Path
    meta: dict
    tensors: dict

    @property
    def group_counts(self) -> list[int]:
        return sorted(int(gg) for gg in self.meta["groupings"])

    def _grouping(self, num_groups: int) -> dict:
        key = str(num_groups)
        if key not in self.meta["groupings"]:
            raise MoecError(f"{self.root / CALIBRATION}: calibrated for {', '.join(map(str, self.group_counts))} groups, "
                            f"not {num_groups}: use one of those or run `moec calibrate --groups {num_groups}`")
        return self.meta["groupings"][key]

    def default_keep(self, num_groups: int) -> int:
        return int(self._grouping(num_groups)["keep_default"])

    def cascade_inputs(self, num_groups: int) -> tuple[dict, dict]:
        """Per layer index, the groups and ``(coarse [G, D], bias [G])`` for ``CascadeGating``."""
        grouping = self._grouping(num_groups)
        groups, coarse = {}, {}
        for key, lay in grouping["layers"].items():
            groups[int(key)] = lay["groups"]
            coarse[int(key)] = (self.tensors[lay["coarse"]], self.tensors[lay["bias"]])
        return groups, coarse

    def prefetch_inputs(self) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Per MoE layer index after the first, its fitted prefetch predictor ``(P [E, D], p [E])``; a ``MoecError``
        for a calibration made before moec fitted them."""
        layers = self.meta.get("prefetch", {}).get("layers")
        if not layers:
            raise MoecError(f"{self.root / CALIBRATION}: holds no prefetch predictors (made by an older moec, or a model "
                            "with one MoE layer): run `moec calibrate` again")
        return {int(li): (self.tensors[lay["weight"]], self.tensors[lay["bias"]]) for li, lay in layers.items()}

    def check_model(self, structure, func, num_inputs: int, weights: dict, source: str = "model") -> None:
        """Refuse a model whose layers, expert counts, hidden size or router weights differ from the calibrated one."""
        f = self.root / CALIBRATION
        m = self.meta["model"]
        if m["num_layers"] != structure.num_layers or m["hidden_size"] != structure.hidden_size:
            raise MoecError(f"{f}: calibrated on a model with {m['num_layers']} layers and hidden size {m['hidden_size']}; "
                            f"{source} has {structure.num_layers} layers and hidden size {structure.hidden_size}")
        have = {layer.index: layer for layer in structure.moe_layers}
        want = {lay["index"]: lay for lay in m["moe_layers"]}
        if sorted(have) != sorted(want):
            raise MoecError(f"{f}: calibrated MoE layers {sorted(want)}, {source} has MoE layers {sorted(have)}")
        for i, lay in want.items():
            r = have[i].router
            if (r.num_experts, r.top_k) != (lay["num_experts"], lay["top_k"]):
                raise MoecError(f"{f}: layer {i} was calibrated with {lay['num_experts']} experts, top-{lay['top_k']}; "
                                f"{source} has {r.num_experts} experts, top-{r.top_k}")
            if rows_sha256(router_rows(func, num_inputs, have[i], weights)) != lay["router_sha256"]:
                raise MoecError(f"{f}: layer {i}'s router weight ({r.weight}) differs from the calibrated model's: "
                                f"calibrate {source} itself")

    def manifest(self) -> dict:
        """What the artifact records: where the calibration came from and the hashes of its files."""
        return {"path": str(self.root), "format": self.meta["format"], "data": self.meta["data"],
                "sha256": {CALIBRATION: sha256_file(self.root / CALIBRATION), **self.meta["files"]}}


def load_calibration(path: str | Path) -> Calibration:
    """Open and check a calibration directory; every problem is a ``MoecError`` naming the file."""
    from safetensors.numpy import load_file

    root = Path(path)
    f = root / CALIBRATION
    if not root.is_dir():
        raise MoecError(f"{root}: no such calibration directory (make one with `moec calibrate`)")
    if not f.is_file():
        raise MoecError(f"{f}: missing; {root} is not a moec calibration (make one with `moec calibrate`)")
    meta = read_json_document(f, FORMAT, "calibration", error=MoecError)
    try:
        files, groupings, model = meta["files"], meta["groupings"], meta["model"]
        model["num_layers"], model["hidden_size"], model["moe_layers"]  # noqa: B018 - presence check
    except (KeyError, TypeError) as exc:
        raise MoecError(f"{f}: corrupt (missing {exc})") from None
    tf = root / TENSORS
    if not tf.is_file():
        raise MoecError(f"{tf}: missing (listed in {CALIBRATION})")
    if sha256_file(tf) != files.get(TENSORS):
        raise MoecError(f"{tf}: SHA-256 does not match {CALIBRATION}: the calibration is corrupt or was edited")
    try:
        tensors = load_file(str(tf))
    except Exception as exc:  # noqa: BLE001 - unreadable safetensors
        raise MoecError(f"{tf}: cannot read ({str(exc).splitlines()[0]})") from None
    hidden = model["hidden_size"]
    experts = {lay["index"]: lay["num_experts"] for lay in model["moe_layers"]}
    for key, grouping in groupings.items():
        gg = int(key)
        for li, lay in grouping.get("layers", {}).items():
            cr, b = tensors.get(lay.get("coarse")), tensors.get(lay.get("bias"))
            if cr is None or b is None or cr.shape != (gg, hidden) or b.shape != (gg,):
                raise MoecError(f"{tf}: G={gg} layer {li}: coarse router missing or not [{gg}, {hidden}] / [{gg}]")
            arr = np.asarray(lay.get("groups"))
            e = experts.get(int(li))
            if e is None or arr.shape != (gg, e // gg) or sorted(arr.reshape(-1).tolist()) != list(range(e)):
                raise MoecError(f"{f}: G={gg} layer {li}: groups are not a partition of the experts into {gg} equal groups")
        if "keep_default" not in grouping:
            raise MoecError(f"{f}: G={gg}: keep_default missing")
    for li, lay in meta.get("prefetch", {}).get("layers", {}).items():
        w, b, e = tensors.get(lay.get("weight")), tensors.get(lay.get("bias")), experts.get(int(li))
        if w is None or b is None or e is None or w.shape != (e, hidden) or b.shape != (e,):
            raise MoecError(f"{tf}: prefetch predictor of layer {li} missing or not [{e}, {hidden}] / [{e}]")
    return Calibration(root, meta, tensors)


def format_summary(calib: Calibration) -> str:
    """A table of the check figures: per G and kept groups g, the lowest top-k agreement over layers."""
    meta = calib.meta
    lines = [f"calibration {calib.root}: {meta['data']['tokens']} tokens ({meta['data']['check_tokens']} held out for the check)"]
    lines.append(f"{'G':>3} {'g':>3}  {'agreement calibrated':>20}  {'data-free':>9}  (lowest over layers; exact top-k sets)")
    for gg in calib.group_counts:
        grouping = meta["groupings"][str(gg)]
        lay = list(grouping["layers"].values())
        for k in lay[0]["check"]["topk_agreement"]["calibrated"]:
            cal = min(x["check"]["topk_agreement"]["calibrated"][k] for x in lay)
            free = min(x["check"]["topk_agreement"]["data_free"][k] for x in lay)
            mark = "  <- keep_default" if int(k) == grouping["keep_default"] else ""
            lines.append(f"{gg:>3} {k:>3}  {cal:>20.4f}  {free:>9.4f}{mark}")
    pre = meta.get("prefetch", {}).get("layers", {})
    if pre:
        lines.append("prefetch of offloaded experts, recall of the top-k + 0 / 1 / 2 predicted from the previous MoE layer:")
        for li, lay in sorted(pre.items(), key=lambda kv: int(kv[0])):
            rc, ru = lay["check"]["recall"], lay["check"]["recall_uncalibrated"]
            shown = [e for e in ("0", "1", "2") if e in rc]
            lines.append(f"  layer {int(li):>3}: calibrated {' / '.join(f'{rc[e]:.3f}' for e in shown)}"
                         f"   uncalibrated {' / '.join(f'{ru[e]:.3f}' for e in shown)}"
                         f"   (top-k + {lay['check']['extra_for_target']} prefetched)")
    return "\n".join(lines)


__all__ = ["Calibration", "calibrate", "coactivation", "coactivation_groups", "fit_coarse_lstsq", "fit_prefetch",
           "format_summary", "load_calibration", "load_tokens", "prefetch_recall", "within_share"]
