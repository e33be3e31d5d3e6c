"""enable(): routing, fallback, strictness, nesting, threads, modules, autograd and
recompilation, on CPU through the test switch that routes CPU calls."""
import contextlib
import logging
import threading

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

import torch_flash_backend as tfb
from torch_flash_backend import _enable, testing


@pytest.fixture(autouse=True)
def cpu_routing():
    tfb.reset_stats()
    with testing.route_cpu():
        yield
    assert not _enable.is_active()


def qkv(hq=4, hkv=4, length=40, s=40, e=16, dtype=torch.float32, requires_grad=False):
    torch.manual_seed(0)
    return (torch.randn(2, hq, length, e, dtype=dtype, requires_grad=requires_grad),
            torch.randn(2, hkv, s, e, dtype=dtype, requires_grad=requires_grad),
            torch.randn(2, hkv, s, e, dtype=dtype, requires_grad=requires_grad))


def routed():
    return sum(tfb.stats()["routed"].values())


def fallbacks():
    return sum(tfb.stats()["fallback"].values())


def test_routed_output_close_to_pytorch():
    q, k, v = qkv(hq=8, hkv=2, length=33, s=50)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    with tfb.enable():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert tfb.stats() == {"routed": {"cpu_fwd_fp32_hdim16": 1}, "fallback": {}}
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_outside_nothing_is_routed():
    q, k, v = qkv()
    F.scaled_dot_product_attention(q, k, v)
    assert not _enable.is_active()
    assert tfb.stats() == {"routed": {}, "fallback": {}}
    with tfb.enable():
        assert _enable.is_active()
    assert not _enable.is_active()


FLOAT64_REASON = "dtype torch.float64 is not supported (float16 and bfloat16 only)"


def test_fallback_is_bitwise_pytorch_and_logged(caplog):
    q, k, v = qkv(dtype=torch.float64)
    mask = torch.randn(40, 40, dtype=torch.float64)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    with caplog.at_level(logging.DEBUG, logger="torch_flash_backend"), tfb.enable():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.equal(out, ref)
    assert tfb.stats() == {"routed": {}, "fallback": {FLOAT64_REASON: 1}}
    assert [r.name for r in caplog.records] == ["torch_flash_backend"]
    assert FLOAT64_REASON in caplog.records[0].getMessage()


def test_fallback_backward_is_pytorch():
    q, k, v = qkv(dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(40, 40, dtype=torch.float64)
    with tfb.enable():
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, attn_mask=mask)
    assert fallbacks() == 1
    got = torch.autograd.grad(out.sum(), (q, k, v))
    want = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum(), (q, k, v))
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_strict_raises_with_reason():
    q, k, v = qkv(length=8)
    with tfb.enable(strict=True), pytest.raises(tfb.UnsupportedError, match="short query") as info:
        F.scaled_dot_product_attention(q, k, v)
    assert "split-KV" in info.value.reason and isinstance(info.value, RuntimeError)


def test_nested_inner_strictness_wins():
    q, k, v = qkv(length=8)
    with tfb.enable(strict=True):
        with tfb.enable():
            F.scaled_dot_product_attention(q, k, v)
        with pytest.raises(tfb.UnsupportedError):
            F.scaled_dot_product_attention(q, k, v)
    with tfb.enable():
        with tfb.enable(strict=True), pytest.raises(tfb.UnsupportedError):
            F.scaled_dot_product_attention(q, k, v)
        F.scaled_dot_product_attention(q, k, v)
        assert _enable.is_active()
    assert fallbacks() == 4


def test_decorator_and_reentrancy():
    q, k, v = qkv()
    routing = tfb.enable()

    @routing
    def attend(depth):
        out = F.scaled_dot_product_attention(q, k, v)
        return attend(depth - 1) if depth else out

    attend(3)
    assert routed() == 4 and not _enable.is_active()


def test_exception_unwinds():
    with pytest.raises(ValueError):
        with tfb.enable():
            raise ValueError("boom")
    assert not _enable.is_active()
    F.scaled_dot_product_attention(*qkv())
    assert routed() == 0


def test_thread_local():
    q, k, v = qkv()
    ref = F.scaled_dot_product_attention(q, k, v)
    entered, done = threading.Event(), threading.Event()
    results = {}

    def other():
        entered.wait()
        results["out"] = F.scaled_dot_product_attention(q, k, v)
        done.set()

    thread = threading.Thread(target=other)
    thread.start()
    with tfb.enable():
        entered.set()
        done.wait()
    thread.join()
    assert torch.equal(results["out"], ref)
    assert tfb.stats() == {"routed": {}, "fallback": {}}


def test_backward_matches_pytorch():
    q, k, v = qkv(hq=4, hkv=2, length=33, s=47, requires_grad=True)
    with tfb.enable():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert "torch_flash_backend" in type(out.grad_fn).__name__
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_inference_mode_is_routed():
    q, k, v = qkv()
    with torch.inference_mode(), tfb.enable():
        F.scaled_dot_product_attention(q, k, v)
    assert routed() == 1


def test_multihead_attention_routed():
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(64, 4, batch_first=True)
    x = torch.randn(2, 40, 64)
    ref, _ = mha(x, x, x, need_weights=False)
    with tfb.enable(strict=True):
        out, _ = mha(x, x, x, need_weights=False)
    assert routed() == 1
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_transformer_encoder_layer_training_routed():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, dropout=0.0, batch_first=True).train()
    x = torch.randn(2, 40, 64, requires_grad=True)
    ref = layer(x)
    (ref_grad,) = torch.autograd.grad(ref.sum(), x)
    with tfb.enable(strict=True):
        out = layer(x)
    (grad,) = torch.autograd.grad(out.sum(), x)
    assert routed() == 1
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, ref_grad, atol=1e-4, rtol=1e-4)


def test_compiled_function_recompiles_across_enable_not_per_call():
    counter = CompileCounterWithBackend("aot_eager")

    @torch.compile(fullgraph=True, backend=counter)
    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True) * 2

    q, k, v = qkv()
    torch._dynamo.reset()
    with tfb.enable():
        inside = attend(q, k, v)
        attend(q, k, v)
    traced = routed()
    assert counter.frame_count == 1 and traced >= 1
    outside = attend(q, k, v)
    attend(q, k, v)
    assert counter.frame_count == 2 and routed() == traced
    with tfb.enable():
        attend(q, k, v)
    with tfb.enable(strict=True):
        attend(q, k, v)
    assert counter.frame_count == 3
    torch.testing.assert_close(inside, outside, atol=1e-5, rtol=1e-5)


def test_eager_enable_pushes_no_torch_function_mode():
    """Ordinary torch calls pay nothing for enable(): no torch-function mode is
    on the stack; the mark Dynamo guards on is the autocast state of a device
    type no CPU or CUDA tensor carries (IPU), restored on exit."""
    before = (torch.is_autocast_enabled("ipu"), torch.get_autocast_dtype("ipu"))
    with tfb.enable():
        assert torch._C._len_torch_function_stack() == 0
        assert torch.is_autocast_enabled("ipu") and torch.get_autocast_dtype("ipu") == torch.bfloat16
        with tfb.enable(strict=True):
            assert torch.get_autocast_dtype("ipu") == torch.float32
        assert torch.get_autocast_dtype("ipu") == torch.bfloat16
        assert not torch.is_autocast_enabled("cpu") and not torch.is_autocast_enabled("cuda")
    assert (torch.is_autocast_enabled("ipu"), torch.get_autocast_dtype("ipu")) == before


@contextlib.contextmanager
def counting_router():
    """The shapes of q the Python router is asked about while the block runs."""
    asked = []
    original = _enable._router.decide

    def counting_decide(*args, **kwargs):
        asked.append(args[0].shape)
        return original(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_enable._router, "decide", counting_decide)
        yield asked


def test_repeated_calls_use_the_decision_cache():
    """The second call with the same metadata is decided in C++ (the router is not
    asked again) and still counted; new metadata, a new grad need, or a settings
    change (the probe) ask the router."""
    q, k, v = qkv()
    with counting_router() as asked, tfb.enable():
        out1 = F.scaled_dot_product_attention(q, k, v)
        out2 = F.scaled_dot_product_attention(q, k, v)
        assert len(asked) == 1 and torch.equal(out1, out2)
        F.scaled_dot_product_attention(*qkv(length=41))
        assert len(asked) == 2
        qg, kg, vg = qkv(requires_grad=True)
        F.scaled_dot_product_attention(qg, kg, vg).sum().backward()
        assert len(asked) == 3 and qg.grad is not None
        _enable._router.probe.add_cpu_route(0)  # a probe change: every cache decides afresh
        F.scaled_dot_product_attention(q, k, v)
        assert len(asked) == 4
    assert tfb.stats()["routed"] == {"cpu_fwd_fp32_hdim16": 5}


def test_cached_fallback_still_raises_under_strict():
    """A fallback cached under enable() raises (with its reason) under strict=True."""
    q, k, v = qkv(length=8)
    with tfb.enable():
        F.scaled_dot_product_attention(q, k, v)
        F.scaled_dot_product_attention(q, k, v)
        with tfb.enable(strict=True), pytest.raises(tfb.UnsupportedError, match="short query"):
            F.scaled_dot_product_attention(q, k, v)
    assert fallbacks() == 3


def test_cache_is_per_thread_and_threads_count():
    q, k, v = qkv()
    errors = []

    def work():
        try:
            with tfb.enable():
                for _ in range(5):
                    F.scaled_dot_product_attention(q, k, v)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and routed() == 20


def test_debug_logging_logs_every_call(caplog):
    """With the logger at DEBUG when enable() is entered, every call is logged
    (the cache is bypassed)."""
    q, k, v = qkv()
    with caplog.at_level(logging.DEBUG, logger="torch_flash_backend"), tfb.enable():
        for _ in range(3):
            F.scaled_dot_product_attention(q, k, v)
    assert len([r for r in caplog.records if "served by" in r.getMessage()]) == 3


def _graph_ops(gm):
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("strict", [False, True])
def test_enable_inside_fullgraph_with_statement(strict):
    graphs = []

    def backend(gm, example_inputs):
        from torch._dynamo.backends.common import aot_autograd

        def fw(g, _):
            graphs.append(_graph_ops(g))
            return g.forward

        return aot_autograd(fw_compiler=fw)(gm, example_inputs)

    @torch.compile(fullgraph=True, backend=backend)
    def attend(q, k, v):
        with tfb.enable(strict=strict):
            inside = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return inside + F.scaled_dot_product_attention(q, k, v)

    q, k, v = qkv()
    torch._dynamo.reset()
    out = attend(q, k, v)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True) + F.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert any("torch_flash_backend.fwd.default" in ops for ops in graphs), graphs
    assert routed() >= 1 and not _enable.is_active()


def test_enable_inside_fullgraph_as_decorator():
    counter = CompileCounterWithBackend("aot_eager")

    @torch.compile(fullgraph=True, backend=counter)
    @tfb.enable()
    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    q, k, v = qkv()
    torch._dynamo.reset()
    out = attend(q, k, v)
    attend(q, k, v)
    assert counter.frame_count == 1 and routed() >= 1
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_cuda_eval_fast_paths_routed():
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(256, 4, batch_first=True).cuda().half().eval()
    layer = torch.nn.TransformerEncoderLayer(256, 4, batch_first=True).cuda().half().eval()
    x = torch.randn(2, 128, 256, device="cuda", dtype=torch.half)
    with torch.inference_mode():
        ref_mha, _ = mha(x, x, x, need_weights=False)
        ref_layer = layer(x)
        with tfb.enable(strict=True):
            out_mha, _ = mha(x, x, x, need_weights=False)
            out_layer = layer(x)
    assert routed() == 2, tfb.stats()
    torch.testing.assert_close(out_mha, ref_mha, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(out_layer, ref_layer, atol=2e-3, rtol=2e-3)


@pytest.mark.gpu
def test_cuda_routed_matches_pytorch():
    q, k, v = (t.cuda().bfloat16().requires_grad_() for t in qkv(hq=8, hkv=2, length=256, s=300, e=64))
    with tfb.enable(strict=True):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    grad = torch.randn_like(out)
    for g, w in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(g, w, atol=5e-2, rtol=5e-2)


class Attend(torch.nn.Module):
    def forward(self, q, k, v, mask=None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)


@pytest.mark.parametrize("strict_export", [False, True], ids=["nonstrict", "strict"])
def test_export_graph_holds_our_op(strict_export):
    """Exporting enable()(module): the trace runs the module inside enable()."""
    q, k, v = qkv()
    ep = torch.export.export(tfb.enable()(Attend()), (q, k, v), strict=strict_export)
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert targets == ["torch_flash_backend.fwd.default", "<built-in function getitem>",
                       "<built-in function getitem>"], targets
    torch.testing.assert_close(ep.module()(q, k, v), Attend()(q, k, v), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("strict_export", [False, True], ids=["nonstrict", "strict"])
def test_export_inside_enable_warns(strict_export):
    """An export merely started inside enable() cannot route (nothing runs on the
    trace's torch calls): PyTorch's SDPA stays in the graph, and a warning says
    what to export instead."""
    q, k, v = qkv()
    with tfb.enable(), pytest.warns(UserWarning, match=r"Export tfb.enable\(\)\(model\)"):
        ep = torch.export.export(Attend(), (q, k, v), strict=strict_export)
    assert [str(n.target) for n in ep.graph.nodes if n.op == "call_function"] == [
        "aten.scaled_dot_product_attention.default"]
    assert tfb.stats() == {"routed": {}, "fallback": {}}


def test_export_fallback_counted_once():
    q, k, v = qkv(dtype=torch.float64)
    ep = torch.export.export(tfb.enable()(Attend()), (q, k, v, torch.zeros(40, 40, dtype=torch.float64)))
    assert tfb.stats() == {"routed": {}, "fallback": {FLOAT64_REASON: 1}}
    assert any("scaled_dot_product_attention" in str(n.target) for n in ep.graph.nodes)


def _padding_mask(length=40, s=40):
    """(B, 1, L, S) boolean: batch row 1 sees its first 25 keys, row 0 all."""
    mask = torch.ones(2, 1, length, s, dtype=torch.bool)
    mask[1, :, :, 25:] = False
    return mask


def _mask_arg(node):
    """The attn_mask argument of a graph's fwd node (the schema's last)."""
    return node.kwargs["attn_mask"] if "attn_mask" in node.kwargs else node.args[7]


def test_boolean_mask_served_forward_and_backward():
    """A boolean attn_mask is served (CPU kernels read it; on CUDA the decode
    family, for short queries without grad), equal to PyTorch's SDPA."""
    q, k, v = qkv(requires_grad=True)
    mask = _padding_mask()
    with tfb.enable(strict=True):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert routed() == 1
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    grad = torch.randn_like(out)
    for g, w in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_masked_calls_use_the_decision_cache():
    """attn_mask's metadata is part of the cache key: a mask of the same shape,
    strides and dtype is decided in C++ (the decision reads no mask value, the
    kernel reads the new mask's), another shape, an additive mask or one that
    requires grad asks the router; a cached fallback runs PyTorch's SDPA."""
    q, k, v = qkv()
    mask = _padding_mask()
    other = mask.clone()
    other[0, :, :, 30:] = False
    with counting_router() as asked:
        with tfb.enable():
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            out_other = F.scaled_dot_product_attention(q, k, v, attn_mask=other)
            assert len(asked) == 1
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, :, :1])  # (2, 1, 1, 40): broadcast over rows
            assert len(asked) == 2
            additive = torch.randn(40, 40)
            served = [F.scaled_dot_product_attention(q, k, v, attn_mask=additive) for _ in range(2)]
            assert len(asked) == 3
            with_grad = mask.float().requires_grad_()
            fallback = [F.scaled_dot_product_attention(q, k, v, attn_mask=with_grad) for _ in range(2)]
            assert len(asked) == 4
        for got, m in ((out, mask), (out_other, other), (served[1], additive), (fallback[1], with_grad)):
            torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, attn_mask=m), atol=1e-5, rtol=1e-5)
    assert routed() == 5 and fallbacks() == 2


@pytest.mark.parametrize("strict_export", [False, True], ids=["nonstrict", "strict"])
def test_export_with_a_mask_argument(strict_export):
    """The mask is a graph input that reaches our op."""
    q, k, v = qkv()
    mask = _padding_mask()
    ep = torch.export.export(tfb.enable(strict=True)(Attend()), (q, k, v, mask), strict=strict_export)
    fwd = [n for n in ep.graph.nodes if str(n.target) == "torch_flash_backend.fwd.default"]
    assert len(fwd) == 1 and _mask_arg(fwd[0]).op == "placeholder", ep.graph
    torch.testing.assert_close(ep.module()(q, k, v, mask), Attend()(q, k, v, mask), atol=1e-5, rtol=1e-5)


def test_compiled_with_a_mask_argument():
    """The mask's contents change between calls, its metadata does not: one
    compile, whose forward graph passes the mask to our op."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs
    torch._dynamo.reset()
    q, k, v = qkv()
    backend = AotEagerAndRecordGraphs()

    @torch.compile(backend=backend, fullgraph=True)
    def f(q, k, v, mask):
        with tfb.enable(strict=True):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    for cut in (25, 31):
        mask = _padding_mask()
        mask[1, :, :, cut:] = False
        torch.testing.assert_close(f(q, k, v, mask), F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                                   atol=1e-5, rtol=1e-5)
    assert len(backend.graphs) == 1
    fwd = [n for n in backend.fw_graphs[0].graph.nodes if str(n.target) == "torch_flash_backend.fwd.default"]
    assert len(fwd) == 1 and _mask_arg(fwd[0]).op == "placeholder", backend.fw_graphs[0].code
