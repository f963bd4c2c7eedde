"""The native library's ctypes declarations come from one header (kernels.h), parsed strictly: every function the
Python code calls is declared there, a prototype maps to the ctypes types it means, one the parser cannot read is
refused (a declaration read wrong is a segfault at the call), and the header gives each function what the
hand-written table before it gave."""

import ctypes
import os
import re
from pathlib import Path

import pytest

from specdec_cli.models.native import binding

ROOT = Path(__file__).resolve().parents[2]
P, I, L, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float

# binding.py's hand-written `_declare` before kernels.h, as it stood: (restype, argtypes).
HAND_WRITTEN = {
    "specdec_isa": (I, []),
    "specdec_amx_bf16_ready": (I, []),
    "specdec_int8_linear": (I, [I, I, P, L, L, L, I, P, P, P, P, L, P]),
    "specdec_q8_groups": (None, [I, P, L, L, L, P, P, P]),
    "specdec_q4_pair_up_to": (None, [I]),
    "specdec_q4_pairs": (I, []),
    "specdec_q4_linear": (I, [I, I, I, P, L, L, L, P, P, L, P]),
    "specdec_int8_quantize": (None, [I, P, I, L, L, L, P, P]),
    "specdec_int8_pack": (None, [I, P, L, L, P, P]),
    "specdec_q4_quantize": (None, [I, P, I, L, L, L, P]),
    "specdec_q4_select_rows": (None, [I, P, L, P, L, P]),
    "specdec_attention": (I, [I, P, P, P, P, L, L, L, L, L, L, F, F, P]),
    # The table left this restype at ctypes' default (int) where the C function returns void: None now.
    "specdec_rms_norm": (None, [P, P, F, L, L, P]),
    "specdec_lean_qkv": (I, [I, I, P, L, L, P, F, P, P, P, F, P, P, L, L, L, L, P, P, P]),
    "specdec_decoder_forward": (I, [I, I, P, L, P, P, L, P, P, P, L, P, L, L, P, P, P, L, L, L, F, P, F, P]),
    "specdec_top_k_rows": (L, [P, L, L, L, P, P]),
    "specdec_support": (L, [P, L, P]),
    "specdec_lean_mlp": (I, [I, I, P, P, L, L, P, P, P, F, P, L, P, P, F, P]),
}


def _called_from_python() -> set[str]:
    """Every `specdec_*` function the package and the tests call as an attribute of a loaded library."""
    called = set()
    for folder in ("specdec_cli", "tests"):
        for path in (ROOT / folder).rglob("*.py"):
            called |= set(re.findall(r"\.(specdec_\w+)\s*\(", path.read_text(encoding="utf-8")))
    return called


def test_every_function_python_calls_is_declared_in_the_header():
    called = _called_from_python()
    assert {"specdec_decoder_forward", "specdec_top_k_rows", "specdec_amx_ready"} <= called  # the scan finds calls
    assert called - set(binding.declarations()) == set()


def test_the_header_declares_what_the_hand_written_table_did():
    declared = binding.declarations()
    assert {name: declared[name] for name in HAND_WRITTEN} == HAND_WRITTEN
    # specdec_amx_ready: called by a test, undeclared before (int()); the levels matmul came after the table
    assert set(declared) - set(HAND_WRITTEN) == {"specdec_amx_ready", "specdec_levels_linear"}
    assert declared["specdec_levels_linear"] == (I, [I, I, I, P, L, L, L, P, P, L, P])


def test_the_parser_maps_each_c_type():
    header = """
        /* a comment; with a semicolon, and a fake prototype: int specdec_not_here(float x); */
        #include <stdint.h>
        typedef struct {
            int64_t a;
            const float *b;
        } thing;
        int64_t specdec_planted(int isa, int64_t rows, float scale, double eps, const float *x, void *y,
                                float *const *keys, const thing *things, uint8_t *visible);
        void specdec_nothing(void);
        float *specdec_pointer(int count);
    """
    assert binding.prototypes(header) == {
        "specdec_planted": (L, [I, L, F, ctypes.c_double, P, P, P, P, P]),
        "specdec_nothing": (None, []),
        "specdec_pointer": (P, [I]),
    }


@pytest.mark.parametrize("prototype", [
    "int specdec_bad(int64_t rows[4]);",  # an array parameter
    "int specdec_bad(unsigned int count);",  # a type it has no mapping for
    "int specdec_bad(size_t count);",
    "thing specdec_bad(int x);",  # a structure returned by value
    "int specdec_bad(thing by_value);",
    "int specdec_bad(int);",  # a parameter without a name
    "int specdec_bad(int (*callback)(int));",  # a function pointer
    "static int helper(int x);",  # not a specdec_ prototype
    "int specdec_bad(int x)",  # no semicolon: runs into the next statement
])
def test_the_parser_refuses_what_it_cannot_read(prototype):
    with pytest.raises(ValueError):
        binding.prototypes(prototype + "\nint specdec_fine(int x);\n")


@pytest.mark.skipif(binding.library()[2] is not None and not os.environ.get("CI"),
                    reason=f"specdec's kernels do not run here: {binding.library()[2]}")
def test_the_library_exports_every_declared_function():
    library = binding.library()[0]
    for name, (restype, argtypes) in binding.declarations().items():
        function = getattr(library, name)
        assert (function.restype, list(function.argtypes)) == (restype, argtypes), name
