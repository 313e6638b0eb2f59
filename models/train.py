"""Train the reference MoE on the stdlib corpus: ``moec train-reference --size {tiny,small} -o DIR``.

Routing is flat top-k (softmax, renormalised, Mixtral-style) with a Switch-style load-balancing loss
``E * sum_e f_e * P_e`` (f_e: share of the token-expert assignments going to expert e, P_e: mean router
probability of e) added with weight ``aux_loss_coef``. Given a seed, batches are drawn by a NumPy
generator and the weights are initialised by torch's generator, so a CPU run is repeatable bit for bit
(on CUDA, up to the kernels torch marks nondeterministic).

The output directory (written atomically) holds ``model.safetensors``, ``config.json`` (format
``moec-trained/1``: the MoEConfig, the corpus it was trained on, training figures and held-out
perplexity), the corpus' ``tokenizer.json`` when it has one, and ``model.onnx`` / ``model.pt2``
exported with dynamic batch and sequence axes for ``moec compile``.
"""

from __future__ import annotations

import json
import math
import platform
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F

from ..compiler.artifact import atomic_directory
from ..compiler.errors import MoecError
from .config import MoEConfig
from .corpus import Corpus, get_corpus, load_corpus
from .reference import MoEForCausalLM, Router
from .registry import get_config

FORMAT = "moec-trained/1"
WEIGHTS = "model.safetensors"
CONFIG = "config.json"


@dataclass(frozen=True)
class TrainSpec:
    """What ``--size`` selects: model config, corpus tokenizer and the optimisation schedule."""

    config: str
    tokenizer: str
    vocab_size: int
    seq_len: int
    batch_size: int
    steps: int
    lr: float
    warmup: int
    weight_decay: float = 0.1
    aux_loss_coef: float = 0.01
    eval_context: int = 1024
    eval_tokens: int = 65536


TRAIN_SIZES: dict[str, TrainSpec] = {
    # byte-level; a 2-core CPU trains it in about two minutes
    "tiny": TrainSpec("text-tiny", "bytes", 256, seq_len=1024, batch_size=4, steps=700, lr=3e-3, warmup=50,
                      eval_context=1024, eval_tokens=32768),
    # 4096-token BPE; one H200 trains it in about five minutes
    "small": TrainSpec("text-small", "bpe", 4096, seq_len=4096, batch_size=16, steps=700, lr=1.5e-3, warmup=50,
                       eval_context=4096, eval_tokens=262144),
}


class LoadBalance:
    """Collects the Switch load-balancing loss of every router during a forward (forward hooks)."""

    def __init__(self, model: MoEForCausalLM) -> None:
        self.losses: list[torch.Tensor] = []
        self.handles = [m.register_forward_hook(self._hook) for m in model.modules() if isinstance(m, Router)]

    def _hook(self, router: Router, args, out) -> None:
        x = args[0]  # T, D
        _, idx = out  # T, K
        e = router.cfg.num_experts
        probs = torch.softmax(F.linear(x, router.weight).float(), dim=-1)  # T, E
        share = torch.bincount(idx.reshape(-1), minlength=e).float() / idx.numel()  # E (no gradient: counts)
        self.losses.append(e * (share * probs.mean(0)).sum())

    def pop(self) -> torch.Tensor:
        loss = torch.stack(self.losses).mean()
        self.losses.clear()
        return loss

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _lr_at(step: int, spec: TrainSpec) -> float:
    if step < spec.warmup:
        return spec.lr * (step + 1) / spec.warmup
    t = (step - spec.warmup) / max(1, spec.steps - spec.warmup)
    return spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def _optimizer(model: MoEForCausalLM, spec: TrainSpec, device: torch.device) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": spec.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=spec.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")


def init_model(cfg: MoEConfig, seed: int) -> MoEForCausalLM:
    """A freshly initialised model (small normal init, unit norms), deterministic given the seed."""
    torch.manual_seed(seed)
    model = MoEForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                torch.nn.init.normal_(p, std=0.02)
        for layer in model.layers:  # scaled init of the residual outputs
            layer.attn.o_proj.weight.mul_(1 / math.sqrt(2 * cfg.num_layers))
            layer.moe.experts.down_proj.mul_(1 / math.sqrt(2 * cfg.num_layers))
    return model


def train(cfg: MoEConfig, spec: TrainSpec, corpus: Corpus, seed: int = 0, device: str | None = None,
          steps: int | None = None, progress: bool = True) -> tuple[MoEForCausalLM, dict]:
    """Train ``cfg`` on ``corpus``'s train split; returns the model (eval mode, on CPU) and figures."""
    if corpus.vocab_size != cfg.vocab_size:
        raise MoecError(f"corpus vocabulary {corpus.vocab_size} does not match the model's {cfg.vocab_size}")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    steps = steps or spec.steps
    spec = TrainSpec(**{**asdict(spec), "steps": steps})
    data = corpus.tokens("train")
    if data.size <= spec.seq_len + 1:
        raise MoecError(f"corpus {corpus.root} is too small for sequences of {spec.seq_len} tokens")
    rng = np.random.default_rng(seed)
    model = init_model(cfg, seed).to(dev).train().use_training_kernels(True)
    opt = _optimizer(model, spec, dev)
    balance = LoadBalance(model)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else torch.autocast("cpu", enabled=False)
    from tqdm import tqdm

    log, t0 = [], time.perf_counter()
    bar = tqdm(range(steps), desc="train", disable=not progress, mininterval=2.0)
    for step in bar:
        starts = rng.integers(0, data.size - spec.seq_len - 1, size=spec.batch_size)
        batch = torch.from_numpy(np.stack([data[s:s + spec.seq_len + 1] for s in starts])).to(dev)  # B, S+1
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, spec)
        with amp:
            logits = model(batch[:, :-1])  # B, S, V
            lm = F.cross_entropy(logits.float().reshape(-1, cfg.vocab_size), batch[:, 1:].reshape(-1))
            aux = balance.pop()
            loss = lm + spec.aux_loss_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 25 == 0 or step == steps - 1:
            entry = {"step": step, "loss": round(float(lm.detach()), 4), "aux": round(float(aux.detach()), 4)}
            log.append(entry)
            bar.set_postfix(loss=entry["loss"], aux=entry["aux"])
    if dev.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    balance.close()
    model = model.use_training_kernels(False).eval().cpu()
    tokens = steps * spec.batch_size * spec.seq_len
    figures = {
        "steps": steps, "tokens": tokens, "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 1),
        "seed": seed, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "spec": asdict(spec), "final_loss": log[-1]["loss"], "log": log,
    }
    return model, figures


def save_trained(model: MoEForCausalLM, out_dir: str | Path, corpus: Corpus, figures: dict, size: str,
                 export: tuple[str, ...] = ("onnx", "pt2"), heldout: dict | None = None) -> Path:
    """Write a trained-model directory atomically (weights, config, tokenizer, exports)."""
    from safetensors.torch import save_file

    from .export import save_onnx, save_pt2

    out_dir = Path(out_dir)
    with atomic_directory(out_dir) as tmp:
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp / WEIGHTS))
        if (corpus.root / "tokenizer.json").is_file():
            shutil.copy(corpus.root / "tokenizer.json", tmp / "tokenizer.json")
        meta = {
            "format": FORMAT,
            "size": size,
            "config": model.config.to_dict(),
            "corpus": {"id": corpus.id, "path": str(corpus.root), "tokenizer": corpus.meta["tokenizer"],
                       "train_sha256": corpus.meta["splits"]["train"]["sha256"],
                       "heldout_sha256": corpus.meta["splits"]["heldout"]["sha256"],
                       "unigram_heldout_perplexity": corpus.meta["unigram_heldout_perplexity"]},
            "training": figures,
            "heldout": heldout,
        }
        (tmp / CONFIG).write_text(json.dumps(meta, indent=2))
        vocab = model.config.vocab_size
        if "onnx" in export:
            save_onnx(model, vocab, tmp / "model.onnx", max_seq=model.config.max_position_embeddings)
        if "pt2" in export:
            save_pt2(model, vocab, tmp / "model.pt2", max_seq=model.config.max_position_embeddings)
    return out_dir


def is_trained_dir(path: str | Path) -> bool:
    f = Path(path) / CONFIG
    if not f.is_file():
        return False
    try:
        return json.loads(f.read_text()).get("format") == FORMAT
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False


def load_trained(path: str | Path) -> tuple[MoEForCausalLM, dict]:
    """Load a trained-model directory: ``(model in eval mode, its config.json)``."""
    from safetensors.torch import load_file

    path = Path(path)
    if not is_trained_dir(path):
        raise MoecError(f"{path / CONFIG}: missing or not a moec trained model ({FORMAT})")
    meta = json.loads((path / CONFIG).read_text())
    model = MoEForCausalLM(MoEConfig.from_dict(meta["config"]))
    try:
        state = load_file(str(path / WEIGHTS))
        model.load_state_dict(state)
    except Exception as exc:  # noqa: BLE001 - corrupt or mismatched weights file
        raise MoecError(f"{path / WEIGHTS}: cannot load weights ({str(exc).splitlines()[0]})") from None
    return model.eval(), meta


def corpus_of(meta: dict) -> Corpus:
    """The corpus a trained model was trained on (its recorded path, else the cache for its settings)."""
    info = meta["corpus"]
    path = Path(info["path"])
    if (path / "corpus.json").is_file():
        corpus = load_corpus(path)
    else:
        tk = info["tokenizer"]
        corpus = get_corpus(tk["kind"], tk["vocab_size"])
    if corpus.meta["splits"]["heldout"]["sha256"] != info["heldout_sha256"]:
        raise MoecError(f"{corpus.root}: corpus differs from the one the model was trained on (held-out hash): "
                        "evaluate with --corpus pointing at the original")
    return corpus


def train_reference(size: str, out_dir: str | Path, seed: int = 0, device: str | None = None, steps: int | None = None,
                    corpus_dir: str | Path | None = None, export: tuple[str, ...] = ("onnx", "pt2"),
                    progress: bool = True, eval_tokens: int | None = None, seq_len: int | None = None,
                    batch_size: int | None = None) -> Path:
    """Build (or reuse) the corpus, train the reference of ``size``, measure held-out perplexity, save.
    ``seq_len`` / ``batch_size`` override the size's (a shorter sequence also shortens the evaluation context:
    e.g. ``small`` on a CPU)."""
    from dataclasses import replace

    from .evaluate import TorchSubject, evaluate

    if size not in TRAIN_SIZES:
        raise MoecError(f"unknown size {size!r}; known: {', '.join(TRAIN_SIZES)}")
    spec = TRAIN_SIZES[size]
    for name, value in (("seq_len", seq_len), ("batch_size", batch_size)):
        if value is not None and (not isinstance(value, int) or value < 2):
            raise MoecError(f"{name} must be an integer of at least 2, got {value!r}")
    if seq_len is not None:
        spec = replace(spec, seq_len=seq_len, eval_context=min(spec.eval_context, seq_len))
    if batch_size is not None:
        spec = replace(spec, batch_size=batch_size)
    cfg = get_config(spec.config)
    corpus = load_corpus(corpus_dir) if corpus_dir and (Path(corpus_dir) / "corpus.json").is_file() else \
        get_corpus(spec.tokenizer, spec.vocab_size, root=corpus_dir)
    model, figures = train(cfg, spec, corpus, seed=seed, device=device, steps=steps, progress=progress)
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    report = evaluate(TorchSubject(model, "trained", device=dev), corpus, context=spec.eval_context,
                      max_tokens=eval_tokens or spec.eval_tokens)
    model.cpu()  # scoring moved it to the device; exports trace on the CPU
    heldout = {k: report[k] for k in ("perplexity", "context", "stride", "tokens_scored", "top1_accuracy")}
    heldout["unigram_perplexity"] = corpus.meta["unigram_heldout_perplexity"]
    if progress:
        print(f"[moec] held-out perplexity {heldout['perplexity']:.3f} at context {spec.eval_context} "
              f"(unigram {heldout['unigram_perplexity']:.3f}) after {figures['seconds']:.0f}s of training", flush=True)
    return save_trained(model, out_dir, corpus, figures, size, export, heldout)
