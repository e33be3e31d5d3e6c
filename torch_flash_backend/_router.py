"""The one place that decides whether an SDPA call is served by our kernels.

decide() runs on every SDPA call under enable(), so it reads metadata only
(shapes, strides, storage offsets: FakeTensors have no data) and caches the
device capability. Each fallback carries a reason a user can act on.

The forward and the backward kernel are chosen apart (on Hopper, sm90 serves
the backward of the head dims it has and sm80 the others); both read and write
the same (out, lse), so any forward pairs with any backward.
"""
import dataclasses
import functools
import os
import threading

import torch

from . import _checks
from ._checks import check_band, check_sdpa_args, mask_dtype_problem, mask_shape_problem, misaligned
from ._library import align_bytes, built_kernel_set, family_limits, family_runs_on, serving_kernel

_ops = torch.ops.torch_flash_backend

# Below this query length the split-KV decode family serves (on CUDA) where it
# can; the tiled forwards would leave most of the GPU idle, and PyTorch's SDPA
# (its own split-KV paths included) is faster than them.
MIN_QUERY_LEN = 17

CPU_REASON = "CPU calls are served by PyTorch's own SDPA"
DECODE_REASON = "short query: split-KV decode kernel not built; PyTorch's SDPA serves it faster"
# Measured on an H200 (benchmarks/RESULTS.md, "Decode"), the decode family beats PyTorch's
# SDPA from two query tokens up (1.7-10x at four); on one it is level at head dims 64 and 128
# (0.90-1.13x) and ahead at 256 once K and V hold SINGLE_TOKEN_MIN_BYTES (1.06-1.39x; 0.88-1.04x
# below). enable() serves those single tokens alone (probe.route_single_tokens: all of them),
# none with a boolean mask (cuDNN reads a fully used cache's mask 5-12% faster:
# benchmarks/history/2026-11-v9-v27.md, v16). flash_attn and the ops (family="decode" or None) run any.
ROUTE_SINGLE_TOKENS = False
SINGLE_TOKEN_HEAD_DIM, SINGLE_TOKEN_MIN_BYTES = 256, 32 << 20
# The decode family serves up to its registry max_rows query rows per kv head,
# a CTA per 16-row tile, each reading the keys again (from L2 at best); up to
# eight tiles it beats PyTorch's SDPA at batch 1 to 64 (1.04-4.2x, level at
# B 64, S 1K; benchmarks/RESULTS.md, "Decode"), so enable() sends it at most this many.
ROUTE_MAX_DECODE_ROWS = 128
DECODE_SLOWER_REASON = ("one query token: the decode kernel is slower than PyTorch's SDPA there "
                        "(benchmarks/RESULTS.md, \"Decode\"); PyTorch's SDPA serves it")
_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
MASK_LONG_QUERY_REASON = (f"attn_mask with a query of {MIN_QUERY_LEN} or more tokens: no tiled forward family "
                          "allowed here reads a mask; PyTorch's SDPA serves it")
MASK_GRAD_REASON = "attn_mask and inputs that require grad: no backward family allowed here reads such a mask"
# Measured on an H100 (benchmarks/history/2026-11-28-varlen.md): the sm80 kernels on packed
# batches ran at 0.85-1.06x PyTorch's flash kernel, so where the chip's preferred family reads
# no packed batch (sm90 reads them: a build or a family list without it), enable() leaves
# them to PyTorch (strict mode and flash_attn-style pinned calls still take ours).
PACKED_SLOWER_REASON = ("a packed variable-length batch: the {preferred} family, this chip's first, reads none, "
                        "and the {reader} kernels that do are not faster than PyTorch's flash kernel here "
                        "(benchmarks/history/2026-11-28-varlen.md); PyTorch's kernel serves it")
PACKED_GRAD_REASON = ("a packed variable-length batch and inputs that require grad: no backward family allowed "
                      "here reads one")
WINDOW_GRAD_REASON = "a window's left edge and inputs that require grad: no backward family allowed here reads one"


@dataclasses.dataclass(frozen=True)
class Decision:
    """kernel: the forward kernel; backward_kernel: the one autograd will run,
    when the call needs grad."""

    served: bool
    kernel: str | None
    reason: str
    backward_kernel: str | None = None
    # explain() alone, for a served masked call: the share of its forward
    # kernel's tiles that the mask hides entirely, which the kernel skips.
    tiles_skipped: float | None = None

    @property
    def family(self) -> str | None:
        """The forward kernel's family ("sm90", "sm80", "cpu"): what the op is given."""
        return None if self.kernel is None else self.kernel.split("_", 1)[0]

    @property
    def backward_family(self) -> str | None:
        return None if self.backward_kernel is None else self.backward_kernel.split("_", 1)[0]

    def __str__(self) -> str:
        if self.served:
            skipped = "" if self.tiles_skipped is None else f"; the mask hides {self.tiles_skipped:.0%} of its tiles"
            return f"served by {self.kernel} ({self.reason}{skipped})"
        return f"falls back to PyTorch SDPA: {self.reason}"


def mask_tiles_skipped(attn_mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor, tile_rows: int, tile_keys: int,
                       group_packed: bool) -> float:
    """The share of a kernel's (row tile, key tile) pairs in which attn_mask
    hides every pair (False, or -inf in an additive mask), which the kernel
    skips. Its rows are one query
    head's, tile_rows at a time; with group_packed (the decode family), the query
    rows of one kv head instead (position-major, the group's heads within). Keys
    tile_keys at a time from key 0. Reads the mask's values (a device sync on CUDA)."""
    b, hq, length, _ = q.shape
    hkv, s = k.size(1), k.size(2)
    if attn_mask.dtype != torch.bool:
        attn_mask = attn_mask != float("-inf")
    m = attn_mask.expand(b, hq, length, s)
    if group_packed:
        group = hq // hkv
        m = m.reshape(b, hkv, group, length, s).transpose(2, 3).reshape(b, hkv, length * group, s)
    pad_rows, pad_keys = -m.size(2) % tile_rows, -s % tile_keys
    rows = torch.nn.functional.pad(m, (0, pad_keys, 0, pad_rows), value=False)
    tiles = rows.reshape(rows.size(0), rows.size(1), rows.size(2) // tile_rows, tile_rows, rows.size(3) // tile_keys,
                         tile_keys)
    visible = tiles.any(dim=5).any(dim=3)
    return 1.0 - visible.float().mean().item()


def tiles_skipped(decision: "Decision", attn_mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> float | None:
    """For a served masked call, the share of its forward kernel's tiles the mask
    hides (mask_tiles_skipped at the kernel's tile, from its record); None where
    the record names no tile (the family reads no mask, or its tile varies)."""
    kernel = next((x for x in probe.kernels() if str(x) == decision.kernel), None)
    if kernel is None or not kernel.tile_rows or not kernel.tile_keys:
        return None
    return mask_tiles_skipped(attn_mask, q, k, kernel.tile_rows, kernel.tile_keys, group_packed=bool(kernel.max_rows))


def _fallback(reason: str) -> Decision:
    return Decision(False, None, reason)


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.cache
def _cuda_smem_per_block(index: int) -> int:
    return torch.cuda.get_device_properties(index).shared_memory_per_block_optin


class _Probe:
    """What decide() asks of the machine, and the switches tests turn
    (testing.py): each swap moves `generation`, which the decision caches (here
    and enable()'s in csrc/routing.cpp) key on. route_single_tokens: whether
    enable() sends one-token queries to a decode family too."""

    generation = 0

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name in ("capability", "smem_per_block", "kernels", "route_single_tokens"):
            self._bump()

    def __init__(self):
        self.capability = lambda device: _cuda_capability(device.index if device.index is not None else 0)
        self.smem_per_block = lambda device: _cuda_smem_per_block(device.index if device.index is not None else 0)
        self.kernels = built_kernel_set
        self.route_single_tokens = ROUTE_SINGLE_TOKENS
        self._cpu_routes = 0
        self._lock = threading.Lock()

    def _bump(self) -> None:
        super().__setattr__("generation", self.generation + 1)
        torch.ops.torch_flash_backend.routing_invalidate()

    @property
    def route_cpu(self) -> bool:
        return self._cpu_routes > 0

    def add_cpu_route(self, delta: int) -> None:
        with self._lock:
            self._cpu_routes += delta
            self._bump()


probe = _Probe()


# Comma-separated family names the router may choose, e.g. "sm80"; unset or
# empty: every family. Read here alone: the ops run the family they are given
# (their `family` argument), so a benchmark or test pins a family without rebuilding.
FAMILIES_ENV = "TFB_KERNEL_FAMILIES"


@functools.cache
def families() -> tuple[str, ...]:
    """The registry's families (src/registry.py), in order of preference where several run."""
    return tuple(family_limits())


@functools.cache
def _parse_families(value: str) -> frozenset[str] | None:
    names = frozenset(name.strip() for name in value.split(",") if name.strip())
    return names or None


def allowed_families() -> frozenset[str] | None:
    """The families TFB_KERNEL_FAMILIES allows; None when it allows all."""
    return _parse_families(os.environ.get(FAMILIES_ENV, ""))


def _families(capability: tuple[int, int]) -> tuple[str, ...]:
    """The families whose machine code runs on this compute capability (the
    registry's min_cc / max_cc: sm_90a code runs on 9.0 alone)."""
    return tuple(f for f in families() if family_runs_on(f, capability))


# The decisions made so far, numbered: the op library's cache (csrc/routing.cpp,
# the one decision cache) keeps a decision's number, and counts the calls it
# serves without asking the router under it (_stats.py). Past _DECISIONS_MAX
# distinct decisions, a new one is no longer kept (its calls ask each time).
_numbered: list = []
_numbers: dict = {}
_numbers_lock = threading.Lock()
_DECISIONS_MAX = 4096  # csrc/routing.cpp's kMaxDecisions


def number_of(decision: "Decision") -> int:
    """decision's number, or -1 once the numbers run out."""
    with _numbers_lock:
        found = _numbers.get(decision)
        if found is None and len(_numbered) < _DECISIONS_MAX:
            found = _numbers[decision] = len(_numbered)
            _numbered.append(decision)
        return -1 if found is None else found


def numbered() -> list:
    """The decisions numbered so far, by number."""
    with _numbers_lock:
        return list(_numbered)


def _cache_args(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa, scale, needs_grad, bottom_right, window,
                pinned):
    """The decision cache's arguments for this call (csrc/routing.cpp's key: its
    metadata and settings), or None where it is decided afresh: tensors other than
    plain eager ones (FakeTensors and subclasses while tracing, nested tensors) and
    settings of other types."""
    if not (type(q) is type(k) is type(v) is torch.Tensor) or torch.compiler.is_compiling():
        return None
    if attn_mask is not None and type(attn_mask) is not torch.Tensor:
        return None
    if type(dropout_p) not in (float, int) or type(is_causal) is not bool or type(enable_gqa) is not bool:
        return None
    if scale is not None and type(scale) not in (float, int):
        return None
    return (q, k, v, attn_mask, float(dropout_p), is_causal, enable_gqa, None if scale is None else float(scale),
            bool(needs_grad), bottom_right, window[0], window[1], pinned)


def decide(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
           *, needs_grad: bool | None = None, bottom_right: bool = False,
           window: tuple[int, int] = (-1, -1), pinned: bool = False) -> Decision:
    """Whether our ops can serve this SDPA call, by which kernel, or why not.

    bottom_right: is_causal aligned with the last key (a CausalBias made by
    causal_lower_right, PyTorch's flash ops; _causal.py), which every family
    serves as it serves top-left. window: (left, right) keys of a sliding
    window about the diagonal, -1 opening a side (PyTorch's flash ops'
    window_size; the ops' window_left / window_right). Raises
    (check_sdpa_args) for arguments PyTorch's SDPA would reject too, and
    (check_band) for a window the ops would reject. pinned: the choice for
    flash_attn, any family that can run the call (enable() sends short queries
    to a decode family or to PyTorch, whichever is faster; _pick_cuda_kernel).
    needs_grad None means: as autograd will see it (grad mode on and an input
    requires grad). A call whose metadata and settings were decided before gets
    that decision back from the op library's cache (the decision reads nothing
    else; scale only for an additive mask).
    """
    if needs_grad is None and type(q) is type(k) is type(v) is torch.Tensor:
        needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    window = (int(window[0]), int(window[1]))
    bottom_right = bool(bottom_right and (is_causal or window != (-1, -1)))
    cached = _cache_args(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa, scale, needs_grad, bottom_right,
                         window, pinned)
    if cached is not None:
        number = _ops.routing_lookup(*cached)
        if number >= 0:
            return _numbered[number]
    decision = _decide(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, needs_grad, bottom_right, window,
                       pinned)
    if cached is not None:
        number = number_of(decision)
        _ops.routing_remember(*cached, decision.served, decision.family or "", decision.backward_family or "", number)
        if number >= 0:
            return _numbered[number]  # one object per decision, whichever call made it first
    return decision


def decide_varlen(q, k, v, cu_seq_q, cu_seq_k, max_q: int, max_k: int, dropout_p=0.0, is_causal=False,
                  scale=None, window: tuple[int, int] = (-1, -1), seqused_k=None, *,
                  needs_grad: bool | None = None, pinned: bool = False) -> Decision:
    """decide() for a packed variable-length batch, as PyTorch's flash ops and
    varlen_attn take it: q (total_q, Hq, E), k and v (total_k, Hkv, E),
    int32 offsets cu_seq_q / cu_seq_k (batch + 1), the longest lengths, and
    optionally seqused_k (keys in use per sequence). Causal masks and windows
    align bottom-right per sequence. Metadata only: the offsets' values are
    the ops' to check. Decided afresh on every call (the cache keys dense calls alone)."""
    tensors = (q, k, v, cu_seq_q, cu_seq_k) + (() if seqused_k is None else (seqused_k,))
    if not all(isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_nested for t in tensors):
        return _fallback("a packed batch's tensors must be dense strided tensors")
    try:
        batch = _checks.check_varlen(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, seqused_k)
    except RuntimeError as err:  # the ops' rules: PyTorch's kernel then gives its own error
        return _fallback(str(err))
    if needs_grad is None:
        needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if batch == 0 or max_q == 0 or max_k == 0:
        return _fallback(f"zero-size packed batch ({batch} sequences, max_q {max_q}, max_k {max_k}); PyTorch's "
                         "kernel handles it")
    rows = [t.unsqueeze(0).transpose(1, 2) for t in (q, k, v)]  # (1, H, total, E), as the ops view them
    window = (int(window[0]), int(window[1]))
    # A symbolic longest query (dynamic shapes) decides as a long one: comparing it would guard the graph.
    return _decide(*rows, None, dropout_p, is_causal, scale, True, needs_grad, True, window, pinned,
                   packed=(batch, MIN_QUERY_LEN if _checks.symbolic(max_q) else int(max_q)))


def _decide(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, needs_grad, bottom_right,
            window=(-1, -1), pinned=False, packed: tuple[int, int] | None = None) -> Decision:
    """packed: (sequences, longest query) of a packed variable-length batch,
    whose tensors come as (1, H, total tokens, E) views (decide_varlen)."""
    check_sdpa_args(q, k, v, attn_mask, enable_gqa)
    if q.is_nested or k.is_nested or v.is_nested:
        return _fallback("nested (jagged) inputs are not supported")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return _fallback(f"inputs must be 4-D (batch, heads, length, head_dim); got q {q.dim()}-D, "
                         f"k {k.dim()}-D, v {v.dim()}-D")
    device = q.device
    if k.device != device or v.device != device:
        return _fallback(f"inputs are on different devices: q {device}, k {k.device}, v {v.device}")
    on_cpu = device.type == "cpu"
    if on_cpu and not probe.route_cpu:
        return _fallback(CPU_REASON)
    if device.type != "cuda" and not on_cpu:
        return _fallback(f"device type {device.type} is not CUDA")
    masked = attn_mask is not None
    check_band(attn_mask, False, *window)  # the ops' rule for a window (is_causal: SDPA's, above)
    if masked:
        why = _mask_problem(attn_mask, q, k, is_causal, scale)
        if why is not None:
            return _fallback(why)
    dropout = dropout_p != 0.0
    if dropout and not 0.0 < dropout_p < 1.0:
        return _fallback(f"dropout_p={dropout_p} is outside (0, 1)")
    if dropout and on_cpu:
        return _fallback(f"dropout_p={dropout_p} on CPU: the CPU ops draw no dropout")
    if dropout and masked:
        return _fallback(f"dropout_p={dropout_p} with attn_mask: the kernels draw no dropout beside a mask in "
                         "memory (beside is_causal or a window they do)")
    if dropout and packed is not None:
        return _fallback(f"dropout_p={dropout_p} with a packed variable-length batch: the packed ops draw no "
                         "dropout")
    dtype = q.dtype
    if k.dtype != dtype or v.dtype != dtype:
        return _fallback(f"dtypes differ: q {dtype}, k {k.dtype}, v {v.dtype}")
    dtype_name = _DTYPE_NAMES.get(dtype)
    if dtype_name is None or (dtype == torch.float32 and not on_cpu):
        return _fallback(f"dtype {dtype} is not supported (float16 and bfloat16 only)")
    b, hq, length, e = q.shape
    bk, hkv, s, _ = k.shape
    bv, hv, sv, ev = v.shape
    if bk != b or bv != b or hv != hkv or sv != s:
        return _fallback(f"shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if hq != hkv:
        if not enable_gqa:
            return _fallback(f"q has {hq} heads but k/v have {hkv} and enable_gqa=False")
    if b == 0 or hq == 0 or length == 0 or s == 0 or e == 0 or ev == 0:
        return _fallback(f"zero-size input (q {tuple(q.shape)}, k {tuple(k.shape)}); PyTorch's SDPA handles it")
    if packed is not None:
        # The longest sequence's query decides what a short query would.
        length = packed[1]
    if length < MIN_QUERY_LEN and on_cpu:
        return _fallback(DECODE_REASON)
    if needs_grad is None:
        needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    aligned = (" (bottom-right per sequence)" if packed is not None
               else " (bottom-right)" if bottom_right and length != s else "")
    causal = f", causal{aligned}" if is_causal else ""
    if window != (-1, -1):
        causal += f", window {window}{aligned}"
    if packed is not None:
        causal += f", packed batch of {packed[0]} sequences"
    if dropout:
        causal += f", dropout {dropout_p:g}"
    detail = f"{dtype_name}, {_head_dims(e, ev)}" + causal + (
        f", GQA {hq}:{hkv}" if hq != hkv else "") + (_mask_detail(attn_mask) if masked else "")
    if on_cpu:
        fwd = f"cpu_fwd_{dtype_name}_hdim{e}"
        bwd = f"cpu_bwd_{dtype_name}_hdim{e}" if needs_grad else None
        decision = Decision(True, fwd, f"{detail}, backward by {bwd}" if bwd else detail, backward_kernel=bwd)
    else:  # K and V's bytes by numel() (nbytes raises on symbolic sizes), for one token only: else a guard
        single = not masked and e == SINGLE_TOKEN_HEAD_DIM and length == 1 and (
            k.numel() * k.element_size() + v.numel() * v.element_size() >= SINGLE_TOKEN_MIN_BYTES)
        decision = _pick_cuda_kernel(device, dtype_name, e, needs_grad, detail, _broadcast(q, k, v), length,
                                     hq // hkv, routing=not pinned,
                                     mask_kind="window" if window[0] >= 0 else mask_kind(attn_mask),
                                     packed=packed is not None, ev=ev, dropout=dropout, single=single)
    if not decision.served:
        return decision
    # Layout last: a head dim no kernel has is the real problem, not its strides.
    # The stricter of the two kernels' rules (the CPU ops: every family's).
    families = [f for f in (decision.family, decision.backward_family) if f not in (None, "cpu")]
    boundary = max(map(align_bytes, families), default=align_bytes())
    for name, t in (("q", q), ("k", k), ("v", v)):
        bad = misaligned(name, t, boundary)
        if bad is not None:
            return _fallback(bad)
    return decision


def _mask_problem(attn_mask, q, k, is_causal, scale) -> str | None:
    """Why our ops cannot take this attn_mask (PyTorch's SDPA then serves the
    call, or raises where it rejects it), or None. Metadata only."""
    if is_causal:
        return "attn_mask together with is_causal=True (PyTorch's SDPA rejects the pair)"
    bad_dtype = mask_dtype_problem(attn_mask, q, scale)
    if bad_dtype is not None:
        return bad_dtype
    if attn_mask.requires_grad:
        return "attn_mask requires grad"
    if attn_mask.device != q.device:
        return f"attn_mask is on {attn_mask.device} but q is on {q.device}"
    if attn_mask.is_nested or attn_mask.layout != torch.strided:
        return "attn_mask is not a dense strided tensor"
    return mask_shape_problem(attn_mask, q, k)


def mask_kind(attn_mask) -> str:
    """"" without a mask, else "bool" or "additive": the registry's kinds
    (a family's masks and additive_masks)."""
    if attn_mask is None:
        return ""
    return "bool" if attn_mask.dtype == torch.bool else "additive"


def _mask_detail(attn_mask) -> str:
    if attn_mask.dtype == torch.bool:
        return ", boolean attn_mask"
    return f", additive attn_mask ({_DTYPE_NAMES.get(attn_mask.dtype, attn_mask.dtype)})"


def _broadcast(q, k, v) -> bool:
    """Whether an input has stride 0 along a dim of size > 1 (expand())."""
    return any(_checks.broadcast(t) for t in (q, k, v))


def pinned_families(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False, bottom_right=False,
                    *, needs_grad: bool | None = None, dropout_p: float = 0.0) -> tuple[str | None, str | None]:
    """The (forward, backward) families flash_attn names to the ops: the
    router's choice among every (allowed) family that can run the call
    (decide(pinned=True)), raising with the reason when none serves; (None,
    None) off CUDA, where the CPU ops serve every call, and for an empty call
    (no batch, head, query or key), which the ops answer without a kernel."""
    if q.device.type != "cuda" or _checks.empty_call(q, k):
        return None, None
    decision = decide(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, needs_grad=needs_grad,
                      bottom_right=bottom_right, pinned=True)
    if not decision.served:
        raise RuntimeError(f"torch_flash_backend: {decision.reason}")
    return decision.family, decision.backward_family


def _head_dims(e: int, ev: int) -> str:
    return f"head dim {e}" if ev == e else f"head dims {e} (q, k) and {ev} (v)"


def _pick_cuda_kernel(device, dtype_name: str, e: int, needs_grad: bool, detail: str,
                      broadcast: bool, length: int, group: int, routing: bool = True,
                      mask_kind: str = "", packed: bool = False, ev: int | None = None,
                      dropout: bool = False, single: bool = False) -> Decision:
    """From the built kernels' records (Kernel): the first allowed family, in the
    registry's order, whose kernel runs on this chip, reads a broadcast input
    (stride 0 along a dim of size > 1, from expand()) if there is one, and, for
    the backward, fits the chip's shared memory. A decode family (a record
    with max_rows) serves a query of at most that many rows per kv head (group
    x length). routing: the choice for enable(), where a query shorter than
    MIN_QUERY_LEN goes to a decode family or to PyTorch (faster there than the
    tiled forwards), and a longer one never to a decode family; else any
    family that can run the call (flash_attn with pinned families). mask_kind:
    "bool" or "additive" for an attn_mask, which only the passes whose records
    read that kind serve (Kernel.reads_mask). packed: a packed variable-length
    batch, which only the passes whose records read per-sequence lengths serve
    (Kernel.seqlens); dropout: only the passes whose records draw it
    (Kernel.dropout); single: a single token enable() serves (ROUTE_SINGLE_TOKENS)."""
    try:
        capability = tuple(probe.capability(device))
    except Exception as err:  # e.g. tracing CUDA FakeTensors on a machine without a GPU
        return _fallback(f"cannot query the compute capability of {device}: {err}")
    if capability[0] < 8:
        return _fallback(f"compute capability {capability[0]}.{capability[1]} < 8.0 (needs Ampere or newer)")
    kernels = probe.kernels()
    if not kernels:
        return _fallback("no CUDA kernels were built into this library (CPU-only build)")
    smem = probe.smem_per_block(device) if needs_grad else 0
    return _choose(capability, kernels, os.environ.get(FAMILIES_ENV, ""), str(device), smem, dtype_name, e,
                   needs_grad, detail, broadcast, length, group, routing, probe.route_single_tokens or single,
                   mask_kind, packed, ev, dropout)


def _choose(capability, kernels, env: str, device: str, smem: int, dtype_name: str, e: int, needs_grad: bool,
            detail: str, broadcast: bool, length: int, group: int, routing: bool,
            route_single: bool = True, mask_kind: str = "", packed: bool = False,
            ev: int | None = None, dropout: bool = False) -> Decision:
    """e: q's and k's head dim; ev: v's (None: e)."""
    ev = e if ev is None else ev
    what = _head_dims(e, ev)
    allowed = _parse_families(env)
    families = [f for f in _families(capability) if allowed is None or f in allowed]
    if not families:
        return _fallback(f"{FAMILIES_ENV}={env!r} allows none of the kernel families for "
                         f"compute capability {capability[0]}.{capability[1]} ({', '.join(_families(capability))})")
    only = "" if allowed is None else f" (families allowed by {FAMILIES_ENV}: {', '.join(families)})"

    def serving(pass_):
        """The pass's kernels that run head dim e, in the registry's order, those
        built for e first: a head dim below a kernel's runs on it (its columns
        padded on chip) only where no family has one of its own."""
        found = [k for k in (serving_kernel(kernels, f, pass_, dtype_name, e, ev) for f in families)
                 if k is not None and (k.dropout or not dropout)]
        return sorted(found, key=lambda k: not k.head_dim == e == ev)

    fwd_kernels = serving("fwd")
    if dropout and not fwd_kernels:
        return _fallback(f"dropout_p > 0: no forward built for {dtype_name} {what} draws dropout{only}")
    if dropout:
        # Short queries too go to the families that draw dropout (not the
        # decode family), as PyTorch's own SDPA would run them on its slow path.
        routing = False
    if packed:
        tiled = [k for k in fwd_kernels if not k.max_rows]
        fwd_kernels = [k for k in fwd_kernels if k.seqlens]
        if not fwd_kernels:
            return _fallback(f"a packed variable-length batch: no forward built for {dtype_name} {what} reads "
                             f"one{only}")
        if routing and tiled and not tiled[0].seqlens:
            return _fallback(PACKED_SLOWER_REASON.format(preferred=tiled[0].family, reader=fwd_kernels[0].family))
    if mask_kind:
        readers = [k for k in fwd_kernels if k.reads_mask(mask_kind)]
        if mask_kind == "window" and not readers:
            return _fallback(f"a window's left edge (window_left): no forward built for {dtype_name} {what} "
                             f"reads one{only}")
        if not readers:
            return _fallback(f"attn_mask: no forward built for {dtype_name} {what} reads a mask{only}")
        if length >= MIN_QUERY_LEN and not any(not k.max_rows for k in readers):
            return _fallback(MASK_LONG_QUERY_REASON)
        fwd_kernels = readers
    rows = group * length
    if not routing:
        # A decode family serves short queries alone (its kernels refuse longer ones).
        fwd_kernels = [k for k in fwd_kernels if not k.max_rows or (length < MIN_QUERY_LEN and rows <= k.max_rows)]
    elif length < MIN_QUERY_LEN:
        decoders = [k for k in fwd_kernels if k.max_rows]
        if decoders and length == 1 and not route_single:
            return _fallback(DECODE_SLOWER_REASON)
        fwd_kernels = [k for k in decoders if rows <= k.max_rows]
        if fwd_kernels and rows > ROUTE_MAX_DECODE_ROWS:
            return _fallback(f"short query with {rows} query rows per KV head (group heads x query length): past "
                             f"{ROUTE_MAX_DECODE_ROWS} the decode kernel reads the keys once per 16 rows and is not measured "
                             "faster than PyTorch's SDPA (benchmarks/RESULTS.md, \"Decode\"); "
                             "PyTorch's SDPA serves it")
        if not fwd_kernels:
            if not decoders:
                return _fallback(DECODE_REASON)
            return _fallback(f"short query with {rows} query rows per KV head (group heads x query length); the "
                             f"{decoders[0].family} kernel serves at most {decoders[0].max_rows} and PyTorch's SDPA "
                             f"serves it faster than the tiled forwards")
    else:
        fwd_kernels = [k for k in fwd_kernels if not k.max_rows]
    fwd = next((k for k in fwd_kernels if k.stride0_ok or not broadcast), None)
    if fwd is None:
        if fwd_kernels:
            return _fallback(f"an input is broadcast with stride 0 (expand), which the {fwd_kernels[0].family} "
                             f"forward cannot read, and no other forward was built for {dtype_name} head dim "
                             f"{e}{only}")
        dims = sorted({int(n.rsplit("hdim", 1)[1]) for n in kernels if f"_fwd_{dtype_name}_" in n and n.split("_")[0] in families})
        pads = " (a smaller multiple of 8 runs on the next larger)" if any(
            k.pads for k in kernels if k.family in families) else ""
        return _fallback(f"no kernel has {what} for {dtype_name}{only}; head dims built: "
                         f"{', '.join(map(str, dims)) or 'none'}{pads}")
    if not needs_grad:
        return Decision(True, str(fwd), detail)
    why_not = f"inputs require grad but no backward kernel was built for {dtype_name} {what}{only}"
    for bwd in serving("bwd"):
        family = bwd.family
        if packed and not bwd.seqlens:
            why_not = PACKED_GRAD_REASON
            continue
        if not bwd.reads_mask(mask_kind):
            why_not = WINDOW_GRAD_REASON if mask_kind == "window" else MASK_GRAD_REASON
            continue
        if broadcast and not bwd.stride0_ok:
            why_not = (f"inputs require grad and are broadcast with stride 0 (expand), which the {family} "
                       f"backward cannot read")
            continue
        if smem < bwd.smem_bytes:
            why_not = (f"inputs require grad and the {family} backward needs {bwd.smem_bytes // 1024} KB of "
                       f"shared memory a block; {device} offers {smem // 1024} KB")
            continue
        return Decision(True, str(fwd), f"{detail}, backward by {bwd}", backward_kernel=str(bwd))
    return _fallback(why_not)

