"""The one binding to specdec's native CPU kernels: the int8 matmul (int8_gemm.c) of the `int8` format, the q4
matmul (q4_gemm.c, q4_avx2.c, q4_amx.c; load time: q4_pack.c) of the `q4` format, the levels matmul (levels_gemm.c,
levels_avx2.c) that holds a .gguf's Q8_0, Q6_K, Q5_0 and Q5_K tensors in q4 models, the attention (attention.c), the
RMSNorm, layer halves and decoder stack around them (layer_kernels.c) and the sampled step's row passes
(sampling_kernels.c), built into one library once per machine with the system C compiler, kept under the specdec
home, called through ctypes with the types that kernels.h declares (`prototypes`). Every other module reaches the
library through `library()` and the functions here.

Why kernels of our own: at the sizes speculation runs (a few tokens) a forward's cost is reading the weights, and
torch's oneDNN int8 matmul adds a fixed cost a call around that. The int8 kernel gives the same numbers as
the oneDNN path bit for bit (tested), so which one runs changes speed only.

Chosen per CPU: AVX512-VNNI or AVX2 instructions, picked by the CPU's flags at run time; where the CPU has
AMX-INT8 too (and the kernel lets the process use it), the q4 matmul of several tokens runs on AMX (q4_amx.c,
the same bits as VNNI).
SPECDEC_KERNELS=onednn forces torch's matmul, =avx2 the AVX2 code and =vnni the VNNI code without AMX (to compare
them; `specdec calibrate` names the one it timed; q4 takes the same switch, and with `onednn` does not run); any
other value is refused in one line. SPECDEC_INT8_KERNEL, its earlier name, is still read. Without a C compiler
the int8 format runs on oneDNN, q4 does not run, and `kernel_problem()` says why."""

from __future__ import annotations

import ctypes
import errno
import functools
import hashlib
import os
import platform
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import torch

from specdec_cli.errors import InputError
from specdec_cli.models.native.rows import CRowKernels
from specdec_cli.models.paths import atomic_folder, cache_dir, one_maker

SOURCES = tuple(Path(__file__).with_name(name) for name in (
    "int8_gemm.c", "q4_gemm.c", "q4_avx2.c", "q4_amx.c", "q4_pack.c", "levels_gemm.c", "levels_avx2.c", "attention.c",
    "layer_kernels.c", "sampling_kernels.c"))  # one library
PUBLIC_HEADER = Path(__file__).with_name("kernels.h")  # every function Python calls: `_declare` reads it
HEADERS = (PUBLIC_HEADER, *(Path(__file__).with_name(name)
                            for name in ("q4_layout.h", "levels_layout.h", "vector_math.h")))
# the headers are included by the sources: part of the build's key
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-ffp-contract=off")  # no contraction: the exact float steps
ISA_NAMES = {3: "AVX512-VNNI + AMX", 2: "AVX512-VNNI", 1: "AVX2"}
BLOCK = 32  # output rows per packed block (int8_gemm.c)
LIBRARY_NAME = "libspecdec_kernels.so"


KERNEL_CHOICES = ("", "onednn", "avx2", "vnni")  # SPECDEC_KERNELS's values ("": unset, the CPU's best)
KERNELS_VARIABLES = ("SPECDEC_KERNELS", "SPECDEC_INT8_KERNEL")  # the name, and its earlier one


BUILD_FAILED = "specdec's matmul kernels (int8, q4) did not build"


@functools.cache
def library() -> tuple[ctypes.CDLL | None, int, str | None]:
    """`load_library()`, once per process."""
    return load_library()


def _kernels_choice() -> tuple[str, str]:
    """(the variable that chose the kernels, its value lower-cased) of SPECDEC_KERNELS / SPECDEC_INT8_KERNEL."""
    variable = next((name for name in KERNELS_VARIABLES if os.environ.get(name, "").strip()), KERNELS_VARIABLES[0])
    return variable, os.environ.get(variable, "").strip().lower()


def load_library() -> tuple[ctypes.CDLL | None, int, str | None]:
    """(the loaded library, the ISA it runs: 3 AVX512-VNNI + AMX, 2 AVX512-VNNI or 1 AVX2, None) or (None, 0,
    why not); the library is compiled into the specdec home on first use."""
    variable, choice = _kernels_choice()
    if choice not in KERNEL_CHOICES:  # a typo ran the default code while the user timed what they thought they chose
        raise InputError(f"{variable}={os.environ[variable]!r} is not one of {', '.join(filter(None, KERNEL_CHOICES))}",
                         "unset it to run the code this CPU is best at")
    if choice == "onednn":
        return None, 0, f"{variable}=onednn"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, 0, f"specdec's matmul kernels (int8, q4) are for x86-64 ({platform.machine()} here)"
    try:
        path = _built()
    except (OSError, subprocess.SubprocessError) as error:
        return None, 0, f"{BUILD_FAILED} ({error})"
    loaded = ctypes.CDLL(str(path))
    _declare(loaded)
    isa = loaded.specdec_isa()
    if not isa:
        return None, 0, "this CPU has neither AVX512-VNNI nor AVX2"
    return loaded, {"avx2": 1, "vnni": min(isa, 2)}.get(choice, isa), None


def row_kernels() -> CRowKernels | None:
    """The sampled step's row passes in C where this process has loaded the library (a q4 or int8 model's first use)
    and it runs; None otherwise (the engine then runs its torch code, which gives the same results)."""
    cache_info = getattr(library, "cache_info", None)  # None where a test put an uncached loader in its place
    if cache_info is None or not cache_info().currsize:
        return None
    loaded, _, problem = library()
    return None if problem else CRowKernels(loaded)


def q4_pairs() -> int:
    """Up to how many tokens q4's matmul takes its weight blocks two at a time (0: never; q4_gemm.c). The q4 format
    sets what `specdec calibrate` measured here (formats/q4.py)."""
    loaded, _, problem = library()
    return 0 if problem else loaded.specdec_q4_pairs()


def pair_q4_blocks(up_to: int) -> None:
    """From now on q4's matmul takes its weight blocks two at a time in forwards of up to `up_to` tokens (0: never):
    the same bits, another speed, faster on some CPUs and slower on others."""
    loaded, _, problem = library()
    if problem is None:
        loaded.specdec_q4_pair_up_to(up_to)


def _built() -> Path:
    """The shared library for this source and compiler, compiled into the cache if it is not there yet."""
    compiler = c_compiler()
    source = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    key = hashlib.sha256(source + " ".join((compiler, *FLAGS)).encode()).hexdigest()[:16]
    final = cache_dir("kernels") / f"native-{key}"
    built = final / LIBRARY_NAME
    if _whole(built):
        return built
    with one_maker(final):  # Ray workers on one machine build it once
        if not _whole(built):
            shutil.rmtree(final, ignore_errors=True)  # a library cut short crashes the process that loads it (SIGBUS)
            with atomic_folder(final) as staging:
                try:
                    compile_library(SOURCES, staging / built.name, compiler)
                except OSError as error:  # a compiler or assembler without AMX (q4_amx.c): everything else, without it
                    if error.errno == errno.ENOSPC:  # a full disk: no second try (atomic_folder says it in one line)
                        raise
                    compile_library(SOURCES, staging / built.name, compiler, defines=("SPECDEC_NO_AMX",))
                _stamp(staging / built.name).write_text(_digest(staging / built.name), encoding="utf-8")
    return built


def _stamp(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _digest(library: Path) -> str:
    return hashlib.sha256(library.read_bytes()).hexdigest()


def _whole(library: Path) -> bool:
    """Whether `library` is the file its build left (its sha256 beside it): loading one that a full disk
    or a copy cut short kills the process with a bus error, not an exception."""
    try:
        return _stamp(library).read_text(encoding="utf-8") == _digest(library)
    except OSError:
        return False


def c_compiler() -> str:
    """The C compiler the kernels are built with: $CC, else cc, else gcc."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler found: install gcc, or set CC")
    return compiler


def compile_library(sources: Sequence[Path], output: Path, compiler: str, defines: Sequence[str] = ()) -> None:
    """`sources` into the shared library `output` with specdec's flags (and -D`defines`); OSError naming the
    compiler's last line when it fails."""
    result = subprocess.run([compiler, *FLAGS, *(f"-D{name}" for name in defines), "-o", str(output),
                             *map(str, sources), "-lm"],
                            capture_output=True, text=True, timeout=300)
    if result.returncode:
        if "No space left on device" in result.stderr:  # said before the linker's last line: the cache's full disk
            raise OSError(errno.ENOSPC, f"{Path(compiler).name} failed: No space left on device")
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise OSError(f"{Path(compiler).name} failed: {last}")


C_TYPES = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float, "double": ctypes.c_double}
_TYPE = r"(?:const\s+)?(?P<type>[A-Za-z_]\w*)\s*(?P<pointer>(?:\*\s*(?:const\b\s*)?)*)"  # `const float *const *`
_RETURNED = re.compile(_TYPE)
_PARAMETER = re.compile(_TYPE + r"(?P<name>[A-Za-z_]\w*)")
_PROTOTYPE = re.compile(r"(?P<returns>[A-Za-z_][\w ]*?\s*\**)\s*\b(?P<name>specdec_\w+)\s*\((?P<parameters>[^()]*)\)")
_STRUCTURE = re.compile(r"typedef\s+struct\s*\{[^{}]*\}\s*\w+\s*;")
Declaration = tuple[type | None, list[type]]  # (restype, argtypes) as ctypes takes them


def prototypes(header: str) -> dict[str, Declaration]:
    """{function name: (its ctypes restype, argtypes)} of every `specdec_*` prototype in the C `header` text: int,
    int64_t, float and double by value, any pointer as c_void_p, a void return as None. Comments, preprocessor lines
    and `typedef struct {...} name;` are passed over; any other statement, or a type outside these, raises
    ValueError (a declaration read wrong is a segfault at the call)."""
    text = re.sub(r"/\*.*?\*/", " ", header, flags=re.DOTALL)
    text = _STRUCTURE.sub(" ", re.sub(r"^\s*#.*$", " ", text, flags=re.MULTILINE))
    declared = {}
    for statement in filter(None, (" ".join(part.split()) for part in text.split(";"))):
        match = _PROTOTYPE.fullmatch(statement)
        if match is None:
            raise ValueError(f"not a prototype binding.py can read: {statement!r}")
        parameters = match["parameters"].strip()
        declared[match["name"]] = (_c_type(match["returns"], returned=True),
                                   [] if parameters == "void" else [_c_type(part) for part in parameters.split(",")])
    return declared


def _c_type(declaration: str, returned: bool = False) -> type | None:
    """The ctypes type of one parameter (`const float *x`) or, `returned`, of a return type (`int64_t`, `void`)."""
    match = (_RETURNED if returned else _PARAMETER).fullmatch(declaration.strip())
    if match is None:
        raise ValueError(f"not a parameter binding.py can read: {declaration.strip()!r}")
    if match["pointer"]:
        return ctypes.c_void_p
    if returned and match["type"] == "void":
        return None
    if match["type"] not in C_TYPES:
        raise ValueError(f"no ctypes type for {match['type']!r} (in {declaration.strip()!r})")
    return C_TYPES[match["type"]]


@functools.cache
def declarations() -> dict[str, Declaration]:
    """kernels.h's prototypes (`prototypes`): what every call into the library passes and gets back."""
    return prototypes(PUBLIC_HEADER.read_text(encoding="utf-8"))


def _declare(library: ctypes.CDLL) -> None:
    for name, (restype, argtypes) in declarations().items():
        function = getattr(library, name)
        function.restype, function.argtypes = restype, argtypes


def build_problem() -> str | None:
    """Why the kernels did not build here (no C compiler, a compiler that fails), where that is what keeps them
    from running: the one kernel problem a user can fix. None when they run, or for any other reason."""
    problem = library()[2]
    return problem if problem is not None and problem.startswith(BUILD_FAILED) else None


def kernel_problem(bits: int) -> str | None:
    """None when the kernel runs here for activations of `bits` bits; else why not. The AVX2 code sums
    pairs of products in int16, so it takes only 7-bit activations (what a CPU without VNNI gets)."""
    loaded, isa, problem = library()
    if problem is None and isa == 1 and bits != 7:
        return "the AVX2 kernel needs 7-bit activations"
    return problem


def kernel_name(bits: int) -> str:
    """Which int8 matmul a layer with `bits`-bit activations built now runs: `specdec AVX512-VNNI`,
    `specdec AVX2` or `oneDNN` (int8.matmul_name() asks for this CPU's activation bits)."""
    return "oneDNN" if kernel_problem(bits) else f"specdec {ISA_NAMES[library()[1]]}"


def weight_in_kernel_form(weight: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(a weight the load-time quantisers read as it is, its dtype code): float32 (0) or bfloat16 (1) with rows
    of unit stride, `weight` itself where it already is one (rows may lie further apart), else a float32 copy."""
    source = weight.detach()
    if source.dtype not in (torch.float32, torch.bfloat16) or source.stride(-1) != 1:
        source = source.float().contiguous()
    return source, int(source.dtype == torch.bfloat16)


def pack(weight_int8: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) int8 → (the kernel's blocks: (ceil(N/32), ceil(K/4), 32, 4) int8, (N,) int32 row sums); in C where
    the kernel runs (`pack_in_torch`'s numbers, bit for bit)."""
    loaded, _, problem = library()
    if problem:
        return pack_in_torch(weight_int8)
    values = weight_int8.contiguous()
    rows, width = values.shape
    blocks = torch.zeros(-(-rows // BLOCK), -(-width // 4), BLOCK, 4, dtype=torch.int8)
    row_sums = torch.empty(rows, dtype=torch.int32)
    loaded.specdec_int8_pack(torch.get_num_threads(), values.data_ptr(), rows, width, blocks.data_ptr(),
                              row_sums.data_ptr())
    return blocks, row_sums


def pack_in_torch(weight_int8: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`pack` in torch's tensor steps (where the kernel does not run, and to test the C)."""
    rows, width = weight_int8.shape
    padded = torch.zeros(-(-rows // BLOCK) * BLOCK, -(-width // 4) * 4, dtype=torch.int8)
    padded[:rows, :width] = weight_int8
    blocks = padded.view(padded.shape[0] // BLOCK, BLOCK, padded.shape[1] // 4, 4).permute(0, 2, 1, 3).contiguous()
    return blocks, weight_int8.to(torch.int32).sum(dim=1, dtype=torch.int32)


def packed_bytes(rows: int, width: int) -> int:
    """Bytes `pack` makes of a (rows, width) int8 weight: rows padded to 32, width to 4."""
    return -(-rows // BLOCK) * BLOCK * -(-width // 4) * 4


def unpack(blocks: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """The (rows, width) int8 weight that `pack` took."""
    return blocks.permute(0, 2, 1, 3).reshape(-1, blocks.shape[1] * 4)[:rows, :width].contiguous()


def matmul(x: torch.Tensor, blocks: torch.Tensor, row_sums: torch.Tensor, weight_scales: torch.Tensor,
           bias: torch.Tensor | None, bits: int) -> torch.Tensor:
    """(M, K) float32 → (M, N) float32: x quantised per token to `bits` bits, times the packed int8 weight,
    scaled back (and + bias): the same float steps as PerTokenInt8Linear's oneDNN path. One call into C
    (quantisation and matmul): a layer's Python overhead is a large part of a one-token forward."""
    loaded, isa, _ = library()
    x = x.contiguous()
    tokens, width = x.shape
    out = torch.empty(tokens, row_sums.shape[0], dtype=torch.float32)
    if tokens == 0:
        return out
    failed = loaded.specdec_int8_linear(isa, torch.get_num_threads(), x.data_ptr(), tokens, width, blocks.shape[1],
                                         2 ** (bits - 1) - 1, blocks.data_ptr(), row_sums.data_ptr(),
                                         weight_scales.data_ptr(), None if bias is None else bias.data_ptr(),
                                         row_sums.shape[0], out.data_ptr())
    if failed:
        raise MemoryError(f"specdec's int8 matmul could not allocate its buffers for {tokens} tokens")
    return out
