"""The layers depend one way: src/ knows nothing of torch, csrc/ nothing of Python.

These checks keep the layering promises (docs/ARCHITECTURE.md) that no other test would notice
breaking: the kernels compile without torch, and the op library loads into a
process that has no Python (a C++ program, an AOTInductor runner).
"""
import functools
import glob
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIB = os.path.join(ROOT, "torch_flash_backend", "lib", "libtorch_flash_backend.so")

# These read the source tree; run from an installed wheel's tests they have none.
pytestmark = pytest.mark.skipif(not os.path.isdir(os.path.join(ROOT, "src", "common")),
                                reason="needs the source tree (src/, csrc/)")

INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.MULTILINE)
TORCH_HEADER = re.compile(r"^(torch|ATen|c10|caffe2|pybind11)/|^Python\.h$")
PYTHON_HEADER = re.compile(r"^(Python\.h|pybind11/.*|torch/extension\.h|torch/python\.h|torch/csrc/utils/pybind\.h)$")


def _files(top):
    for dirpath, _, names in os.walk(os.path.join(ROOT, top)):
        for name in sorted(names):
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                data = f.read()
            if b"\0" not in data:  # text files only
                yield os.path.relpath(path, ROOT), data.decode("utf-8", errors="replace")


def _includes(top):
    return [(path, quote, header) for path, text in _files(top) for quote, header in INCLUDE.findall(text)]


def test_src_never_includes_torch():
    includes = _includes("src")
    assert includes, "found no #include under src/"
    bad = [f"{path}: #include {header}" for path, _, header in includes if TORCH_HEADER.search(header)]
    assert not bad, "src/ must stay torch-free:\n" + "\n".join(bad)


def test_src_quoted_includes_stay_in_src():
    """A quoted include under src/ resolves inside src/, never into csrc/."""
    bad = []
    for path, quote, header in _includes("src"):
        if quote != '"' or not path.endswith((".h", ".hpp", ".cuh", ".cu", ".cpp", ".inl")):
            continue  # a generator's template line is not an include
        candidates = (os.path.join(ROOT, os.path.dirname(path), header), os.path.join(ROOT, "src", header))
        if not any(os.path.isfile(c) for c in candidates):
            bad.append(f"{path}: #include \"{header}\"")
    assert not bad, "quoted includes under src/ that do not resolve inside src/:\n" + "\n".join(bad)


def _family_of(path):
    """src/<family>/... -> family; None for src/common and the top level."""
    parts = path.split(os.sep)
    return parts[1] if len(parts) > 2 and parts[1] not in ("common",) else None


def test_families_include_only_their_own_headers_and_common():
    """One family never reaches into another's headers (shared parts live in
    src/common/), and src/common/ includes no family."""
    bad = []
    for path, quote, header in _includes("src"):
        if quote != '"' or not path.endswith((".h", ".cuh", ".cu", ".cpp")):
            continue  # a generator's template line is not an include
        target = header.split("/")[0] if "/" in header else None
        family = _family_of(path)
        if target is None or target == "common":
            continue
        if family is None or target != family:
            bad.append(f"{path}: #include \"{header}\"")
    assert not bad, "cross-family includes under src/:\n" + "\n".join(bad)


def test_csrc_never_includes_python():
    includes = _includes("csrc")
    assert includes, "found no #include under csrc/"
    bad = [f"{path}: #include {header}" for path, _, header in includes if PYTHON_HEADER.search(header)]
    assert not bad, "csrc/ is a plain op library with no Python bindings:\n" + "\n".join(bad)


def _instantiation_files(root):
    """What the generator writes from the registry: instantiations, kernel_list.h, kernels.cmake."""
    paths = glob.glob(os.path.join(root, "*", "instantiations", "*.cu"))
    paths += [os.path.join(root, name) for name in ("kernel_list.h", "kernels.cmake")]
    return {os.path.relpath(p, root): open(p).read() for p in paths if os.path.exists(p)}


def test_committed_instantiations_match_the_generator(tmp_path):
    subprocess.run([sys.executable, os.path.join(ROOT, "src", "generate_instantiations.py"), str(tmp_path)], check=True)
    committed, generated = _instantiation_files(os.path.join(ROOT, "src")), _instantiation_files(tmp_path)
    stale = sorted(f for f in committed.keys() | generated.keys() if committed.get(f) != generated.get(f))
    assert not stale, f"run `python src/generate_instantiations.py`; out of date: {stale}"
    assert {"kernel_list.h", "kernels.cmake"} <= generated.keys()
    assert any(f.startswith("sm90" + os.sep) for f in generated)


# A file holds several head dims; a build of some (TFB_HEAD_DIMS) lists the files
# holding them and compiles only theirs, each under its TFB_WITH_HDIM<d>.
GUARDED = re.compile(r"#ifdef TFB_WITH_HDIM(\d+)\n(.*?)#endif", re.DOTALL)


def test_each_head_dim_is_instantiated_once_under_its_own_guard():
    registry = _registry()
    for fam in registry.FAMILIES:
        seen = []
        for path in registry.instantiation_files(fam):
            text = open(os.path.join(ROOT, "src", path)).read()
            blocks = GUARDED.findall(text)
            assert sum(b.count("template ") for _, b in blocks) == text.count("template "), f"{path}: unguarded"
            for d, body in blocks:
                assert re.findall(r", (\d+)>\(", body) == [d] * body.count("template "), f"{path}: HDIM{d} block"
                seen.append((path.split("_hdim")[0], int(d)))
                assert path in registry.instantiation_files(fam, [int(d)]), (path, d)
        want = [(f"{fam.name}/instantiations/{p}", d) for p, dims in registry.passes_with_fp8(fam) for d in dims]
        assert sorted(seen) == sorted(want), fam.name


# Each family's instantiations compile for the archs its registry entry names
# (sm_90a alone for sm90; decode adds sm_90 code to sm_80's); every other CUDA
# source for the base family's (sm80).
def _archs(command):
    return set(re.findall(r"\b(?:sm|compute)_\d+a?\b", command))


def _registry():
    """src/registry.py, imported when a test asks (an installed wheel's tests have no src/)."""
    sys.path.insert(0, os.path.join(ROOT, "src"))
    try:
        import registry
    finally:
        sys.path.pop(0)
    return registry


@functools.cache
def _registry_archs():
    """{family: the archs of its nvcc flags}, from src/registry.py."""
    return {f.name: _archs(" ".join(f.nvcc_arch)) for f in _registry().FAMILIES}


def _family(path):
    parts = path.split(os.sep)
    if len(parts) >= 4 and parts[0] == "src" and parts[2] == "instantiations" and parts[1] in _registry_archs():
        return parts[1]
    return "sm80"


def _wrong_archs(commands):
    """{file: archs} for the compile lines in `commands` ({file: line}) that target the wrong archs."""
    return {f: _archs(c) for f, c in commands.items() if _archs(c) != _registry_archs()[_family(f)]}


def test_setup_py_build_targets_sm90_files_alone_at_sm_90a():
    """The ninja files of the last setup.py CUDA build (.ci/run makes one)."""
    ninja_files = glob.glob(os.path.join(ROOT, "build", "temp*", "build.ninja"))
    ninja_files += glob.glob(os.path.join(ROOT, "build", "temp*", "*", "build.ninja"))
    commands = {}
    for path in ninja_files:
        text = open(path).read()
        flags = re.search(r"^cuda_post_cflags = (.*)$", text, re.MULTILINE).group(1)
        # A build statement may set its own flags on the indented line after it.
        for source, own in re.findall(r"^build \S+: cuda_compile (\S+)\n(?:  cuda_post_cflags = (.*)\n)?", text,
                                      re.MULTILINE):
            commands[os.path.relpath(source, ROOT)] = own or flags
    if not commands:
        pytest.skip("no setup.py CUDA build under build/")
    assert not _wrong_archs(commands), _wrong_archs(commands)


def _built_library():
    assert os.path.isfile(LIB), f"{LIB} is missing: build it with `python setup.py build_ext --inplace`"
    return LIB


def _nm(*args):
    if shutil.which("nm") is None:
        pytest.skip("nm (binutils) is not installed")
    return subprocess.run(["nm", "-D", *args, _built_library()], check=True, capture_output=True, text=True).stdout


def test_library_has_no_python_symbols():
    undefined = [line.split()[-1] for line in _nm("--undefined-only").splitlines() if line.strip()]
    assert undefined, "nm listed no undefined symbols at all; is this the right file?"
    python = [s for s in undefined if re.match(r"_?Py", s)]
    assert not python, f"the op library needs Python symbols: {python[:10]}"


def test_library_is_not_a_python_module():
    defined = [line.split()[-1] for line in _nm("--defined-only").splitlines() if line.strip()]
    assert not [s for s in defined if s.startswith("PyInit_")]


def test_library_shares_the_process_cxx_runtime():
    """A toolchain that links libstdc++ statically gives the library its own
    exception runtime; an error thrown by an op then crashes the process
    instead of reaching Python as a RuntimeError."""
    defined = {line.split()[-1] for line in _nm("--defined-only").splitlines() if line.strip()}
    assert "__cxa_throw" not in defined, "the library links libstdc++ statically"


def test_library_loads_with_torch_ops_load_library():
    # A fresh interpreter that never imports the package: loading the file alone
    # must register the schemas, as it does for a C++ host.
    code = (
        "import sys, torch\n"
        "torch.ops.load_library(sys.argv[1])\n"
        "ns = torch.ops.torch_flash_backend\n"
        "print(ns.fwd.default._schema)\n"
        "print(ns.bwd.default._schema)\n"
        "assert 'torch_flash_backend' not in sys.modules\n"
        "assert all(isinstance(k, str) for k in ns.built_kernels())\n"
    )
    result = subprocess.run([sys.executable, "-c", code, _built_library()], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    fwd, bwd = result.stdout.splitlines()[-2:]
    assert fwd.startswith("torch_flash_backend::fwd(Tensor q, Tensor k, Tensor v, float? scale=None, bool is_causal=False, "
                          "str? family=None, str? backward_family=None, Tensor? attn_mask=None, bool bottom_right=False, "
                          "int window_left=-1, int window_right=-1)")
    assert bwd.startswith("torch_flash_backend::bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
                          "float? scale=None, bool is_causal=False, str? family=None, Tensor? attn_mask=None, "
                          "bool bottom_right=False, int window_left=-1, int window_right=-1)")


def test_cmake_kernels_target_has_no_torch_include_path(tmp_path):
    """CMake's tfb_kernels compiles every src/ kernel with no torch header in reach.

    Only configures (seconds); .ci/run compiles the same sources through setup.py.
    """
    if shutil.which("cmake") is None:
        pytest.skip("cmake is not installed")
    if shutil.which("nvcc") is None and not os.path.isfile("/usr/local/cuda/bin/nvcc"):
        pytest.skip("nvcc is not installed, so CMake has no tfb_kernels target")
    import torch

    build = tmp_path / "build"
    env = dict(os.environ, CUDACXX=os.environ.get("CUDACXX", shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"))
    configure = subprocess.run(
        ["cmake", "-S", ROOT, "-B", str(build), "-DTFB_WITH_CUDA=ON", "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON",
         f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}"],
        capture_output=True, text=True, env=env,
    )
    assert configure.returncode == 0, configure.stdout[-3000:] + configure.stderr[-3000:]
    commands = json.loads((build / "compile_commands.json").read_text())
    kernels = {os.path.relpath(c["file"], ROOT): c["command"] for c in commands}
    kernels = {f: c for f, c in kernels.items() if f.startswith("src" + os.sep)}
    expected = {
        os.path.relpath(os.path.join(d, n), ROOT)
        for d, _, names in os.walk(os.path.join(ROOT, "src")) for n in names if n.endswith(".cu")
    }
    assert set(kernels) == expected, "tfb_kernels must compile every .cu file under src/"
    assert not _wrong_archs(kernels), _wrong_archs(kernels)
    torch_dir = os.path.dirname(torch.__file__)
    leaks = {f: c for f, c in kernels.items() if torch_dir in c}
    assert not leaks, f"kernel compile lines reach into torch: {next(iter(leaks.values()), '')[:500]}"


def test_kernel_families_setting_is_read_by_the_router_alone():
    """TFB_KERNEL_FAMILIES is a user setting the router reads; the ops run the family
    they are given (their `family` argument). The one C++ reader is enable()'s
    decision cache (csrc/routing.cpp), which only notes the value its decisions
    were made under, to ask the router again when it changes."""
    readers = []
    for top in ("src", "csrc", "torch_flash_backend"):
        for path, text in _files(top):
            if "getenv" in text and "TFB_KERNEL_FAMILIES" in text:
                readers.append(path)
            if path.endswith(".py") and re.search(r"os\.environ(\.get\(|\[)\s*(FAMILIES_ENV|['\"]TFB_KERNEL_FAMILIES)",
                                                  text):
                readers.append(path)
    assert sorted(readers) == [os.path.join("csrc", "routing.cpp"),
                               os.path.join("torch_flash_backend", "_router.py")], readers
    routing = dict(_files("csrc"))[os.path.join("csrc", "routing.cpp")]
    assert routing.count("kFamiliesEnv") == 2, "routing.cpp reads the setting in current_cache() alone"


# ------------------------------------------------------- size and one place per rule

SOURCE_TOPS = ("src", "csrc", "torch_flash_backend", "test", "benchmarks", "scripts", "examples")
SOURCE_SUFFIXES = (".py", ".h", ".cuh", ".cu", ".cpp", ".hpp", ".sh")
MAX_LINES = 600
GENERATED = "Generated by src/generate_instantiations.py"


def _sources():
    for top in SOURCE_TOPS + (".ci",):
        for path, text in _files(top):
            if (path.endswith(SOURCE_SUFFIXES) or path == os.path.join(".ci", "run")) and GENERATED not in text[:300]:
                yield path, text


def test_no_source_file_over_600_lines():
    """A file that long holds several jobs: split it (one stage or one topic a file)."""
    long = {path: text.count("\n") for path, text in _sources() if text.count("\n") > MAX_LINES}
    assert not long, f"source files over {MAX_LINES} lines: {long}"


# A named constant with a literal value at namespace scope (this tree does not
# indent namespaces; members of a traits struct are per struct): C++ constexpr
# or #define, Python module level.
CPP_CONSTANT = re.compile(r"^(?:static\s+)?constexpr\s+[\w:]+\s+(k[A-Z]\w*)\s*=\s*([-+]?[\d.][\w.+-]*)\s*;",
                          re.MULTILINE)
CPP_DEFINE = re.compile(r"^\s*#\s*define\s+(TFB_[A-Z0-9_]+)\s+([-+.\d][\w.+-]*)\s*$", re.MULTILINE)
PY_CONSTANT = re.compile(r"^([A-Z][A-Z0-9_]+)\s*=\s*([-+]?[\d.][\w.+-]*)\s*(?:#.*)?$", re.MULTILINE)
# Rules whose value once lived in several files, by the literal that defines them.
RULE_LITERALS = {"log2(e)": re.compile(r"1\.44269504"), "the additive limit": re.compile(r"\b65536(?:\.0*)?f\b"),
                 "the smallest scale an additive mask takes": re.compile(r"\b1e-30f?\b")}


def _constant_definitions():
    """(name, value, path) of every named literal constant in the library's own code (the
    library itself: src/, csrc/, torch_flash_backend/; tests and benchmarks may restate)."""
    for top in ("src", "csrc", "torch_flash_backend"):
        for path, text in _files(top):
            if path.endswith((".h", ".cuh", ".cu", ".cpp")):
                pattern = (CPP_CONSTANT, CPP_DEFINE)
            elif path.endswith(".py"):
                pattern = (PY_CONSTANT,)
            else:
                continue
            for p in pattern:
                for name, value in p.findall(text):
                    yield name, value, path


def test_no_constant_is_defined_twice():
    """One place per rule: a constant named in two files, or one of the rules
    above stated as a literal in two places, drifts apart one day."""
    places = {}
    for name, value, path in _constant_definitions():
        places.setdefault(name, set()).add(path)
    twice = {name: sorted(paths) for name, paths in places.items() if len(paths) > 1}
    assert not twice, f"constants defined in several files: {twice}"
    stated = {}
    for top in ("src", "csrc", "torch_flash_backend"):
        for path, text in _files(top):
            if not path.endswith((".h", ".cuh", ".cu", ".cpp", ".py")):
                continue
            code = re.sub(r"//[^\n]*|#[^\n]*\n", "\n", text) if not path.endswith(".py") else re.sub(
                r"#[^\n]*|\"\"\"[\s\S]*?\"\"\"|\"[^\"\n]*\"", "", text)
            for rule, literal in RULE_LITERALS.items():
                stated.setdefault(rule, []).extend([path] * len(literal.findall(code)))
    again = {rule: paths for rule, paths in stated.items() if len(paths) > 1}
    assert not again, f"rules stated in more than one place: {again}"
