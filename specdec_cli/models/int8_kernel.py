"""specdec's own kernels: int8 (int8_gemm.c) for the `int8` format, q4 (q4_gemm.c, used by q4.py) for the `q4`
format, and the RMSNorm, attention and layer halves around them (layer_kernels.c), built into one library
once per machine with the system C compiler, kept under the
specdec home, called through ctypes.

Why a kernel of our own: at the sizes speculation runs (1-16 tokens) a forward's cost is reading the
weights, and torch's oneDNN int8 matmul spends ~80 µs a call around that (measured: a 256x1536 layer
took 90 µs for one token; this kernel 15 µs). It gives the same numbers as the oneDNN path bit for bit
(tested), so which one runs changes speed only.

Chosen per CPU: AVX512-VNNI or AVX2 instructions, picked by the CPU's flags at run time; where the CPU has
AMX-INT8 too (and the kernel lets the process use it), the q4 matmul of several tokens runs on AMX (q4_amx.c,
the same bits as VNNI).
SPECDEC_INT8_KERNEL=onednn forces torch's matmul, =avx2 the AVX2 code and =vnni the VNNI code without AMX (to
compare them; `specdec calibrate` names the one it timed; q4 takes the same switch, and with `onednn` does not
run); any other value is refused in one line. Without a C compiler the int8 format runs on oneDNN, q4 does
not run, and `kernel_problem()` says why."""

from __future__ import annotations

import ctypes
import errno
import functools
import hashlib
import os
import platform
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import torch

from specdec_cli.errors import InputError
from specdec_cli.models import row_kernels
from specdec_cli.models.paths import atomic_folder, cache_dir, one_maker

SOURCES = tuple(Path(__file__).with_name(name) for name in ("int8_gemm.c", "q4_gemm.c", "q4_amx.c", "layer_kernels.c",
                                                                  "sampling_kernels.c"))  # one library
HEADERS = (Path(__file__).with_name("q4_layout.h"),)  # included by the sources: part of the build's key
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-ffp-contract=off")  # no contraction: the exact float steps
ISA_NAMES = {3: "AVX512-VNNI + AMX", 2: "AVX512-VNNI", 1: "AVX2"}
BLOCK = 32  # output rows per packed block (int8_gemm.c)


KERNEL_CHOICES = ("", "onednn", "avx2", "vnni")  # SPECDEC_INT8_KERNEL's values ("": unset, the CPU's best)


BUILD_FAILED = "specdec's matmul kernels (int8, q4) did not build"


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, int, str | None]:
    return load_library()


def load_library() -> tuple[ctypes.CDLL | None, int, str | None]:
    """(the loaded library, the ISA it runs: 3 AVX512-VNNI + AMX, 2 AVX512-VNNI or 1 AVX2, None) or (None, 0,
    why not); the library is compiled into the specdec home on first use. Once per process (`_library`)."""
    choice = os.environ.get("SPECDEC_INT8_KERNEL", "").strip().lower()
    if choice not in KERNEL_CHOICES:  # a typo ran the default code while the user timed what they thought they chose
        raise InputError(f"SPECDEC_INT8_KERNEL={os.environ['SPECDEC_INT8_KERNEL']!r} is not one of "
                         f"{', '.join(filter(None, KERNEL_CHOICES))}",
                         "unset it to run the code this CPU is best at")
    if choice == "onednn":
        return None, 0, "SPECDEC_INT8_KERNEL=onednn"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, 0, f"specdec's matmul kernels (int8, q4) are for x86-64 ({platform.machine()} here)"
    try:
        path = _built()
    except (OSError, subprocess.SubprocessError) as error:
        return None, 0, f"{BUILD_FAILED} ({error})"
    library = ctypes.CDLL(str(path))
    _declare(library)
    isa = library.specdec_isa()
    if not isa:
        return None, 0, "this CPU has neither AVX512-VNNI nor AVX2"
    row_kernels.install(library)
    forced = {"avx2": 1, "vnni": min(isa, 2)}.get(choice, isa)
    from specdec_cli.models.q4_pairs import calibrated_q4_pairs  # it reads the calibration, which asks this module

    library.specdec_q4_pair_up_to(calibrated_q4_pairs(forced))
    return library, forced, None


def q4_pairs() -> int:
    """Up to how many tokens q4's matmul takes its weight blocks two at a time (0: never; q4_gemm.c). Loading the
    library sets what `specdec calibrate` measured here (`calibrated_q4_pairs`)."""
    library, _, problem = _library()
    return 0 if problem else library.specdec_q4_pairs()


def pair_q4_blocks(up_to: int) -> None:
    """From now on q4's matmul takes its weight blocks two at a time in forwards of up to `up_to` tokens (0: never):
    the same bits, another speed, faster on some CPUs and slower on others."""
    library, _, problem = _library()
    if problem is None:
        library.specdec_q4_pair_up_to(up_to)


def _built() -> Path:
    """The shared library for this source and compiler, compiled into the cache if it is not there yet."""
    compiler = c_compiler()
    source = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    key = hashlib.sha256(source + " ".join((compiler, *FLAGS)).encode()).hexdigest()[:16]
    final = cache_dir("kernels") / f"int8-{key}"
    library = final / "libspecdec_int8.so"
    if _whole(library):
        return library
    with one_maker(final):  # Ray workers on one machine build it once
        if not _whole(library):
            shutil.rmtree(final, ignore_errors=True)  # a library cut short crashes the process that loads it (SIGBUS)
            with atomic_folder(final) as staging:
                try:
                    compile_library(SOURCES, staging / library.name, compiler)
                except OSError as error:  # a compiler or assembler without AMX (q4_amx.c): everything else, without it
                    if error.errno == errno.ENOSPC:  # a full disk: no second try (atomic_folder says it in one line)
                        raise
                    compile_library(SOURCES, staging / library.name, compiler, defines=("SPECDEC_NO_AMX",))
                _stamp(staging / library.name).write_text(_digest(staging / library.name), encoding="utf-8")
    return library


def _stamp(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _digest(library: Path) -> str:
    return hashlib.sha256(library.read_bytes()).hexdigest()


def _whole(library: Path) -> bool:
    """Whether `library` is the file its build left (its sha256 beside it, ~0.1 ms): loading one that a full disk
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


def _declare(library: ctypes.CDLL) -> None:
    pointer, size, integer = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    library.specdec_isa.restype = integer
    library.specdec_amx_bf16_ready.restype = integer
    library.specdec_int8_linear.restype = integer
    library.specdec_int8_linear.argtypes = [integer, integer, pointer, size, size, size, integer, pointer, pointer,
                                            pointer, pointer, size, pointer]
    library.specdec_q8_groups.restype = None
    library.specdec_q8_groups.argtypes = [integer, pointer, size, size, size, pointer, pointer, pointer]
    library.specdec_q4_pair_up_to.restype = None
    library.specdec_q4_pair_up_to.argtypes = [integer]
    library.specdec_q4_pairs.restype = integer
    library.specdec_q4_linear.restype = integer
    library.specdec_q4_linear.argtypes = [integer, integer, integer, pointer, size, size, size, pointer, pointer, size,
                                          pointer]
    # Load time: quantising and packing weights, picking a q4 layer's rows.
    library.specdec_int8_quantize.restype = None
    library.specdec_int8_quantize.argtypes = [integer, pointer, integer, size, size, size, pointer, pointer]
    library.specdec_int8_pack.restype = None
    library.specdec_int8_pack.argtypes = [integer, pointer, size, size, pointer, pointer]
    library.specdec_q4_quantize.restype = None
    library.specdec_q4_quantize.argtypes = [integer, pointer, integer, size, size, size, pointer]
    library.specdec_q4_select_rows.restype = None
    library.specdec_q4_select_rows.argtypes = [integer, pointer, size, pointer, size, pointer]
    library.specdec_attention.restype = integer
    library.specdec_attention.argtypes = [integer, pointer, pointer, pointer, pointer, size, size, size, size, size,
                                          size, ctypes.c_float, pointer]
    library.specdec_rms_norm.argtypes = [pointer, pointer, ctypes.c_float, size, size, pointer]
    library.specdec_lean_qkv.restype = integer
    library.specdec_lean_qkv.argtypes = [integer, integer, pointer, size, size, pointer, ctypes.c_float, pointer,
                                         pointer, pointer, size, size, size, pointer, pointer, pointer]
    library.specdec_decoder_forward.restype = integer
    library.specdec_decoder_forward.argtypes = [integer, integer, pointer, size, pointer, pointer, size, pointer,
                                                pointer, pointer, size, pointer, size, size, pointer, pointer,
                                                pointer, size, size, size, ctypes.c_float, pointer, ctypes.c_float,
                                                pointer]
    library.specdec_top_k_rows.restype = size
    library.specdec_top_k_rows.argtypes = [pointer, size, size, size, pointer, pointer]
    library.specdec_support.restype = size
    library.specdec_support.argtypes = [pointer, size, pointer]
    library.specdec_lean_mlp.restype = integer
    library.specdec_lean_mlp.argtypes = [integer, integer, pointer, pointer, size, size, pointer, pointer,
                                         ctypes.c_float, pointer, pointer, pointer]


def build_problem() -> str | None:
    """Why the kernels did not build here (no C compiler, a compiler that fails), where that is what keeps them
    from running: the one kernel problem a user can fix. None when they run, or for any other reason."""
    problem = _library()[2]
    return problem if problem is not None and problem.startswith(BUILD_FAILED) else None


def kernel_problem(bits: int) -> str | None:
    """None when the kernel runs here for activations of `bits` bits; else why not. The AVX2 code sums
    pairs of products in int16, so it takes only 7-bit activations (what a CPU without VNNI gets)."""
    library, isa, problem = _library()
    if problem is None and isa == 1 and bits != 7:
        return "the AVX2 kernel needs 7-bit activations"
    return problem


def kernel_name(bits: int) -> str:
    """Which int8 matmul a layer with `bits`-bit activations built now runs: `specdec AVX512-VNNI`,
    `specdec AVX2` or `oneDNN` (int8.matmul_name() asks for this CPU's activation bits)."""
    return "oneDNN" if kernel_problem(bits) else f"specdec {ISA_NAMES[_library()[1]]}"


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
    library, _, problem = _library()
    if problem:
        return pack_in_torch(weight_int8)
    values = weight_int8.contiguous()
    rows, width = values.shape
    blocks = torch.zeros(-(-rows // BLOCK), -(-width // 4), BLOCK, 4, dtype=torch.int8)
    row_sums = torch.empty(rows, dtype=torch.int32)
    library.specdec_int8_pack(torch.get_num_threads(), values.data_ptr(), rows, width, blocks.data_ptr(),
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
    library, isa, _ = _library()
    x = x.contiguous()
    tokens, width = x.shape
    out = torch.empty(tokens, row_sums.shape[0], dtype=torch.float32)
    if tokens == 0:
        return out
    failed = library.specdec_int8_linear(isa, torch.get_num_threads(), x.data_ptr(), tokens, width, blocks.shape[1],
                                         2 ** (bits - 1) - 1, blocks.data_ptr(), row_sums.data_ptr(),
                                         weight_scales.data_ptr(), None if bias is None else bias.data_ptr(),
                                         row_sums.shape[0], out.data_ptr())
    if failed:
        raise MemoryError(f"specdec's int8 matmul could not allocate its buffers for {tokens} tokens")
    return out
