"""HF transformers MoE classes beyond the tested ones, on the CPU: does each compile and match torch, or is it refused
with a clear message?

  python bench/hf_family_sweep.py --json bench/results/hf_family_sweep_cpu.json [--families dots1,afmoe]

Each family: a tiny random config of transformers' own class (2 layers, hidden 64, 8 experts top-2, the
``batched_mm`` experts, eager attention; norm weights and routers random, so that a misplaced norm or a tie-broken
top-k shows), exported with torch.export and compiled for llvm; a batch of two prompts, prefill and two greedy decode
steps, each step's logits against HF's forward over the same history (float32). Outcomes: ``compiled`` (with the
largest logit error, where the model has sliding windows ``max_context``, the MoE layers each entry took onto the
grouped expert kernels and any ``UnreplacedExperts`` warning), ``refused`` (a ``MoecError``: its message),
``absent`` (the installed transformers lacks the class), ``crash`` (anything else: a bug to fix). Not a CI test: it
follows whatever transformers is installed.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import numpy as np

COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2, head_dim=16,
              intermediate_size=64, moe_intermediate_size=32, num_experts=8, num_local_experts=8, n_routed_experts=8,
              num_experts_per_tok=2, first_k_dense_replace=0, decoder_sparse_step=1, mlp_only_layers=[],
              experts_implementation="batched_mm", attn_implementation="eager")
MLA = dict(num_key_value_heads=4, head_dim=None, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8,
           v_head_dim=16, n_shared_experts=1)
# family: (config class, model class, arguments beyond COMMON)
FAMILIES = {
    "dots1": ("Dots1Config", "Dots1ForCausalLM", dict(n_shared_experts=1, n_group=2, topk_group=1)),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", dict(
        moe_num_experts=8, moe_k=2, moe_num_shared_experts=1, moe_layer_start_index=0, moe_layer_interval=1)),
    "hunyuan_moe": ("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", dict(moe_topk=2, num_shared_expert=1, use_qk_norm=True)),
    "flex_olmo": ("FlexOlmoConfig", "FlexOlmoForCausalLM", dict(intermediate_size=32)),
    "granitemoeshared": ("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM", dict(intermediate_size=32,
                                                                                       shared_intermediate_size=48)),
    "cohere2_moe": ("Cohere2MoeConfig", "Cohere2MoeForCausalLM", dict()),
    "exaone_moe": ("ExaoneMoeConfig", "ExaoneMoeForCausalLM", dict(num_shared_experts=1)),
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM", dict()),
    "afmoe": ("AfmoeConfig", "AfmoeForCausalLM", dict(num_dense_layers=0, num_shared_experts=1)),
    "minicpm5_moe": ("MiniCPM5MoeConfig", "MiniCPM5MoeForCausalLM", dict()),
    "solar_open": ("SolarOpenConfig", "SolarOpenForCausalLM", dict()),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict()),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", dict(intermediate_size=32, intermediate_size_mlp=64,
                                                           num_experts_per_tok=1, interleave_moe_layer_step=1)),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(MLA, q_lora_rank=None, n_group=2, topk_group=1,
                                                                     topk_method="group_limited_greedy")),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(MLA, n_group=2, topk_group=1)),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", dict(MLA)),
    "dbrx": ("DbrxConfig", "DbrxForCausalLM", dict(
        d_model=64, n_heads=4, n_layers=2, max_seq_len=256, attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
        ffn_config=dict(moe_num_experts=8, moe_top_k=2, ffn_hidden_size=32))),
}
PROMPTS = ([5, 9, 2, 7, 1, 3, 8], [4, 4, 11, 6, 2, 9, 1, 12, 3, 5, 10])
STEPS = 2


def build(name: str):
    import torch
    import transformers as tf

    cfg_name, cls_name, kw = FAMILIES[name]
    args = {**COMMON, **kw}
    args = {k: v for k, v in args.items() if v is not None}
    cfg = getattr(tf, cfg_name)(**args)
    torch.manual_seed(0)
    model = getattr(tf, cls_name)(cfg).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname and "bias" not in pname:
                p.uniform_(0.5, 1.5)
            elif p.dim() == 2 and ("router" in pname or pname.endswith("mlp.gate.weight")) or "expert_bias" in pname:
                p.normal_(0.0, 0.5)  # some classes initialise their routers to zero: every score would tie
    return model


def sweep_one(name: str) -> dict:
    import torch
    import transformers as tf

    import moec
    from moec.compiler.build import UnreplacedExperts
    from moec.compiler.errors import MoecError

    t0 = time.perf_counter()
    rec = {"family": name, "config": FAMILIES[name][0]}
    missing = [c for c in FAMILIES[name][:2] if not hasattr(tf, c)]
    if missing:  # a class newer than the installed transformers: nothing to try
        rec.update(outcome="absent", message=f"transformers {tf.__version__} has no {', '.join(missing)}", seconds=0.0)
        return rec
    try:
        model = build(name)
        with tempfile.TemporaryDirectory() as d, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", UnreplacedExperts)
            art = moec.compile(model, Path(d) / "art", target="llvm")
            grouped = json.loads((art / "manifest.json").read_text())["options"]["grouped_experts"] or {}
            rec["grouped_experts"] = {"replaced": grouped.get("replaced"), "skipped": grouped.get("skipped")}
            rec["warnings"] = [f"{type(w.message).__name__}: {w.message}" for w in caught
                               if issubclass(w.category, UnreplacedExperts)]
            engine = moec.load(art)
            seqs, logits = engine.prefill([list(p) for p in PROMPTS])
            hist, err = [list(p) for p in PROMPTS], 0.0
            for step in range(STEPS + 1):
                for b, h in enumerate(hist):
                    with torch.no_grad():
                        ref = model(torch.tensor([h])).logits[0, -1].float().numpy()
                    err = max(err, float(np.abs(logits[b] - ref).max()))
                if step == STEPS:
                    break
                nxt = logits.argmax(-1)
                for h, t in zip(hist, nxt):
                    h.append(int(t))
                logits = engine.decode(seqs, nxt)
            rec.update(outcome="compiled", max_logit_error=err, max_context=engine.max_context)
    except MoecError as exc:
        rec.update(outcome="refused", error=type(exc).__name__, message=str(exc))
    except Exception as exc:  # noqa: BLE001 - recorded: a crash is what the sweep looks for
        rec.update(outcome="crash", error=type(exc).__name__, message=str(exc)[:500],
                   traceback=traceback.format_exc()[-2000:])
    rec["seconds"] = round(time.perf_counter() - t0, 1)
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated (default: all)")
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--commit", default="unknown")
    args = ap.parse_args()
    names = [n for n in args.families.split(",") if n]
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        ap.error(f"unknown families: {', '.join(unknown)}; known: {', '.join(FAMILIES)}")
    import transformers

    rows = []
    for name in names:
        rows.append(sweep_one(name))
        r = rows[-1]
        print(f"{name:18} {r['outcome']:9} " + (f"{r['max_logit_error']:.2e} experts {r['grouped_experts']['replaced']}"
                                                 if r["outcome"] == "compiled" else r["message"][:150]), flush=True)
    doc = {"benchmark": "hf_family_sweep", "command": "python " + " ".join(sys.argv), "git_commit": args.commit,
           "device": f"CPU ({platform.processor() or platform.machine()})", "transformers": transformers.__version__,
           "prompts": PROMPTS, "decode_steps": STEPS, "families": rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 1 if any(r["outcome"] == "crash" for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
