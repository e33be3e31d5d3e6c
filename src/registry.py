"""The kernel registry: every kernel family, its passes and head dims, and the
limits the router needs to know which calls a kernel can run.

One edit here plus `python src/generate_instantiations.py` adds a head dim or a
family. The generator writes from it the instantiation files, src/kernel_list.h
(the C++ dispatch lists and the records `built_kernels()` returns, which the
router reads) and src/kernels.cmake (CMake's source lists); setup.py imports it
for its source lists and nvcc flags. Plain Python: no torch, no CUDA.
"""
import dataclasses

DTYPES = {"fp16": "cutlass::half_t", "bf16": "cutlass::bfloat16_t"}
FP8_DTYPE = "cutlass::float_e4m3_t"  # a family's fp8_head_dims


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    passes: tuple[str, ...]
    head_dims: tuple[int, ...]
    # Compute capabilities the family's machine code runs on, as major * 10 + minor;
    # max_cc 0: every later chip too.
    min_cc: int
    max_cc: int
    nvcc_arch: tuple[str, ...]     # setup.py's -gencode flags for the family's sources
    cmake_archs: str               # the same as CMake CUDA_ARCHITECTURES
    stride0_ok: bool               # reads inputs broadcast with stride 0 (expand)
    align_bytes: int               # every row of every input starts on this boundary
    doc: str
    # Query rows per kv head the family serves at most (the group's heads times the
    # query length); 0: no limit. A family with a limit is the short-query (decode) kind.
    max_rows: int = 0
    # The passes that read a boolean attn_mask (broadcast with stride 0 where it
    # is), skipping the tiles it hides (src/common/mask_summary.h), and of those
    # the passes that read an additive one too (None: all of them).
    masks: tuple[str, ...] = ()
    additive_masks: tuple[str, ...] | None = None
    # The passes that read a band's left edge (a sliding window, window_left);
    # every pass reads is_causal's band and any right edge.
    windows: tuple[str, ...] = ()
    # The passes that read per-sequence lengths (params.h SeqLens): packed
    # variable-length batches (cumulative offsets) and seqused_k.
    seqlens: tuple[str, ...] = ()
    # The passes that serve a head dim they were not built for with the next
    # larger one built (both head dims multiples of 8; the kernel's extra
    # columns are zeros on chip and never written), and so a value head dim
    # unlike the query's (csrc/cuda/families.cpp serving_head_dim).
    pads: tuple[str, ...] = ()
    # The passes that draw dropout on P (params.h DropoutArgs, common/dropout.h).
    dropout: tuple[str, ...] = ()
    # (pass, head dims) for a pass that has fewer head dims than head_dims.
    pass_head_dims: tuple[tuple[str, tuple[int, ...]], ...] = ()
    # (pass, head dim) instantiations whose tiles need a wgmma width that CuTe
    # names only under CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED (any multiple of 8
    # outside 8, 16, 32, 64, 96, 128, 192, 256). Their files alone define it:
    # the extra atoms are ~150K lines that cost every file including them ~38 s
    # of front end (cudafe++ and cicc each parse them), so a pass's wide head dims
    # share one file (sm90's forward 80 and 256: 264 s where two files took 346).
    wide_mma: tuple[tuple[str, int], ...] = ()
    # Head dims per instantiation file at most. A file's first sm80 kernel costs
    # cicc 40-65 s that its other kernels share (CuTe's copy and MMA machinery,
    # instantiated and optimised once a file; sm90's kernels share ~8 s), so
    # sm80's head dims go three to a file; decode's six files were ~15 s each.
    dims_per_file: int = 1
    # Head dims of a forward with float8_e4m3fn inputs and a bfloat16 output
    # (PyTorch's quantized flash ops), files fwd_fp8_hdim<d>[_<d>...]_<family>.cu.
    fp8_head_dims: tuple[int, ...] = ()

    def dims(self, pass_: str) -> tuple[int, ...]:
        """The head dims of one pass."""
        return dict(self.pass_head_dims).get(pass_, self.head_dims)

    def additive(self) -> tuple[str, ...]:
        """The passes that read an additive attn_mask."""
        return self.masks if self.additive_masks is None else self.additive_masks


# In the router's order of preference where several run.
FAMILIES = (
    Family(
        name="decode", passes=("fwd",), head_dims=(32, 64, 96, 128, 192, 256), min_cc=80, max_cc=0,
        # sm_90 code and compute_90 PTX beside sm_80's: every chip from Hopper on runs a
        # binary that waits on the previous grid (griddepcontrol), so the launch may
        # overlap it (launch_fwd.h).
        nvcc_arch=("-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90",
                   "-gencode=arch=compute_90,code=compute_90"),
        cmake_archs="80-real;90-real;90-virtual",
        # Per-sequence lengths (a packed batch of short queries, seqused_k) through params.h's accessors.
        stride0_ok=True, align_bytes=16, max_rows=256, masks=("fwd",), seqlens=("fwd",), dims_per_file=6,
        doc="split-KV forward for short queries (decode steps): K/V split across CTAs, GQA packed; every chip since Ampere",
    ),
    Family(
        name="sm90", passes=("fwd", "bwd"), head_dims=(64, 80, 96, 128, 192, 256), min_cc=90, max_cc=90,
        # wgmma and setmaxnreg exist only on sm_90a, whose PTX runs on no later chip.
        nvcc_arch=("-gencode=arch=compute_90a,code=sm_90a",), cmake_archs="90a-real",
        # Head dim 256's forward takes 80-key tiles, and head dim 80's own wgmma is
        # 80 wide (kernel_traits_*.h). 80 has its own kernels (on 96's it did 20%
        # more work: benchmarks/RESULTS.md, "Head dims between the built ones");
        # 112 runs on 128's (14% more): a backward of its own would split dQ into
        # 64 + 48 columns, which no slice of whole swizzle atoms gives.
        wide_mma=(("fwd", 256), ("fwd", 80), ("bwd", 80), ("fwd_fp8", 64), ("fwd_fp8", 128)),
        # TMA cannot describe a stride of 0; its descriptors want 16-byte strides.
        # The backward reads a boolean mask alone (sm80's serves additive ones).
        # Packed batches: both passes take their tiles from a list (the deterministic
        # backward: a grid over the longest sequence's key tiles).
        stride0_ok=False, align_bytes=16, masks=("fwd", "bwd"), additive_masks=("fwd",), windows=("fwd", "bwd"),
        seqlens=("fwd", "bwd"), pads=("fwd", "bwd"), dropout=("fwd", "bwd"), fp8_head_dims=(64, 128, 256),
        doc="Hopper: TMA, wgmma, warp specialisation; forward and backward; reads attn_mask (the backward a boolean one)",
    ),
    Family(
        name="sm80", passes=("fwd", "bwd"), head_dims=(32, 64, 96, 128, 192, 256), min_cc=80, max_cc=0,
        # sm_80 machine code plus PTX, so Ada and Hopper run the family too.
        nvcc_arch=("-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_80,code=compute_80"),
        cmake_archs="80-real;80-virtual",
        stride0_ok=True, align_bytes=16, masks=("fwd", "bwd"), windows=("fwd", "bwd"), seqlens=("fwd", "bwd"),
        pads=("fwd", "bwd"), dropout=("fwd", "bwd"), dims_per_file=3,
        doc="mma.sync and cp.async; every chip since Ampere; forward and backward; reads attn_mask",
    ),
)

HEAD_DIMS = tuple(sorted({d for f in FAMILIES for d in f.head_dims}))


def family(name: str) -> Family:
    return next(f for f in FAMILIES if f.name == name)


def instantiation_file(family_name: str, pass_: str, head_dims: tuple[int, ...]) -> str:
    """Path under src/ of one (family, pass, head dims)'s instantiations, every
    dtype in one file."""
    return f"{family_name}/instantiations/{pass_}_hdim{'_'.join(map(str, head_dims))}_{family_name}.cu"


FP8_PASS = "fwd_fp8"  # the file name's pass of fp8_head_dims


def passes_with_fp8(fam: Family) -> list[tuple[str, tuple[int, ...]]]:
    """(file pass, head dims) of every instantiation file kind the family has."""
    return [(p, fam.dims(p)) for p in fam.passes] + ([(FP8_PASS, fam.fp8_head_dims)] if fam.fp8_head_dims else [])


def _runs(dims: list[int], per_file: int) -> list[tuple[int, ...]]:
    """dims in order, in as few runs of at most per_file as there can be, as even
    as they can be (the longer ones first)."""
    if not dims:
        return []
    files = -(-len(dims) // per_file)
    bounds = [-(-len(dims) * i // files) for i in range(files + 1)]
    return [tuple(dims[a:b]) for a, b in zip(bounds, bounds[1:])]


def instantiation_groups(fam: Family) -> list[tuple[str, tuple[int, ...]]]:
    """(file pass, head dims) of each of the family's files: a pass's head dims in
    runs of at most dims_per_file; its wide_mma head dims apart, all in one file
    (their define costs every file that has it)."""
    groups = []
    for p, dims in passes_with_fp8(fam):
        wide = [d for d in dims if (p, d) in fam.wide_mma]
        groups += [(p, run) for run in _runs([d for d in dims if d not in wide], fam.dims_per_file)]
        groups += [(p, run) for run in _runs(wide, len(wide))]
    return groups


def instantiation_files(fam: Family, head_dims=None) -> list[str]:
    """The family's files holding any of head_dims (None: all), backward before
    forward, larger head dims first (setup.py orders every family's files together
    by their compile cost); a file compiles only its head dims that the build has
    (TFB_WITH_HDIM<d>)."""
    keys = [(p != "bwd", -max(dims), p, dims) for p, dims in instantiation_groups(fam)
            if head_dims is None or set(dims) & set(head_dims)]
    return [instantiation_file(fam.name, p, dims) for *_, p, dims in sorted(keys)]
