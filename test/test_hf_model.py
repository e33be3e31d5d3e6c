"""A Hugging Face model built from a config (no downloads), attn_implementation="sdpa",
run unchanged with and without enable(): prefill and training are routed, generate
steps (one query token) run the decode family on CUDA and fall back on CPU, and the
results agree."""
import pytest
import torch

import torch_flash_backend as tfb
from torch_flash_backend import testing

transformers = pytest.importorskip("transformers")


def tiny_llama(hidden, heads, kv_heads, layers=2, vocab=256):
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def run_model(model, ids, train):
    if train:
        model.zero_grad(set_to_none=True)
        out = model(ids, labels=ids)
        out.loss.backward()
        grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
        return out.logits.detach(), grads
    with torch.no_grad():
        return model(ids).logits, []


def rel_err(x, ref):
    return ((x.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def check_model(model, ids, tol):
    layers = model.config.num_hidden_layers
    for train in (False, True):
        ref_logits, ref_grads = run_model(model, ids, train)
        tfb.reset_stats()
        with tfb.enable(strict=True):
            logits, grads = run_model(model, ids, train)
        routed = sum(tfb.stats()["routed"].values())
        assert routed == layers, f"train={train}: {tfb.stats()}"
        assert rel_err(logits, ref_logits) < tol
        assert len(grads) == len(ref_grads)
        worst = max((rel_err(g, r) for g, r in zip(grads, ref_grads)), default=0.0)
        assert worst < tol, f"gradient relative error {worst:.2e}"


def check_generate(model, ids, exact, steps_served):
    """Prefill is routed; each generate step is one query token, served by the
    decode family (steps_served) or falling back.

    exact: greedy tokens must match PyTorch's; in bf16 two different (both
    correct) kernels may flip a near-tie of the argmax, so only the shape is checked."""
    ref = model.generate(ids, max_new_tokens=4, do_sample=False)
    tfb.reset_stats()
    with tfb.enable():
        out = model.generate(ids, max_new_tokens=4, do_sample=False)
    stats = tfb.stats()
    layers = model.config.num_hidden_layers
    if steps_served:  # the prefill and three one-token steps
        assert sum(stats["routed"].values()) == 4 * layers and not stats["fallback"], stats
        assert any(k.startswith("decode_fwd") for k in stats["routed"]), stats
    else:
        assert sum(stats["routed"].values()) == layers, stats
        assert any(reason.startswith(("short query", "one query token")) for reason in stats["fallback"]), stats
    assert out.shape == ref.shape and torch.equal(out[:, : ids.shape[1]], ids)
    if exact:
        assert torch.equal(out, ref)


def test_llama_cpu_routed():
    model = tiny_llama(hidden=128, heads=4, kv_heads=2)
    ids = torch.randint(0, 256, (2, 40))
    with testing.route_cpu():
        check_model(model, ids, tol=1e-5)
        check_generate(model, ids, exact=True, steps_served=False)


@pytest.mark.gpu
def test_llama_cuda_routed():
    model = tiny_llama(hidden=1024, heads=8, kv_heads=2).to("cuda", torch.bfloat16)
    ids = torch.randint(0, 256, (2, 300), device="cuda")
    check_model(model, ids, tol=2e-2)
    from torch_flash_backend import _router
    check_generate(model, ids, exact=False, steps_served=_router.probe.route_single_tokens and any(
        k.startswith("decode_fwd_bf16") for k in tfb.built_kernels()))


def tiny_mistral(hidden, heads, kv_heads, window, layers=2, vocab=256):
    config = transformers.MistralConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=1024,
        sliding_window=window, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.MistralForCausalLM(config).eval()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["padded batch", "sliding window"])
def test_masked_models_cuda_routed(kind, caplog):
    """The boolean masks Hugging Face passes (a right-padded batch; a sliding window
    of 64 over 300 tokens) are served, prefill and training, every layer, and agree
    with PyTorch on the positions that are not padding."""
    if kind == "padded batch":
        model = tiny_llama(hidden=1024, heads=8, kv_heads=2)
    else:
        model = tiny_mistral(hidden=1024, heads=8, kv_heads=2, window=64)
    model = model.to("cuda", torch.bfloat16)
    ids = torch.randint(0, 256, (2, 300), device="cuda")
    attention_mask = torch.ones_like(ids)
    if kind == "padded batch":
        attention_mask[1, 220:] = 0
    labels = ids.masked_fill(attention_mask == 0, -100)
    valid = attention_mask.bool()

    def run(train):
        if not train:
            with torch.no_grad():
                return model(ids, attention_mask=attention_mask).logits, []
        model.zero_grad(set_to_none=True)
        out = model(ids, attention_mask=attention_mask, labels=labels)
        out.loss.backward()
        return out.logits.detach(), [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]

    layers = model.config.num_hidden_layers
    for train in (False, True):
        ref_logits, ref_grads = run(train)
        tfb.reset_stats()
        caplog.clear()
        with caplog.at_level("DEBUG", logger="torch_flash_backend"), tfb.enable(strict=True):
            logits, grads = run(train)
        stats = tfb.stats()
        assert sum(stats["routed"].values()) == layers and not stats["fallback"], stats
        served = [r.getMessage() for r in caplog.records if "served by" in r.getMessage()]
        assert len(served) == layers and all("boolean attn_mask" in m for m in served), served
        assert rel_err(logits[valid], ref_logits[valid]) < 2e-2
        worst = max((rel_err(g, r) for g, r in zip(grads, ref_grads)), default=0.0)
        assert len(grads) == len(ref_grads) and worst < 2e-2, f"gradient relative error {worst:.2e}"


@pytest.mark.gpu
def test_packed_documents_through_the_transformers_helper():
    """torch_flash_backend.transformers: a packed row (position ids restarting
    per document) reaches our packed kernels without a mask, and its logits and
    gradients match each document run on its own through PyTorch's SDPA; a
    right-padded batch gives the logits of its real tokens."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import torch_flash_backend.transformers as tfb_hf
    name = tfb_hf.register()
    model = tiny_llama(256, 4, 2).to("cuda", torch.bfloat16)
    lens = [37, 200, 1, 90]
    ids = torch.randint(0, 256, (1, sum(lens)), device="cuda")
    position_ids = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0).cuda()
    tfb.reset_stats()
    model.set_attn_implementation(name)
    try:
        logits = model(ids, position_ids=position_ids).logits[0]
        padded = torch.zeros(2, 200, dtype=torch.long, device="cuda")
        padded[0, :37], padded[1] = ids[0, :37], ids[0, 37:237]
        mask = (torch.arange(200, device="cuda") < torch.tensor([[37], [200]], device="cuda")).long()
        padded_logits = model(padded, attention_mask=mask).logits
    finally:
        model.set_attn_implementation("sdpa")
    routed = tfb.stats()["routed"]
    # Hopper serves packed batches with sm90, older chips with sm80.
    assert any(n.startswith(("sm90_fwd_bf16_hdim64", "sm80_fwd_bf16_hdim64")) for n in routed), routed
    starts = [0] + torch.tensor(lens).cumsum(0).tolist()
    for i, n in enumerate(lens):
        doc = model(ids[:, starts[i]:starts[i] + n]).logits[0]
        assert rel_err(logits[starts[i]:starts[i] + n], doc) < 2e-2, i
    assert rel_err(padded_logits[0, :37], logits[:37]) < 2e-2
    assert rel_err(padded_logits[1], logits[37:237]) < 2e-2
