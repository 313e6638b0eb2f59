"""The quality harness every lossy pass is judged by: ``moec eval MODEL_OR_ARTIFACT --data heldout``.

Perplexity is teacher-forced over sliding windows of ``context`` tokens that advance by ``stride``;
each window scores only its last ``stride`` targets, so every scored token sees at least
``context - stride`` tokens of context and each token of the stream is scored at most once.
Windows are taken in order from the start of the split's token stream until ``max_tokens`` targets
are scored (the same windows for every subject, so runs compare token for token).

Subjects:
  * a PyTorch model (a trained-model directory, or any ``MoEForCausalLM``): logits from one forward
    per window (experts computed grouped by expert, the same function as the gathered form without
    its memory); routing statistics from hooks on its routers.
  * a compiled artifact (``moec.load``): ``mode="prefill"`` scores each window's targets from a
    chunked prefill; ``mode="decode"`` prefills the first ``context - stride`` tokens and then
    decodes the rest one token per step, all windows of a batch as concurrent sequences, so the
    scored logits come from the decode path reading the KV cache (what cache compression changes).
    An artifact does not expose its routing: its routing statistics are reported as unavailable.

With a ``reference`` the report adds the deltas: relative perplexity change, next-token (argmax)
agreement, and per-layer top-k overlap of routing when both subjects expose it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..compiler.errors import MoecError


def window_starts(n_tokens: int, context: int, stride: int, max_tokens: int | None) -> list[int]:
    """Start offsets of the windows (each scores ``stride`` targets) over a stream of ``n_tokens``."""
    if not 0 < stride <= context - 1:
        raise MoecError(f"stride must be in [1, context - 1], got stride {stride} for context {context}")
    if n_tokens < context:
        raise MoecError(f"the data has {n_tokens} tokens, fewer than one window of {context}")
    starts = list(range(0, n_tokens - context + 1, stride))
    if max_tokens is not None:
        starts = starts[: max(1, -(-max_tokens // stride))]
    return starts


@dataclass
class Scores:
    """Per scored target: negative log-likelihood (nats) and the subject's argmax prediction."""

    nll: np.ndarray
    argmax: np.ndarray
    routing: list[np.ndarray] | None = None  # per layer: [targets, K] expert ids, or None
    num_experts: int | None = None
    seconds: float = 0.0
    routing_note: str | None = None


def _nll_and_argmax(logits: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    logits = logits.astype(np.float64)
    m = logits.max(-1, keepdims=True)
    lse = (m[..., 0] + np.log(np.exp(logits - m).sum(-1)))
    picked = np.take_along_axis(logits, targets[..., None], -1)[..., 0]
    return lse - picked, logits.argmax(-1)


class TorchSubject:
    """A PyTorch causal LM scored by full forwards (routing from hooks on ``Router`` modules)."""

    kind = "torch"

    def __init__(self, model, name: str = "torch", device: str = "cpu", batch_size: int = 4) -> None:
        import torch

        self.model = model.eval()
        self.name = name
        self.device = torch.device(device)
        self.batch_size = batch_size

    def score(self, tokens: np.ndarray, starts: list[int], context: int, stride: int) -> Scores:
        import torch

        from .reference import Router

        from .reference import Experts

        model = self.model.to(self.device)
        for mod in model.modules():  # the same function, without materialising gathered expert weights
            if isinstance(mod, Experts):
                mod.grouped = True
        routers = [m for m in model.modules() if isinstance(m, Router)]
        captured: list[list[np.ndarray]] = [[] for _ in routers]
        shape = {}

        def hook_for(layer):
            def hook(_mod, _args, out):
                b, s = shape["bs"]
                idx = out[1].reshape(b, s, -1)[:, context - stride - 1:]  # B, stride, K (scored positions)
                captured[layer].append(idx.cpu().numpy().reshape(-1, idx.shape[-1]))
            return hook

        handles = [r.register_forward_hook(hook_for(i)) for i, r in enumerate(routers)]
        nll, arg = [], []
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                for i in range(0, len(starts), self.batch_size):
                    w = np.stack([tokens[s:s + context] for s in starts[i:i + self.batch_size]])  # B, L
                    ids = torch.from_numpy(w[:, :-1]).to(self.device)
                    shape["bs"] = ids.shape
                    out = model(input_ids=ids, attention_mask=torch.ones_like(ids))
                    out = out.logits if hasattr(out, "logits") else out
                    logits = out[:, context - stride - 1:].float().cpu().numpy()  # B, stride, V
                    a, b = _nll_and_argmax(logits, w[:, context - stride:])
                    nll.append(a.reshape(-1))
                    arg.append(b.reshape(-1))
        finally:
            for h in handles:
                h.remove()
            for mod in model.modules():
                if isinstance(mod, Experts):
                    mod.grouped = False
            if self.device.type == "cuda":
                torch.cuda.synchronize()
        routing = [np.concatenate(c) for c in captured] if routers else None
        return Scores(np.concatenate(nll), np.concatenate(arg), routing,
                      routers[0].cfg.num_experts if routers else None, time.perf_counter() - t0,
                      None if routers else "no moec reference Router modules in this model")


class ArtifactSubject:
    """A compiled artifact scored through the runtime engine (prefill or decode path)."""

    kind = "artifact"

    def __init__(self, path: str | Path, device: str = "cpu", mode: str = "prefill", batch_size: int = 8,
                 prefill_chunk: int = 2048) -> None:
        if mode not in ("prefill", "decode"):
            raise MoecError(f"unknown evaluation mode {mode!r}: expected 'prefill' or 'decode'")
        self.path, self.device, self.mode = Path(path), device, mode
        self.batch_size, self.prefill_chunk = batch_size, prefill_chunk
        self.name = f"artifact:{self.path.name}"
        self.tier1_share: list[float] = []  # tiered caches: FP8 share of each batch's tokens at its end

    def score(self, tokens: np.ndarray, starts: list[int], context: int, stride: int) -> Scores:
        from ..runtime.engine import load

        page = 16
        per_seq = -(-context // page) * page
        engine = load(self.path, device=self.device, max_batch=self.batch_size,
                      max_total_tokens=self.batch_size * per_seq, prefill_chunk=self.prefill_chunk, page_size=page)
        nll, arg = [], []
        t0 = time.perf_counter()
        for i in range(0, len(starts), self.batch_size):
            w = np.stack([tokens[s:s + context] for s in starts[i:i + self.batch_size]])  # B, L
            if self.mode == "prefill":
                positions = [list(range(context - stride - 1, context - 1))] * len(w)
                seqs, logits = engine.prefill([list(r[:-1]) for r in w], logit_positions=positions)
                logits = np.stack(logits)  # B, stride, V
            else:
                seqs, first = engine.prefill([list(r[:context - stride]) for r in w])
                steps = [first]
                for j in range(context - stride, context - 1):
                    steps.append(engine.decode(seqs, w[:, j]))
                logits = np.stack(steps, axis=1)  # B, stride, V
            if engine.tiered is not None:  # share of (layer, head, token) entries in FP8 at the end
                st = engine.tiered
                seqs_pages = [st.tables.seqs[st.slot[s]] for s in seqs]
                self.tier1_share.append(sum(q.t1_len for q in seqs_pages) / max(1, sum(q.length for q in seqs_pages)))
            for s in seqs:
                engine.release(s)
            a, b = _nll_and_argmax(logits, w[:, context - stride:])
            nll.append(a.reshape(-1))
            arg.append(b.reshape(-1))
        return Scores(np.concatenate(nll), np.concatenate(arg), None, None, time.perf_counter() - t0,
                      "a compiled artifact does not expose its routing")


def load_subject(path: str | Path, device: str = "cpu", mode: str = "prefill", batch_size: int | None = None):
    """A trained-model directory -> ``TorchSubject``; an artifact directory -> ``ArtifactSubject``."""
    from .train import is_trained_dir, load_trained

    path = Path(path)
    if is_trained_dir(path):
        model, meta = load_trained(path)
        subject = TorchSubject(model, f"torch:{path.name}", device=device, batch_size=batch_size or 4)
        subject.meta = meta
        return subject
    if (path / "manifest.json").is_file():
        return ArtifactSubject(path, device=device, mode=mode, batch_size=batch_size or 8)
    raise MoecError(f"{path}: neither a trained model directory (config.json) nor a compiled artifact (manifest.json)")


def routing_stats(routing: list[np.ndarray] | None, num_experts: int | None) -> list[dict] | None:
    """Per layer: each expert's share of the token-expert assignments, max/mean load, entropy (bits)."""
    if routing is None:
        return None
    out = []
    for idx in routing:
        load = np.bincount(idx.reshape(-1), minlength=num_experts).astype(np.float64)
        share = load / load.sum()
        nz = share[share > 0]
        out.append({"load": [round(float(x), 5) for x in share], "max_over_mean": round(float(share.max() * num_experts), 4),
                    "entropy_bits": round(float(-(nz * np.log2(nz)).sum()), 4)})
    return out


def topk_overlap(a: list[np.ndarray], b: list[np.ndarray]) -> list[float]:
    """Per layer: mean over tokens of |top-k set of a ∩ top-k set of b| / k."""
    out = []
    for x, y in zip(a, b):
        k = x.shape[1]
        inter = (x[:, :, None] == y[:, None, :]).any(-1).sum(-1)  # T
        out.append(round(float(inter.mean() / k), 6))
    return out


def _summary(subject, scores: Scores, targets: np.ndarray) -> dict:
    return {
        "subject": subject.name, "kind": subject.kind, "mode": getattr(subject, "mode", "forward"),
        "perplexity": float(np.exp(scores.nll.mean())), "nll_mean": float(scores.nll.mean()),
        "top1_accuracy": float((scores.argmax == targets).mean()), "seconds": round(scores.seconds, 3),
        "routing": routing_stats(scores.routing, scores.num_experts), "routing_note": scores.routing_note,
    }


def evaluate(subject, corpus, split: str = "heldout", context: int = 1024, stride: int | None = None,
             max_tokens: int | None = 65536, reference=None, tokens: np.ndarray | None = None) -> dict:
    """Score ``subject`` (and ``reference``) on the same windows of ``corpus``'s ``split``.

    Parameters
    ----------
    subject, reference : TorchSubject | ArtifactSubject
    corpus : moec.models.corpus.Corpus
    context : int
        Window length in tokens (the context length the perplexity is stated at).
    stride : int, optional
        Targets scored per window (default ``context // 2``).
    max_tokens : int, optional
        Stop after this many scored targets (``None``: the whole split).
    tokens : np.ndarray, optional
        Score this token stream instead of the corpus split (e.g. a user's text file).
    """
    stride = stride or context // 2
    data = corpus.tokens(split) if tokens is None else tokens
    starts = window_starts(data.size, context, stride, max_tokens)
    targets = np.concatenate([data[s + context - stride:s + context] for s in starts])
    a = subject.score(data, starts, context, stride)
    report = {
        "data": {"corpus": corpus.id, "split": split if tokens is None else "user", "tokenizer": corpus.meta["tokenizer"]["kind"]},
        "context": context, "stride": stride, "windows": len(starts), "tokens_scored": int(targets.size),
        **_summary(subject, a, targets),
    }
    report["tokens_per_s"] = round(len(starts) * context / max(a.seconds, 1e-9), 1)
    if reference is not None:
        b = reference.score(data, starts, context, stride)
        report["reference"] = _summary(reference, b, targets)
        report["comparison"] = {
            "perplexity_delta_rel": report["perplexity"] / report["reference"]["perplexity"] - 1.0,
            "next_token_agreement": float((a.argmax == b.argmax).mean()),
            "topk_overlap_per_layer": topk_overlap(a.routing, b.routing) if a.routing and b.routing else None,
        }
    return report


def format_report(report: dict) -> str:
    """A short human-readable table of an ``evaluate`` report."""
    rows = [("subject", "mode", "perplexity", "top-1 acc", "seconds")]
    for r in [report] + ([report["reference"]] if "reference" in report else []):
        rows.append((r["subject"], r["mode"], f"{r['perplexity']:.4f}", f"{r['top1_accuracy']:.4f}", f"{r['seconds']:.1f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [f"{report['data']['corpus']} {report['data']['split']}: {report['tokens_scored']} tokens scored, "
             f"context {report['context']}, stride {report['stride']}"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    if "comparison" in report:
        c = report["comparison"]
        lines.append(f"perplexity delta {c['perplexity_delta_rel'] * 100:+.4f}%  next-token agreement {c['next_token_agreement']:.4f}")
        if c["topk_overlap_per_layer"]:
            lines.append("top-k overlap per layer: " + " ".join(f"{x:.4f}" for x in c["topk_overlap_per_layer"]))
    for r in [report] + ([report["reference"]] if "reference" in report else []):
        if r["routing"]:
            lines.append(f"{r['subject']} expert load max/mean per layer: " + " ".join(f"{x['max_over_mean']:.2f}" for x in r["routing"]))
    return "\n".join(lines)
