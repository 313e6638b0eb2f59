"""InsertPagedKVAttention: IR before/after, and numerics of the rewritten module against torch."""

import pytest
import tvm
from tvm import relax

from moec.passes.paged_kv_attention import ATTN_FUNC, POS_FUNC, InsertPagedKVAttention


def _calls(func, pred):
    found = []

    def visit(e):
        if isinstance(e, relax.Call) and pred(e):
            found.append(e)

    relax.analysis.post_order_visit(func.body, visit)
    return found


def _op_count(func, name):
    return len(_calls(func, lambda c: isinstance(c.op, tvm.ir.Op) and c.op.name == name))


def _extern_count(func, name):
    return len(_calls(func, lambda c: any(isinstance(a, relax.ExternFunc) and a.global_symbol == name for a in c.args)))


@pytest.fixture(scope="module")
def before_after(zoo):
    imported = zoo.imported("tiny", "pt2")
    target = tvm.target.Target({"kind": "llvm"})
    insert = InsertPagedKVAttention(imported.num_inputs, target, "tiny")
    after = relax.transform.DeadCodeElimination(["prefill", "decode", "create_kv_cache"])(insert(imported.mod))
    return imported, after, insert.structure


def test_ir_before(before_after):
    imported, _, _ = before_after
    main = imported.mod["main"]
    assert [p.name for p in main.params[:2]] == ["input_ids", "attention_mask"]
    assert _op_count(main, "relax.nn.softmax") == 4  # 2 attention + 2 router softmaxes
    assert _op_count(main, "relax.arange") >= 1


def test_ir_after(before_after):
    _, after, structure = before_after
    names = {gv.name_hint for gv in after.get_global_vars()}
    assert {"prefill", "decode", "create_kv_cache"} <= names and "main" not in names
    for name in ("prefill", "decode"):
        f = after[name]
        # attention softmaxes are gone (only the routers' remain), one paged-attention call per layer
        assert _op_count(f, "relax.nn.softmax") == 2
        assert _extern_count(f, ATTN_FUNC) == structure.num_layers
        assert _extern_count(f, POS_FUNC) == 1
        # the mask input is gone and the batch axis is 1 (tokens of all sequences laid out ragged)
        assert "attention_mask" not in [p.name for p in f.params]
        assert int(f.params[0].ty.shape[0]) == 1
        assert f.params[1 if name == "decode" else 2].name == "kv_cache"
    assert after["prefill"].params[1].name == "logit_pos"
    # the mask construction (causal tril / where) is dead code after the rewrite
    assert _op_count(after["decode"], "relax.tril") == 0 and _op_count(after["decode"], "relax.where") == 0


def test_structure_is_recorded(before_after):
    _, _, s = before_after
    assert s is not None and s.num_layers == 2
    assert s.layers[0].attention.num_kv_heads == 2
