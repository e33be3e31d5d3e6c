"""Under enable(), compiled graphs call our ops, not aten SDPA (torch.export
and AOTInductor: test_export.py).

CPU tests route CPU calls to the CPU implementation of the same ops through the
test-only switch (testing.route_cpu); their GPU twins run CUDA bfloat16. Inductor
spends tens of seconds per compile on a small machine, so each compiled artifact
is built once per module and device and shared by the tests.

The graphs are pinned with expecttest; after a deliberate change, refresh them with
    EXPECTTEST_ACCEPT=1 python -m pytest test/test_graph_capture.py
"""

import types

import expecttest
import pytest
import torch
from torch._dynamo.testing import AotEagerAndRecordGraphs, CompileCounterWithBackend
from torch._inductor.utils import run_and_get_code

from graph_models import (
    _needs_cxx, assert_close, assert_routed, graph_text, make_model, routed, run_with_grads, targets,
)
from graph_models import _trust_cpuinfo, device  # noqa: F401  (fixtures)

pytestmark = pytest.mark.filterwarnings("ignore:Your compiler for AOTAutograd is returning a function")


# ---------------------------------------------------------------- torch.compile


@pytest.fixture(scope="module")
def aot_eager(device):
    torch._dynamo.reset()
    model, x = make_model(device)
    backend = AotEagerAndRecordGraphs()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with routed(device):
        out, grads = run_with_grads(compiled, model, x)
        ref_out, ref_grads = run_with_grads(model, model, x)
    pytorch_out, pytorch_grads = run_with_grads(model, model, x)
    return types.SimpleNamespace(backend=backend, out=out, grads=grads, ref_out=ref_out, ref_grads=ref_grads,
                                 pytorch_out=pytorch_out, pytorch_grads=pytorch_grads)


def test_compiled_graphs_call_our_ops(aot_eager):
    assert len(aot_eager.backend.graphs) == 1
    assert_routed(aot_eager.backend.fw_graphs[0], ["torch_flash_backend.fwd.default"])
    assert_routed(aot_eager.backend.bw_graphs[0], ["torch_flash_backend.bwd.default"])


def test_compiled_forward_graph(aot_eager):
    expecttest.assert_expected_inline(graph_text(aot_eager.backend.fw_graphs[0]), """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[2, 24, 256]", primals_2: "f32[256, 256]", primals_3: "f32[128, 256]", primals_4: "f32[128, 256]", primals_5: "f32[256, 256]"):
        t: "f32[256, 256]" = torch.ops.aten.t.default(primals_2)
        view: "f32[48, 256]" = torch.ops.aten.view.default(primals_1, [48, 256]);  primals_1 = None
        mm: "f32[48, 256]" = torch.ops.aten.mm.default(view, t);  t = None
        _unsafe_view: "f32[2, 24, 256]" = torch.ops.aten._unsafe_view.default(mm, [2, 24, 256]);  mm = None
        view_1: "f32[2, 24, 4, 64]" = torch.ops.aten.view.default(_unsafe_view, [2, 24, 4, 64]);  _unsafe_view = None
        transpose: "f32[2, 4, 24, 64]" = torch.ops.aten.transpose.int(view_1, 1, 2);  view_1 = None

        t_1: "f32[256, 128]" = torch.ops.aten.t.default(primals_3)
        mm_1: "f32[48, 128]" = torch.ops.aten.mm.default(view, t_1);  t_1 = None
        _unsafe_view_1: "f32[2, 24, 128]" = torch.ops.aten._unsafe_view.default(mm_1, [2, 24, 128]);  mm_1 = None
        view_3: "f32[2, 24, 2, 64]" = torch.ops.aten.view.default(_unsafe_view_1, [2, 24, 2, 64]);  _unsafe_view_1 = None
        transpose_1: "f32[2, 2, 24, 64]" = torch.ops.aten.transpose.int(view_3, 1, 2);  view_3 = None

        t_2: "f32[256, 128]" = torch.ops.aten.t.default(primals_4)
        mm_2: "f32[48, 128]" = torch.ops.aten.mm.default(view, t_2);  t_2 = None
        _unsafe_view_2: "f32[2, 24, 128]" = torch.ops.aten._unsafe_view.default(mm_2, [2, 24, 128]);  mm_2 = None
        view_5: "f32[2, 24, 2, 64]" = torch.ops.aten.view.default(_unsafe_view_2, [2, 24, 2, 64]);  _unsafe_view_2 = None
        transpose_2: "f32[2, 2, 24, 64]" = torch.ops.aten.transpose.int(view_5, 1, 2);  view_5 = None

        fwd = torch.ops.torch_flash_backend.fwd.default(transpose, transpose_1, transpose_2, None, True, '<family>', '<family>')
        getitem: "f32[2, 4, 24, 64]" = fwd[0]
        getitem_1: "f32[2, 4, 24]" = fwd[1];  fwd = None
        detach: "f32[2, 4, 24, 64]" = torch.ops.aten.detach.default(getitem)

        transpose_3: "f32[2, 24, 4, 64]" = torch.ops.aten.transpose.int(getitem, 1, 2);  getitem = None
        view_6: "f32[2, 24, 256]" = torch.ops.aten.view.default(transpose_3, [2, 24, -1]);  transpose_3 = None
        t_3: "f32[256, 256]" = torch.ops.aten.t.default(primals_5)
        view_7: "f32[48, 256]" = torch.ops.aten.view.default(view_6, [48, 256]);  view_6 = None
        mm_3: "f32[48, 256]" = torch.ops.aten.mm.default(view_7, t_3);  t_3 = None
        _unsafe_view_3: "f32[2, 24, 256]" = torch.ops.aten._unsafe_view.default(mm_3, [2, 24, 256]);  mm_3 = None

        detach_1: "f32[2, 4, 24, 64]" = torch.ops.aten.detach.default(detach);  detach = None
        return (_unsafe_view_3, primals_2, primals_3, primals_4, primals_5, view, transpose, transpose_1, transpose_2, getitem_1, view_7, detach_1)
""")


def test_compiled_backward_graph(aot_eager):
    expecttest.assert_expected_inline(graph_text(aot_eager.backend.bw_graphs[0]), """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_2: "f32[256, 256]", primals_3: "f32[128, 256]", primals_4: "f32[128, 256]", primals_5: "f32[256, 256]", view: "f32[48, 256]", transpose: "f32[2, 4, 24, 64]", transpose_1: "f32[2, 2, 24, 64]", transpose_2: "f32[2, 2, 24, 64]", getitem_1: "f32[2, 4, 24]", view_7: "f32[48, 256]", detach_1: "f32[2, 4, 24, 64]", tangents_1: "f32[2, 24, 256]"):
        view_8: "f32[48, 256]" = torch.ops.aten.view.default(tangents_1, [48, 256]);  tangents_1 = None
        t_4: "f32[256, 48]" = torch.ops.aten.t.default(view_8)
        mm_4: "f32[256, 256]" = torch.ops.aten.mm.default(t_4, view_7);  t_4 = view_7 = None
        t_5: "f32[256, 256]" = torch.ops.aten.t.default(mm_4);  mm_4 = None
        t_3: "f32[256, 256]" = torch.ops.aten.t.default(primals_5);  primals_5 = None
        t_6: "f32[256, 256]" = torch.ops.aten.t.default(t_3);  t_3 = None
        mm_5: "f32[48, 256]" = torch.ops.aten.mm.default(view_8, t_6);  view_8 = t_6 = None
        view_9: "f32[2, 24, 256]" = torch.ops.aten.view.default(mm_5, [2, 24, 256]);  mm_5 = None
        t_7: "f32[256, 256]" = torch.ops.aten.t.default(t_5);  t_5 = None
        view_10: "f32[2, 24, 4, 64]" = torch.ops.aten.view.default(view_9, [2, 24, 4, 64]);  view_9 = None
        transpose_4: "f32[2, 4, 24, 64]" = torch.ops.aten.transpose.int(view_10, 1, 2);  view_10 = None

        bwd = torch.ops.torch_flash_backend.bwd.default(transpose_4, transpose, transpose_1, transpose_2, detach_1, getitem_1, None, True, '<family>');  transpose_4 = transpose = transpose_1 = transpose_2 = detach_1 = getitem_1 = None
        getitem_2: "f32[2, 4, 24, 64]" = bwd[0]
        getitem_3: "f32[2, 2, 24, 64]" = bwd[1]
        getitem_4: "f32[2, 2, 24, 64]" = bwd[2];  bwd = None

        transpose_5: "f32[2, 24, 2, 64]" = torch.ops.aten.transpose.int(getitem_4, 1, 2);  getitem_4 = None
        view_11: "f32[2, 24, 128]" = torch.ops.aten.view.default(transpose_5, [2, 24, 128]);  transpose_5 = None
        view_12: "f32[48, 128]" = torch.ops.aten.view.default(view_11, [48, 128]);  view_11 = None
        t_8: "f32[128, 48]" = torch.ops.aten.t.default(view_12)
        mm_6: "f32[128, 256]" = torch.ops.aten.mm.default(t_8, view);  t_8 = None
        t_9: "f32[256, 128]" = torch.ops.aten.t.default(mm_6);  mm_6 = None
        t_2: "f32[256, 128]" = torch.ops.aten.t.default(primals_4);  primals_4 = None
        t_10: "f32[128, 256]" = torch.ops.aten.t.default(t_2);  t_2 = None
        mm_7: "f32[48, 256]" = torch.ops.aten.mm.default(view_12, t_10);  view_12 = t_10 = None
        view_13: "f32[2, 24, 256]" = torch.ops.aten.view.default(mm_7, [2, 24, 256]);  mm_7 = None
        t_11: "f32[128, 256]" = torch.ops.aten.t.default(t_9);  t_9 = None

        transpose_6: "f32[2, 24, 2, 64]" = torch.ops.aten.transpose.int(getitem_3, 1, 2);  getitem_3 = None
        view_14: "f32[2, 24, 128]" = torch.ops.aten.view.default(transpose_6, [2, 24, 128]);  transpose_6 = None
        view_15: "f32[48, 128]" = torch.ops.aten.view.default(view_14, [48, 128]);  view_14 = None
        t_12: "f32[128, 48]" = torch.ops.aten.t.default(view_15)
        mm_8: "f32[128, 256]" = torch.ops.aten.mm.default(t_12, view);  t_12 = None
        t_13: "f32[256, 128]" = torch.ops.aten.t.default(mm_8);  mm_8 = None
        t_1: "f32[256, 128]" = torch.ops.aten.t.default(primals_3);  primals_3 = None
        t_14: "f32[128, 256]" = torch.ops.aten.t.default(t_1);  t_1 = None
        mm_9: "f32[48, 256]" = torch.ops.aten.mm.default(view_15, t_14);  view_15 = t_14 = None
        view_16: "f32[2, 24, 256]" = torch.ops.aten.view.default(mm_9, [2, 24, 256]);  mm_9 = None
        add: "f32[2, 24, 256]" = torch.ops.aten.add.Tensor(view_13, view_16);  view_13 = view_16 = None
        t_15: "f32[128, 256]" = torch.ops.aten.t.default(t_13);  t_13 = None

        transpose_7: "f32[2, 24, 4, 64]" = torch.ops.aten.transpose.int(getitem_2, 1, 2);  getitem_2 = None
        view_17: "f32[2, 24, 256]" = torch.ops.aten.view.default(transpose_7, [2, 24, 256]);  transpose_7 = None
        view_18: "f32[48, 256]" = torch.ops.aten.view.default(view_17, [48, 256]);  view_17 = None
        t_16: "f32[256, 48]" = torch.ops.aten.t.default(view_18)
        mm_10: "f32[256, 256]" = torch.ops.aten.mm.default(t_16, view);  t_16 = view = None
        t_17: "f32[256, 256]" = torch.ops.aten.t.default(mm_10);  mm_10 = None
        t: "f32[256, 256]" = torch.ops.aten.t.default(primals_2);  primals_2 = None
        t_18: "f32[256, 256]" = torch.ops.aten.t.default(t);  t = None
        mm_11: "f32[48, 256]" = torch.ops.aten.mm.default(view_18, t_18);  view_18 = t_18 = None
        view_19: "f32[2, 24, 256]" = torch.ops.aten.view.default(mm_11, [2, 24, 256]);  mm_11 = None
        add_1: "f32[2, 24, 256]" = torch.ops.aten.add.Tensor(add, view_19);  add = view_19 = None
        t_19: "f32[256, 256]" = torch.ops.aten.t.default(t_17);  t_17 = None
        return (add_1, t_19, t_15, t_11, t_7)
""")


def test_compiled_matches_eager(aot_eager, device):
    assert_close(aot_eager.out, aot_eager.ref_out, device)
    assert_close(aot_eager.grads, aot_eager.ref_grads, device)
    assert_close(aot_eager.out, aot_eager.pytorch_out, device, loose=True)
    assert_close(aot_eager.grads, aot_eager.pytorch_grads, device, loose=True)


def test_no_recompile_per_call(device):
    torch._dynamo.reset()
    model, x = make_model(device)
    backend = AotEagerAndRecordGraphs()
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    with routed(device):
        compiled(x)
        compiled(torch.randn_like(x))
    assert counter.frame_count == 1

    outside = compiled(x)
    assert counter.frame_count == 2, "leaving enable() must recompile"
    names = targets(backend.fw_graphs[-1])
    assert any("scaled_dot_product" in t for t in names) and not any("torch_flash_backend" in t for t in names)
    assert_close(outside, model(x), device)

    with routed(device):
        compiled(torch.randn_like(x))
    assert counter.frame_count == 2, "the graph compiled under enable() must be reused"


@pytest.fixture(scope="module")
def inductor(device):
    _needs_cxx()
    model, x = make_model(device)
    compiled = torch.compile(model, fullgraph=True)
    with routed(device):
        (out, grads), code = run_and_get_code(run_with_grads, compiled, model, x)
        ref_out, ref_grads = run_with_grads(model, model, x)
    return types.SimpleNamespace(out=out, grads=grads, ref_out=ref_out, ref_grads=ref_grads, code=code)


def test_inductor_calls_our_ops(inductor):
    code = "\n".join(inductor.code)
    assert "torch.ops.torch_flash_backend.fwd.default" in code
    assert "torch.ops.torch_flash_backend.bwd.default" in code
    assert "scaled_dot_product" not in code


def test_inductor_matches_eager(inductor, device):
    assert_close(inductor.out, inductor.ref_out, device)
    assert_close(inductor.grads, inductor.ref_grads, device)


