import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from moec.compiler.errors import ImportFailure, UnsupportedModel
from moec.compiler.importers import import_model
from moec.compiler.moe_structure import analyze
from moec.models.export import save_onnx, to_exported_program


def test_missing_file():
    with pytest.raises(ImportFailure, match="no such file"):
        import_model("/nonexistent/model.onnx")


def test_unknown_suffix(tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(b"x")
    with pytest.raises(ImportFailure, match="unknown model format"):
        import_model(f)


def test_truncated_onnx(zoo, tmp_path):
    src = zoo.source("tiny", "onnx").read_bytes()
    bad = tmp_path / "trunc.onnx"
    bad.write_bytes(src[: len(src) // 3])
    with pytest.raises(ImportFailure, match="truncated or corrupt"):
        import_model(bad)


def test_unsupported_onnx_op_names_node(tmp_path):
    x = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"])
    y = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", 4])
    node = helper.make_node("MysteryOp", ["input_ids"], ["logits"], name="layer3_mystery", domain="com.example")
    graph = helper.make_graph([node], "g", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.example", 1)])
    f = tmp_path / "custom.onnx"
    onnx.save(model, f)
    with pytest.raises(ImportFailure, match=r"layer3_mystery.*com.example::MysteryOp"):
        import_model(f)


def test_unsupported_torch_op_names_node():
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = type("C", (), {"vocab_size": 16})()
            self.emb = torch.nn.Embedding(16, 8)

        def forward(self, input_ids, attention_mask):
            return torch.special.i0(self.emb(input_ids))

    with pytest.raises(ImportFailure, match=r"node 'i0' uses op i0.default"):
        import_model(Odd())


class Dense(torch.nn.Module):
    """A small dense transformer-like LM: attention without any router."""

    def __init__(self):
        super().__init__()
        self.config = type("C", (), {"vocab_size": 32})()
        self.emb = torch.nn.Embedding(32, 16)
        self.qkv = torch.nn.Linear(16, 48)
        self.mlp = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 32)

    def forward(self, input_ids, attention_mask):
        x = self.emb(input_ids)
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        att = torch.softmax(q @ k.transpose(-1, -2) * 0.35, dim=-1) @ v
        x = x + att.transpose(1, 2).reshape(b, s, 16)
        return self.head(x + self.mlp(x))


def test_dense_model_is_refused(tmp_path):
    imported = import_model(to_exported_program(Dense(), 32))
    with pytest.raises(UnsupportedModel, match="no MoE router found"):
        analyze(imported.main, imported.num_inputs, "dense")
    f = save_onnx(Dense(), 32, tmp_path / "dense.onnx")
    imported = import_model(f)
    with pytest.raises(UnsupportedModel, match="dense models are not supported"):
        analyze(imported.main, imported.num_inputs, str(f))


def test_static_sequence_export_is_refused(tmp_path):
    from moec.models import build_reference, get_config

    cfg = get_config("tiny")
    f = save_onnx(build_reference(cfg), cfg.vocab_size, tmp_path / "static.onnx", dynamic=False)
    imported = import_model(f)
    with pytest.raises(UnsupportedModel, match="static sequence length"):
        analyze(imported.main, imported.num_inputs, str(f))


def test_module_with_example_inputs():
    from moec.models import build_reference, get_config

    cfg = get_config("tiny")
    model = build_reference(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 5))
    imported = import_model(model, example_inputs=(ids,))
    assert imported.num_inputs == 1 and imported.source_kind == "torch"
    s = analyze(imported.main, imported.num_inputs, "tiny")
    assert len(s.moe_layers) == cfg.num_layers


def test_tied_weights_are_one_parameter(tmp_path):
    # layers sharing one layer's weights (and any other tied tensors) import as one parameter each, and the
    # compiled model still matches torch
    import moec
    from moec.models.hf import tie_layers, tiny_hf_model
    from moec_testing import ATOL, torch_last_logits

    model = tie_layers(tiny_hf_model("mixtral"))
    unique = {id(p) for p in model.parameters()}
    assert len(unique) < len(list(model.named_parameters(remove_duplicate=False)))
    imp = import_model(model)
    assert len(imp.weights) == len(unique)
    art = moec.compile(imp, tmp_path / "art", target="llvm")  # the import above (an import is most of a build here)
    engine = moec.load(art)
    tokens = [5, 6, 7, 8, 9]
    _, logits = engine.prefill([tokens])
    np.testing.assert_allclose(logits[0], torch_last_logits(model, tokens), atol=ATOL, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_are_imported_without_copies(dtype):
    # the importer reads only shapes and dtypes of the parameters: the imported weights are the model's own
    # memory (a copy into TVM tensors and back doubled a large model's import), with the same values
    from moec.models.hf import tiny_hf_model

    model = tiny_hf_model("olmoe").to(dtype)
    imp = import_model(model)
    host = [(p.detach().view(torch.int16) if dtype == torch.bfloat16 else p.detach()).numpy() for p in model.parameters()]
    assert len(imp.weights) == len(host)
    for w in imp.weights:
        raw = w.view(np.int16) if dtype == torch.bfloat16 else w
        src = [h for h in host if np.shares_memory(raw, h)]
        assert len(src) == 1 and np.array_equal(raw, src[0])


def test_export_retries_with_range_hints_when_a_guard_cannot_be_proved(tmp_path, monkeypatch):
    # torch 2.11 refuses Mixtral's export over named dimensions ("Constraints violated (seq)! ... guard
    # min(128*s, 512*s) == 128*s"); the export then retries with range hints, and that program must import with
    # dynamic axes and compile to the same logits as torch
    import moec
    from moec.models.hf import tiny_hf_model
    from moec_testing import ATOL, torch_last_logits

    real = torch.export.export
    calls = []

    def refusing(mod, args, dynamic_shapes=None, **kw):
        named = isinstance(dynamic_shapes["input_ids"][1], torch.export.dynamic_shapes._Dim)
        calls.append("named" if named else "hinted")
        if named:
            raise torch._dynamo.exc.UserError(torch._dynamo.exc.UserErrorType.CONSTRAINT_VIOLATION,
                                              "Constraints violated (seq)! Not all values of seq satisfy the guard")
        return real(mod, args, dynamic_shapes=dynamic_shapes, **kw)

    monkeypatch.setattr(torch.export, "export", refusing)
    model = tiny_hf_model("mixtral")
    ep = to_exported_program(model, model.config.vocab_size, max_seq=64)
    assert calls == ["named", "hinted"]
    monkeypatch.setattr(torch.export, "export", real)
    art = moec.compile(ep, tmp_path / "art", target="llvm")
    engine = moec.load(art)
    for tokens in ([5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1]):  # two lengths: the sequence axis stayed dynamic
        _, logits = engine.prefill([tokens])
        np.testing.assert_allclose(logits[0], torch_last_logits(model, tokens), atol=ATOL, rtol=0)


def test_export_passes_other_user_errors_through(monkeypatch):
    def refusing(*a, **k):
        raise torch._dynamo.exc.UserError(torch._dynamo.exc.UserErrorType.DYNAMIC_CONTROL_FLOW, "data-dependent branch")

    monkeypatch.setattr(torch.export, "export", refusing)
    from moec.models.hf import tiny_hf_model

    with pytest.raises(torch._dynamo.exc.UserError, match="data-dependent"):
        to_exported_program(tiny_hf_model("mixtral"), 512)


def test_onnx_clip_imports_as_relax_ops(tmp_path):
    """ONNX Clip (a router's clamp, e.g. ERNIE-4.5-MoE's) as relax maximum / minimum: TVM's converter emits TE
    functions whose fixed buffers break once the entries bind the batch; the values are the same."""
    import tvm
    from tvm import relax

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "s", 4])
    lo = helper.make_tensor("lo", TensorProto.FLOAT, [], [-0.5])
    hi = helper.make_tensor("hi", TensorProto.FLOAT, [], [0.75])
    nodes = [helper.make_node("Clip", ["x", "lo", "hi"], ["c"], name="clip_both"),
             helper.make_node("Clip", ["c", "lo"], ["y"], name="clip_min_only")]
    f = tmp_path / "clip.onnx"
    onnx.save(helper.make_model(helper.make_graph(nodes, "g", [x], [y], initializer=[lo, hi]),
                                opset_imports=[helper.make_opsetid("", 18)]), f)
    imported = import_model(f)
    text = imported.mod.script()
    assert "R.maximum" in text and "R.minimum" in text and "call_tir" not in text
    vm = relax.VirtualMachine(tvm.compile(imported.mod, target="llvm"), tvm.cpu())
    data = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    np.testing.assert_array_equal(vm["main"](tvm.runtime.tensor(data)).numpy(), np.clip(data, -0.5, 0.75))


@pytest.mark.parametrize("bounds", [dict(min=0), dict(max=3), dict(min=1, max=4)])
def test_integer_clamp_by_numbers_imports(bounds):
    """``clamp`` of an int64 tensor with an open bound (positions clamped at 0): the stock converter's ``clip`` with an
    infinite bound cannot be legalized for integers; moec's converter emits maximum / minimum. Values equal torch's;
    a float clamp keeps the stock converter."""
    import torch
    import tvm
    from tvm import relax

    from moec.compiler.importers.torch import EXTRA_CONVERTERS

    class M(torch.nn.Module):
        def forward(self, x, y):
            return (x.cumsum(-1) - 2).clamp(**bounds), y.clamp(**bounds)

    x = torch.tensor([[1, 0, 2, 1, 1, 3]], dtype=torch.int64)
    y = torch.linspace(-2.0, 6.0, 6)[None]
    ep = torch.export.export(M(), (x, y)).run_decompositions()
    from tvm.relax.frontend.torch import from_exported_program

    mod = from_exported_program(ep, custom_convert_map=EXTRA_CONVERTERS)
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(x.numpy()), tvm.runtime.tensor(y.numpy()))
    want = M()(x, y)
    np.testing.assert_array_equal(got[0].numpy(), want[0].numpy())
    np.testing.assert_allclose(got[1].numpy(), want[1].numpy())
