"""Builds one op library, torch_flash_backend/lib/libtorch_flash_backend.so.

It registers ops with the dispatcher and has no Python bindings, so Python loads
it with torch.ops.load_library and a C++ program (or an AOTInductor runner) can
dlopen the same file. CUDA sources are compiled when torch has CUDA and nvcc is
found; set TFB_BUILD_CUDA=0 to build the CPU part only. TFB_HEAD_DIMS (e.g.
"64,128") trims the compiled head dims; TFB_BUILD_SM90=0 leaves out the Hopper
forward family.

`pip install -v .` prints a line per compiled source (the CUDA build takes 15-25
minutes on two cores); `pip wheel --no-build-isolation .` makes one wheel for
every CPython 3 (py3-none-<platform>): the library has no Python bindings.
"""
import contextlib
import glob
import importlib.util
import os
import re
import shutil
import sys
import threading
import time

import torch
from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
from torch.utils import cpp_extension
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, "src"))
import registry  # noqa: E402  (src/registry.py: families, head dims, arch flags)

ALL_HEAD_DIMS = registry.HEAD_DIMS
# The sources outside instantiations (dispatch, workspace sizes) and the sm80
# family's are compiled with sm80's flags; another family's instantiations with its own.
BASE_FAMILY = registry.family("sm80")


def _cutlass_include() -> str:
    import cutlass_library  # the nvidia-cutlass wheel ships the C++/CuTe headers

    path = os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include")
    if not os.path.isdir(os.path.join(path, "cute")):
        raise RuntimeError(f"nvidia-cutlass is installed but has no CuTe headers under {path}")
    return path


def _cuda_build_reason() -> str | None:
    """None when the CUDA sources can be built, else why not."""
    if os.environ.get("TFB_BUILD_CUDA", "1") == "0":
        return "TFB_BUILD_CUDA=0"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    if CUDA_HOME is None or shutil.which("nvcc", path=os.path.join(CUDA_HOME, "bin")) is None:
        return "nvcc not found (set CUDA_HOME)"
    return None


def _head_dims() -> list[int]:
    spec = os.environ.get("TFB_HEAD_DIMS")
    if not spec:
        return list(ALL_HEAD_DIMS)
    dims = sorted({int(d) for d in spec.split(",") if d.strip()})
    bad = [d for d in dims if d not in ALL_HEAD_DIMS]
    if bad:
        raise ValueError(f"TFB_HEAD_DIMS has unsupported head dims {bad}; choose from {ALL_HEAD_DIMS}")
    return dims


def _rel(paths):
    return sorted(os.path.relpath(p, ROOT) for p in paths)


def _instantiations(family, head_dims):
    return [os.path.join("src", f) for f in registry.instantiation_files(family, head_dims)]


def _progress_stream():
    """Where build progress goes: the terminal when there is one, because pip
    without -v swallows a build's output and shows only "still running...";
    else stderr (pip -v, CI logs)."""
    try:
        return open("/dev/tty", "w")
    except OSError:
        return sys.stderr


class _Progress:
    """Prints a line per compiled source while ninja runs: the build's ninja
    logs gain a line per finished object. ninja may rewrite a log (it compacts
    old entries when a build starts), so lines are told apart by content, not
    by offset."""

    def __init__(self, build_dirs, total):
        self.logs = [os.path.join(d, ".ninja_log") for d in build_dirs]
        self.seen = {log: set(self._lines(log)) for log in self.logs}
        self.total, self.done = total, 0
        self.start = time.monotonic()
        self.out = _progress_stream()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _lines(log):
        if not os.path.exists(log):
            return []
        with open(log) as f:
            return f.read().splitlines()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self._poll()
        minutes = (time.monotonic() - self.start) / 60
        print(f"torch_flash_backend: compiled {self.done} sources in {minutes:.1f} min", file=self.out, flush=True)

    def _run(self):
        while not self.stop.wait(2.0):
            self._poll()

    def _poll(self):
        for log in self.logs:
            for line in self._lines(log):
                if line in self.seen[log]:
                    continue
                self.seen[log].add(line)
                fields = line.split("\t")
                if len(fields) < 4 or not fields[0].isdigit():
                    continue  # the header line
                self.done += 1
                seconds = (int(fields[1]) - int(fields[0])) / 1000
                name = os.path.relpath(fields[3], os.path.join(ROOT, "build", "temp"))
                print(f"torch_flash_backend: [{self.done}/{self.total}] {name} ({seconds:.0f} s)", file=self.out,
                      flush=True)


class BuildLibrary(BuildExtension):
    """Names the output as a plain shared library, not a Python module, and
    compiles every source in one ninja run, each instantiation with its
    family's nvcc arch flags (ext.family_arch; the sm90 family's code is
    sm_90a alone): one run keeps both jobs busy to the end, where a run per
    family left a job idle at the end of each.
    """

    def finalize_options(self):
        super().finalize_options()
        # pip compiles in a fresh temporary directory; one fixed place keeps its
        # rebuilds incremental and its ninja logs for scripts/compile_times.py.
        self.build_temp = os.path.join(ROOT, "build", "temp")

    def build_extension(self, ext):
        order = [os.path.abspath(os.path.join(ROOT, path)) for path in ext.sources]
        with _Progress([self.build_temp], len(ext.sources)), \
                _ninja_per_source(getattr(ext, "family_arch", {}), order):
            super().build_extension(ext)

    def get_ext_filename(self, ext_name):
        return os.path.join(*ext_name.split(".")) + ".so"

    def copy_extensions_to_source(self):
        os.makedirs(os.path.join(ROOT, "torch_flash_backend", "lib"), exist_ok=True)
        super().copy_extensions_to_source()


@contextlib.contextmanager
def _ninja_per_source(arch_of, order):
    """torch writes one nvcc flag set into its build.ninja, its sources sorted
    by name (setuptools sorts them). ninja lets a build statement override a
    variable, so each source in arch_of ({absolute path: its family's -gencode
    flags}) gets cuda_post_cflags with the base family's arch flags swapped for
    its own; and the statements are put in `order` (absolute paths), since ninja
    starts jobs that nothing orders otherwise in the file's order (ninja
    1.12+ prefers the longest from its log, when a build has one)."""
    write = cpp_extension._write_ninja_file
    rank = {path: i for i, path in enumerate(order)}

    def write_ordered(path, *args, **kwargs):
        write(path, *args, **kwargs)
        with open(path) as f:
            lines = f.read().splitlines()
        base = next(line for line in lines if line.startswith("cuda_post_cflags = "))[len("cuda_post_cflags = "):]
        for flag in BASE_FAMILY.nvcc_arch:
            base = base.replace(f" {flag}", "")
        first = next(i for i, line in enumerate(lines) if line.startswith("build "))
        head, blocks, tail = lines[:first], [], []
        for line in lines[first:]:
            if line.startswith("build ") and (": compile " in line or ": cuda_compile " in line):
                source = line.split(": ", 1)[1].split(" ", 1)[1].replace("$ ", " ")
                blocks.append((rank.get(source, len(rank)), len(blocks), [line]))
                if source in arch_of:
                    blocks[-1][2].append(f"  cuda_post_cflags = {base} {' '.join(arch_of[source])}")
            elif blocks and not tail and line.startswith("  "):
                blocks[-1][2].append(line)
            else:
                tail.append(line)
        body = [line for *_, block in sorted(blocks, key=lambda b: b[:2]) for line in block]
        with open(path, "w") as f:
            f.write("\n".join(head + body + tail) + "\n")

    cpp_extension._write_ninja_file = write_ordered
    try:
        yield
    finally:
        cpp_extension._write_ninja_file = write


# Seconds each (family, pass) instantiation file took on two cores, cold
# (scripts/compile_times.py), for the order below: the costliest start first.
_COMPILE_SECONDS = {("sm80", "bwd"): 85, ("sm80", "fwd"): 70, ("sm90", "fwd"): 65, ("sm90", "bwd"): 47,
                    ("decode", "fwd"): 20, ("sm90", "fwd_fp8"): 30}
_WIDE_MMA_SECONDS = 45  # sm90's head dim 256 forward (80-key tiles) on top


def _costliest_first(head_dims, families):
    """(sources, {absolute path: arch flags}) of every family's instantiations,
    the costliest first (ninja starts jobs in the order it is given them)."""
    files = []
    for fam in families:
        for path in _instantiations(fam, head_dims):
            pass_, dim = re.match(r"(.+)_hdim(\d+)_", os.path.basename(path)).groups()
            dim = int(dim)
            cost = _COMPILE_SECONDS.get((fam.name, pass_), 60) + (_WIDE_MMA_SECONDS if (pass_, dim) in fam.wide_mma
                                                                   else 0)
            files.append((-cost, -dim, path, fam))
    files.sort(key=lambda f: f[:3])
    arch = {os.path.abspath(os.path.join(ROOT, path)): fam.nvcc_arch for _, _, path, fam in files
            if fam is not BASE_FAMILY}
    return [path for _, _, path, _ in files], arch


def _release_rule():
    """torch_flash_backend/_release.py, read by path: the package itself loads
    the op library this build makes."""
    path = os.path.join(ROOT, "torch_flash_backend", "_release.py")
    spec = importlib.util.spec_from_file_location("_tfb_release", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write_build_record(with_cuda: bool) -> list[str]:
    """Records the torch this library is built against, which the package
    checks before loading it (an op library loaded beside another torch release
    fails in ways nobody can read), and returns the wheel's requirement on it."""
    release = _release_rule().release(torch.__version__)
    cuda = torch.version.cuda if with_cuda else None
    text = ('"""Written by setup.py: the torch this build of the op library is for."""\n'
            f"TORCH = {torch.__version__!r}\nCUDA = {cuda!r}\n")
    path = os.path.join(ROOT, "torch_flash_backend", "_built_for.py")
    if not os.path.exists(path) or open(path).read() != text:
        with open(path, "w") as f:
            f.write(text)
    return [f"torch=={release}.*"]


def extension():
    sources = _rel(glob.glob(os.path.join(ROOT, "csrc", "*.cpp")) + glob.glob(os.path.join(ROOT, "csrc", "cpu", "*.cpp")))
    # at::parallel_for only runs in parallel when the library itself is built with OpenMP.
    # -g0: Python's own flags add -g, which doubled the host files' compile time
    # (attention_cuda.cpp 36 s against 19) for debug info nobody ships.
    cxx = ["-O3", "-std=c++17", "-fopenmp", "-g0"]
    link = ["-fopenmp"]
    reason = _cuda_build_reason()
    if reason is not None:
        print(f"torch_flash_backend: building the CPU part only ({reason})", file=sys.stderr)
        return CppExtension(
            "torch_flash_backend.lib.libtorch_flash_backend",
            sources,
            include_dirs=[os.path.join(ROOT, "csrc"), os.path.join(ROOT, "src")],
            extra_compile_args={"cxx": cxx},
            extra_link_args=link,
            py_limited_api=True,
        )

    head_dims = _head_dims()
    with_sm90 = os.environ.get("TFB_BUILD_SM90", "1") != "0"
    defines = ["-DTFB_WITH_CUDA"] + [f"-DTFB_WITH_HDIM{d}" for d in head_dims]
    if with_sm90:
        defines.append("-DTFB_WITH_SM90")
    sources += _rel(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cpp")))
    sources += _rel(glob.glob(os.path.join(ROOT, "src", "*", "*.cu")))
    # Every family's instantiations in one ninja run, the costliest first: the
    # build then ends on short jobs.
    families = [fam for fam in registry.FAMILIES if fam.name != "sm90" or with_sm90]
    instantiations, family_arch = _costliest_first(head_dims, families)
    sources = instantiations + sources
    nvcc = [
        "-O3", "-std=c++17", "-DNDEBUG",
        "--expt-relaxed-constexpr", "--expt-extended-lambda", "--use_fast_math",
        "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
        "-Xfatbin", "-compress-all",
    ] + list(BASE_FAMILY.nvcc_arch) + defines
    if os.environ.get("TFB_PTXAS_VERBOSE"):
        nvcc += ["-Xptxas", "-v"]
    print(
        f"torch_flash_backend: building CPU and CUDA (CUDA {torch.version.cuda}, head dims {head_dims}, "
        f"sm90 {'on' if with_sm90 else 'off (TFB_BUILD_SM90=0)'})",
        file=sys.stderr,
    )
    ext = CUDAExtension(
        "torch_flash_backend.lib.libtorch_flash_backend",
        sources,
        include_dirs=[os.path.join(ROOT, "csrc"), os.path.join(ROOT, "src"), _cutlass_include()],
        extra_compile_args={"cxx": cxx + defines, "nvcc": nvcc},
        extra_link_args=link,
        py_limited_api=True,
    )
    ext.family_arch = family_arch
    return ext


class Wheel(bdist_wheel):
    """The library has no Python bindings (torch.ops.load_library loads it), so
    one wheel serves every CPython 3: tagged py3-none-<platform>."""

    def finalize_options(self):
        super().finalize_options()
        self.root_is_pure = False

    def get_tag(self):
        return "py3", "none", super().get_tag()[2]


setup(ext_modules=[extension()], install_requires=_write_build_record(_cuda_build_reason() is None),
      cmdclass={"build_ext": BuildLibrary, "bdist_wheel": Wheel})
