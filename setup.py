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
import glob
import importlib.util
import os
import shutil
import sys
import threading
import time

import torch
from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, "src"))
import registry  # noqa: E402  (src/registry.py: families, head dims, arch flags)

ALL_HEAD_DIMS = registry.HEAD_DIMS
# The sources outside instantiations (dispatch, workspace sizes) and the sm80
# family's are compiled with sm80's flags; a family with other flags gets its own pass.
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
    compiles each of ext.family_sources with its family's nvcc flags (an
    extension has one flag set; the sm90 family's code is sm_90a alone).
    """

    def finalize_options(self):
        super().finalize_options()
        # pip compiles in a fresh temporary directory; one fixed place keeps its
        # rebuilds incremental and its ninja logs for scripts/compile_times.py.
        self.build_temp = os.path.join(ROOT, "build", "temp")

    def build_extension(self, ext):
        family_sources = getattr(ext, "family_sources", {})
        dirs = [self.build_temp] + [os.path.join(self.build_temp, fam.name) for fam in family_sources]
        with _Progress(dirs, len(ext.sources) + sum(map(len, family_sources.values()))):
            self._build_extension(ext, family_sources)

    def _build_extension(self, ext, family_sources):
        for fam, sources in family_sources.items():
            args = dict(ext.extra_compile_args)
            args["nvcc"] = [f for f in args["nvcc"] if f not in BASE_FAMILY.nvcc_arch] + list(fam.nvcc_arch)
            # A directory of their own: torch writes one build.ninja per output directory.
            ext.extra_objects = ext.extra_objects + self.compiler.compile(
                sources, output_dir=os.path.join(self.build_temp, fam.name), macros=ext.define_macros,
                include_dirs=ext.include_dirs, extra_postargs=args, depends=ext.depends,
            )
        super().build_extension(ext)

    def get_ext_filename(self, ext_name):
        return os.path.join(*ext_name.split(".")) + ".so"

    def copy_extensions_to_source(self):
        os.makedirs(os.path.join(ROOT, "torch_flash_backend", "lib"), exist_ok=True)
        super().copy_extensions_to_source()


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
    cxx = ["-O3", "-std=c++17", "-fopenmp"]
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
    # The costliest first (ninja starts jobs in this order): the build then ends on short jobs.
    sources = _instantiations(BASE_FAMILY, head_dims) + sources
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
    ext.family_sources = {fam: _instantiations(fam, head_dims) for fam in registry.FAMILIES
                          if fam is not BASE_FAMILY and (fam.name != "sm90" or with_sm90)}
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
