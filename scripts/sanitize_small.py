"""A small grid of forward and backward launches for compute-sanitizer, once with
both passes pinned to sm80 and once with the default families (on Hopper: the
sm90 forward and backward; several key tiles per CTA in its deterministic
mode). Head dims 64, 96 and 128 are the sm90 backward whose warpgroups split
the keys (dQ by rows, by 64 + 32 and by 64 + 64 columns), 192 the one whose
warpgroups split the head dim, and the sm90 forward that stages O in Q's
buffer; the bf16 shape with more query tiles than SMs has the persistent sm90
CTAs run several tiles, reusing their buffers.
Then the edge cases of test/test_cuda_trust.py: a zero scale, the deterministic
backward (CTAs walking several key blocks into their own dQ split), scores
large enough for the exact softmax pass, and more heads than grid y holds.
The sm80 pass also runs the decode family's grid (split-KV, short queries);
"decode" runs that grid alone, head dim 256 included; "masks" the tiled
families' masks (boolean and additive), forward and backward; "windows" their
bands with a left edge (sliding windows), forward and backward; "varlen"
packed variable-length batches, forward and backward, wrong offsets among them
(the decode family's short packed queries too);
"headdims" head dims between the built ones (run on the next larger kernel,
their extra columns padded on chip), both family passes and packed batches;
"dropout" the dropout ops in each tiled family.

    compute-sanitizer --tool memcheck python scripts/sanitize_small.py [sm80|default|decode|masks|windows|varlen|headdims|dropout]
    compute-sanitizer --tool racecheck python scripts/sanitize_small.py varlen 64

An argument runs that pass alone (racecheck takes minutes per pass); a second,
for varlen and dropout, names its head dims (else the built ones, with 32 and 256
for varlen, 256 for dropout).
"""
import sys

import torch

import torch_flash_backend as tfb
from torch_flash_backend import _router, testing
from torch_flash_backend._library import serving_kernel

ops = torch.ops.torch_flash_backend


def fwd(q, k, v, scale, causal, bottom_right=False):
    """The forward op with the family the pinned families choose (the ops read no setting)."""
    family = _router.pinned_families(q, k, v, enable_gqa=q.size(1) != k.size(1), needs_grad=False)[0]
    return ops.fwd(q, k, v, scale, causal, family, bottom_right=bottom_right)


def bwd(dout, q, k, v, out, lse, scale, causal, bottom_right=False):
    """The backward op with the family the pinned families choose."""
    family = _router.pinned_families(q, k, v, enable_gqa=q.size(1) != k.size(1), needs_grad=True)[1]
    return ops.bwd(dout, q, k, v, out, lse, scale, causal, family, bottom_right=bottom_right)


def grid(head_dims):
    torch.manual_seed(0)
    for dtype in (torch.float16, torch.bfloat16):
        for e in head_dims:
            shapes = [(1, 4, 17, 17), (1, 4, 130, 67), (1, 4, 67, 200)]
            if dtype == torch.bfloat16:
                shapes.append((2, 8, 1100, 300))  # 144 query tiles of 128 rows
            for (b, h, l, s) in shapes:
                # causal both ways; bottom-right with L > S leaves query tiles that see no key
                for causal, bottom_right in ((False, False), (True, False), (True, l != s)):
                    q = torch.randn(b, h, l, e, device="cuda", dtype=dtype)
                    k = torch.randn(b, 2, s, e, device="cuda", dtype=dtype)
                    v = torch.randn(b, 2, s, e, device="cuda", dtype=dtype)
                    out, lse = fwd(q, k, v, None, causal, bottom_right)
                    if l < 1000:  # the small shapes cover the backward
                        bwd(torch.randn_like(out), q, k, v, out, lse, None, causal, bottom_right)
    torch.cuda.synchronize()


def edges(e):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 300, e, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out, lse = fwd(q, k, v, 0.0, True)
    bwd(torch.randn_like(out), q, k, v, out, lse, 0.0, True)
    torch.use_deterministic_algorithms(True)
    try:
        out, lse = fwd(q, k, v, None, True)
        bwd(torch.randn_like(out), q, k, v, out, lse, None, True)
    finally:
        torch.use_deterministic_algorithms(False)
    # Scores near 1e11: the sm80 forward's CTAs start over with the exact
    # softmax, reusing their shared buffers (a causal and a plain shape).
    big = torch.full((1, 2, 300, e), 133120.0, device="cuda", dtype=torch.bfloat16)
    fwd(big, big, big, None, True)
    fwd(big[:, :, :70], big, big, None, False)
    q = torch.randn(1, 65600, 17, e, device="cuda", dtype=torch.bfloat16)  # 17 rows: a tiled family's
    out, lse = fwd(q, q, q, None, False)
    bwd(torch.randn_like(out), q, q, q, out, lse, None, False)
    torch.cuda.synchronize()


def additive(mask, shape, dtype=torch.float32):
    """mask as an additive one in `dtype`: random values where it shows, -inf where it hides."""
    return torch.randn(shape, device="cuda").to(dtype).masked_fill(~mask, float("-inf"))


def decode(head_dims):
    """The decode family: one split and several, GQA-packed rows, causal (both alignments), a cache
    read past its use; masks (a cache in use up to a length per batch row,
    a random one per head with a row that sees nothing, one with its keys strided,
    an additive one)."""
    if not any(n.startswith("decode_fwd") for n in tfb.built_kernels()):
        return
    torch.manual_seed(0)
    for e in head_dims:
        for (hq, length, s, causal) in ((8, 1, 1, False), (8, 1, 130, True), (8, 2, 3000, False), (2, 16, 700, True)):
            q = torch.randn(2, length, hq, e, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
            k = torch.randn(2, 2, s + 8, e, device="cuda", dtype=torch.bfloat16)[:, :, :s]
            v = torch.randn(2, 2, s + 8, e, device="cuda", dtype=torch.bfloat16)[:, :, :s]
            ops.fwd(q, k, v, None, causal, "decode")
            if causal:
                ops.fwd(q, k, v, None, causal, "decode", bottom_right=True)
                continue
            used = torch.tensor([s, max(1, s // 3)], device="cuda")
            masks = [torch.arange(s, device="cuda")[None, None, None, :] < used[:, None, None, None],
                     torch.rand(2, hq, length, s, device="cuda") > 0.5,
                     (torch.rand(2, 1, s, length, device="cuda") > 0.5).transpose(-1, -2)]
            masks[1][:, :, 0] = False
            masks.append(additive(masks[1], (2, hq, length, s)))
            for mask in masks:
                ops.fwd(q, k, v, None, False, "decode", attn_mask=mask)
    torch.cuda.synchronize()


def masks(head_dims):
    """The tiled families' masks, forward and backward (sm80, and sm90 on
    Hopper: its backward for boolean masks): random per head with rows that see nothing, a padding mask
    (B, 1, 1, S), a causal band, whole hidden tiles, keys strided, odd lengths,
    GQA, the deterministic backward; additive ones (float32 per head, bf16 blocks)."""
    torch.manual_seed(0)
    built = set(tfb.built_kernels())
    for e in head_dims + [32, 256]:
        hopper = torch.cuda.get_device_capability() == (9, 0)
        forward_families = ["sm80"] + (["sm90"] if hopper and f"sm90_fwd_bf16_hdim{e}" in built else [])
        backward_families = ["sm80"] + (["sm90"] if hopper and f"sm90_bwd_bf16_hdim{e}" in built else [])
        for (b, hq, hkv, length, s) in ((2, 4, 2, 17, 300), (1, 4, 4, 130, 67), (1, 2, 1, 300, 1000)):
            q = torch.randn(b, length, hq, e, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
            k = torch.randn(b, hkv, s + 8, e, device="cuda", dtype=torch.bfloat16)[:, :, :s]
            v = torch.randn(b, hkv, s + 8, e, device="cuda", dtype=torch.bfloat16)[:, :, :s]
            keys, rows = torch.arange(s, device="cuda"), torch.arange(length, device="cuda")[:, None]
            random = torch.rand(b, hq, length, s, device="cuda") > 0.5
            random[:, :, length // 2] = False
            blocks = (torch.rand(b, 1, length // 64 + 1, s // 64 + 1, device="cuda") > 0.5)
            masks = [random,
                     (keys[None] < torch.tensor([s, max(1, s // 3)][:b], device="cuda")[:, None])[:, None, None],
                     ((keys <= rows) & (keys > rows - 40))[None, None],
                     blocks.repeat_interleave(64, 2).repeat_interleave(64, 3)[..., :length, :s],
                     (torch.rand(b, hq, s, length, device="cuda") > 0.5).transpose(-1, -2)]
            masks += [additive(masks[0], (b, hq, length, s)), additive(masks[3], (b, 1, length, s), torch.bfloat16)]
            for i, mask in enumerate(masks):
                for family in forward_families:
                    out, lse = ops.fwd(q, k, v, None, False, family, attn_mask=mask)
                torch.use_deterministic_algorithms(i == 3)
                try:
                    for family in backward_families if mask.dtype == torch.bool else ["sm80"]:
                        ops.bwd(torch.randn_like(out), q, k, v, out, lse, None, False, family, attn_mask=mask)
                finally:
                    torch.use_deterministic_algorithms(False)
    torch.cuda.synchronize()


def windows(head_dims):
    """Sliding windows as a band (window_left / window_right) in the tiled
    families, forward and backward: narrow and wide, both alignments, L != S
    (rows and key tiles that see nothing), GQA, the deterministic backward."""
    torch.manual_seed(0)
    built = set(tfb.built_kernels())
    hopper = torch.cuda.get_device_capability() == (9, 0)
    for e in head_dims + [32, 256]:
        families = [f for f in ("sm80", "sm90") if (f == "sm80" or hopper) and f"{f}_bwd_bf16_hdim{e}" in built]
        for (b, hq, hkv, length, s) in ((2, 4, 2, 17, 300), (1, 4, 4, 300, 67), (1, 2, 1, 1000, 1000)):
            q = torch.randn(b, length, hq, e, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
            k = torch.randn(b, hkv, s, e, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(b, hkv, s, e, device="cuda", dtype=torch.bfloat16)
            for i, (left, right, causal, bottom_right) in enumerate(
                    ((0, 0, False, True), (40, 0, True, True), (100, 30, False, False), (-1, 5, False, True),
                     (700, -1, False, False))):
                for family in families:
                    band = dict(bottom_right=bottom_right, window_left=left, window_right=right)
                    out, lse = ops.fwd(q, k, v, None, causal, family, **band)
                    torch.use_deterministic_algorithms(i == 1)
                    try:
                        ops.bwd(torch.randn_like(out), q, k, v, out, lse, None, causal, family, **band)
                    finally:
                        torch.use_deterministic_algorithms(False)
    torch.cuda.synchronize()


def varlen(head_dims):
    """Packed variable-length batches (varlen_fwd / varlen_bwd) in every family
    that reads them: empty sequences (no queries, no keys) at either end and
    between, one long sequence among short ones, rows no sequence covers, L !=
    S, GQA, causal and windows, the deterministic backward; then offsets
    whose values are wrong (past the tokens, falling, negative, a sequence
    longer than max_q), which the kernels clamp: no access outside the tensors."""
    torch.manual_seed(0)
    readers = [k for k in _router.probe.kernels() if k.seqlens and k.pass_ == "bwd"]
    families = sorted({k.family for k in readers})
    lens_q = [0, 130, 1, 77, 0, 700, 5, 0]
    lens_k = [9, 200, 0, 77, 3, 650, 64, 0]
    cu = [torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
          for lens in (lens_q, lens_k)]
    for e in head_dims:
        q = torch.randn(sum(lens_q) + 3, 8, e, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(sum(lens_k), 2, e, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        for family in (f for f in families if serving_kernel(readers, f, "bwd", "bf16", e, e) is not None):
            for i, (causal, left, right) in enumerate(((False, -1, -1), (True, -1, -1), (True, 50, -1), (False, 3, 9))):
                out, lse = ops.varlen_fwd(q, k, v, *cu, max(lens_q), max(lens_k), None, causal, family, None, left,
                                          right)
                torch.use_deterministic_algorithms(i == 1)
                try:
                    ops.varlen_bwd(torch.randn_like(out), q, k, v, out, lse, *cu, max(lens_q), max(lens_k), None,
                                   causal, family, left, right)
                finally:
                    torch.use_deterministic_algorithms(False)
            # Wrong offsets: garbage out, every access inside the tensors (params.h SeqLens clamps them).
            total = sum(lens_q)
            overlapping = torch.tensor([0, total] * 4 + [total], dtype=torch.int32, device="cuda")  # tiles > tokens
            for bad_q, bad_k, max_q in ((cu[0], cu[1] + 5000, max(lens_q)), (cu[0].flip(0), cu[1], max(lens_q)),
                                        (cu[0] - 100, cu[1] * 3, max(lens_q)), (cu[0], cu[1], 8),
                                        (overlapping, cu[1], total)):
                out, lse = ops.varlen_fwd(q, k, v, bad_q, bad_k, max_q, max(lens_k), None, True, family)
                ops.varlen_bwd(torch.ones_like(out), q, k, v, out, lse, bad_q, bad_k, max_q, max(lens_k), None,
                               True, family)
        decode = [k for k in _router.probe.kernels() if k.family == "decode" and k.seqlens]
        if serving_kernel(decode, "decode", "fwd", "bf16", e, e) is not None:
            packed_short(q, k, v, cu[1], lens_k)
    torch.cuda.synchronize()


def packed_short(q, k, v, cu_k, lens_k):
    """The decode family's packed batches (queries of 16 tokens or fewer per
    sequence, empty ones among them): with and without seqused_k (one past its
    sequence's keys), causal or not, and with wrong offsets."""
    lens_q = [0, 16, 1, 5, 0, 16, 2, 0]
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    used = torch.tensor([min(n, 40) for n in lens_k], dtype=torch.int32, device="cuda")
    used[3] = lens_k[3] + 7  # past the sequence: clamped to the keys there are
    for causal in (False, True):
        for seqused in (None, used):
            ops.varlen_fwd(q, k, v, cu_q, cu_k, 16, max(lens_k), None, causal, "decode", None, -1, -1, seqused)
    total = sum(lens_q)
    for bad_q, bad_k in ((cu_q, cu_k + 5000), (cu_q.flip(0), cu_k), (cu_q - 100, cu_k * 3),
                         (torch.tensor([0, total] * 4 + [total], dtype=torch.int32, device="cuda"), cu_k)):
        ops.varlen_fwd(q, k, v, bad_q, bad_k, 16, max(lens_k), None, True, "decode")


def fp8():
    """The FP8 forward (fp8_fwd / fp8_varlen_fwd): every built head dim, causal
    and not, GQA, L != S, odd lengths, descales and none, packed batches with
    empty sequences, a wrong offset (clamped inside the tensors)."""
    torch.manual_seed(0)
    dims = sorted(k.head_dim for k in tfb.built_kernels() if k.dtype == "fp8")
    f8 = torch.float8_e4m3fn
    lens_q, lens_k = [0, 130, 1, 77, 300, 5], [9, 200, 0, 77, 257, 70]
    cu = [torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
          for lens in (lens_q, lens_k)]
    for e in dims:
        for (b, hq, hkv, length, s) in ((2, 4, 2, 17, 300), (1, 4, 4, 300, 67), (1, 2, 1, 257, 1000)):
            q = torch.randn(b, length, hq, e, device="cuda").to(f8).transpose(1, 2)
            k = torch.randn(b, hkv, s, e, device="cuda").to(f8)
            v = torch.randn(b, hkv, s, e, device="cuda").to(f8)
            d = torch.rand(b, hkv, device="cuda")
            for causal in (False, True):
                ops.fp8_fwd(q, k, v, d, d, d, None, causal, True)
            ops.fp8_fwd(q, k, v)
        q = torch.randn(sum(lens_q) + 3, 8, e, device="cuda").to(f8)
        k = torch.randn(sum(lens_k), 2, e, device="cuda").to(f8)
        d = torch.rand(len(lens_q), 2, device="cuda")
        for causal in (False, True):
            ops.fp8_varlen_fwd(q, k, k, *cu, max(lens_q), max(lens_k), d, d, d, None, causal)
        ops.fp8_varlen_fwd(q, k, k, cu[0], cu[1] + 5000, max(lens_q), max(lens_k), d, d, d, None, True)
    torch.cuda.synchronize()
    return dims


def dropout(head_dims, families):
    """dropout_fwd, dropout_bwd and dropout_mask over odd lengths, GQA, causal
    and not, with the families pinned to each of `families`."""
    for family in families:
        for e in head_dims:
            for b, hq, hkv, L, S, causal in ((1, 2, 2, 17, 300, False), (2, 4, 2, 130, 77, True),
                                             (1, 2, 1, 257, 513, False)):
                q = torch.randn(b, hq, L, e, device="cuda", dtype=torch.bfloat16)
                k, v = (torch.randn(b, hkv, S, e, device="cuda", dtype=torch.bfloat16) for _ in range(2))
                out, lse, rng = ops.dropout_fwd(q, k, v, 0.3, None, causal, family, family)
                ops.dropout_bwd(torch.randn_like(out), q, k, v, out, lse, rng, 0.3, None, causal, family)
                ops.dropout_mask(rng, 0.3, b, hq, L, S)
    torch.cuda.synchronize()


def main():
    built = set(tfb.built_kernels())
    head_dims = [e for e in (64, 96, 128, 192) if all(f"sm80_{p}_{d}_hdim{e}" in built
                                             for p in ("fwd", "bwd") for d in ("fp16", "bf16"))]
    passes = [("sm80",)]
    sm90 = any(f"sm90_fwd_{d}_hdim{e}" in built for d in ("fp16", "bf16") for e in head_dims)
    if sm90 and torch.cuda.get_device_capability() == (9, 0):
        passes.append(())  # the default: sm90 forwards where built
    if len(sys.argv) > 1 and sys.argv[1] == "decode":  # the decode grid alone
        decode(head_dims + [256])
        print(f"sanitize grid ran: decode, head dims {head_dims + [256]}")
        return
    if len(sys.argv) > 1 and sys.argv[1] == "windows":  # the windows grid alone
        windows(head_dims)
        print(f"sanitize grid ran: windows, head dims {head_dims + [32, 256]}")
        return
    if len(sys.argv) > 1 and sys.argv[1] == "varlen":  # the packed grid alone
        dims = [int(e) for e in sys.argv[2].split(",")] if len(sys.argv) > 2 else head_dims + [32, 256]
        varlen(dims)
        print(f"sanitize grid ran: varlen, head dims {dims}")
        return
    if len(sys.argv) > 1 and sys.argv[1] == "headdims":  # head dims without a kernel of their own
        dims = [8, 40, 72, 80, 136, 200]
        for families in passes:
            with testing.kernel_families(*families):
                grid(dims)
        varlen([40, 80])
        print(f"sanitize grid ran: head dims {dims} (packed {[40, 80]}), families sm80"
              f"{', default' if len(passes) > 1 else ''}")
        return
    if len(sys.argv) > 1 and sys.argv[1] == "dropout":  # dropout in the tiled families
        families = ["sm80"] + (["sm90"] if len(passes) > 1 else [])
        dims = [int(e) for e in sys.argv[2].split(",")] if len(sys.argv) > 2 else head_dims + [256]
        dropout(dims, families)
        print(f"sanitize grid ran: dropout, head dims {dims}, families {families}")
        return
    if len(sys.argv) > 1 and sys.argv[1] == "fp8":  # the FP8 grid alone
        print(f"sanitize grid ran: fp8, head dims {fp8()}")
        return
    if len(sys.argv) > 1 and sys.argv[1] == "masks":  # the masked grid alone
        masks(head_dims)
        print(f"sanitize grid ran: masks, head dims {head_dims + [32, 256]}")
        return
    if len(sys.argv) > 1:
        passes = [p for p in passes if (",".join(p) or "default") == sys.argv[1]]
    for families in passes:
        with testing.kernel_families(*families):
            grid(head_dims)
            for e in (head_dims[0], head_dims[-1]):
                edges(e)
            if families == ("sm80",):
                decode(head_dims)
        print(f"sanitize grid ran: head dims {head_dims}, families {', '.join(families) or 'default'}")


if __name__ == "__main__":
    main()
