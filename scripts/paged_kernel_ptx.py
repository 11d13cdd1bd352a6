"""How the paged attention kernel brings its K and V tiles, read from its sm_90 PTX: no GPU
needed (Triton compiles for a target it is given).

    PYTHONPATH=$PWD python3 scripts/paged_kernel_ptx.py --rows 260,272 --bf16

Compiles `paged_decode._split_kernel` at shape:qwen3.5-27b's attention shape (4 KV heads,
group 6, head dim 256, a 32-token step's 64-row query tile) for an fp8 cache whose packed
rows are each --rows bytes apart (260: the format, 256 e4m3 values and a float32 scale;
272: the same padded to 16 bytes), and with --bf16 for a bfloat16 cache, and counts the
global-to-shared asynchronous copies by size: a row stride that is not a multiple of 16
bytes leaves Triton 4-byte copies only.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvshare.engine import paged_decode

ARGS = (
    ("Q", "*bf16"),
    ("K", None),
    ("V", None),
    ("K_SCALE", "*fp32"),
    ("V_SCALE", "*fp32"),
    ("TABLES", "*i32"),
    ("CTX", "*i32"),
    ("CU_Q", "*i32"),
    ("ACC", "*fp32"),
    ("MAX", "*fp32"),
    ("SUM", "*fp32"),
    ("scale", "fp32"),
    ("window", "i32"),
    ("table_stride", "i32"),
    ("num_splits", "i32"),
    ("q_blocks", "i32"),
)
COPY = re.compile(r"cp\.async\.c[ag]\.shared\.global(?:\.L2::\w+)? \[[^\]]*\], \[[^\]]*\], (\w+)")


def kernel_ptx(row_elements: int, fp8: bool) -> str:
    """The kernel's PTX for sm_90, its cache rows `row_elements` apart."""
    kv_type = "*u8" if fp8 else "*bf16"
    signature = {name: kind or kv_type for name, kind in ARGS}
    constants = {
        "GROUP": 6,
        "ROWS": 64,
        "HEAD_DIM": 256,
        "NUM_KV_HEADS": 4,
        "BLOCK_SIZE": 16,
        "TILE": paged_decode.TILE,
        "VARLEN": True,
        "KV_ROW": row_elements,
        "SCALE_ROW": row_elements // 4 if fp8 else 1,
        "KV_FP8": fp8,
        "FP8_F16": True,
    }
    signature |= dict.fromkeys(constants, "constexpr")
    names = list(signature)
    source = ASTSource(
        paged_decode._split_kernel,
        signature,
        constexprs={(names.index(k),): v for k, v in constants.items()},
        # Pointers 16-byte aligned, as torch allocates them (Triton's own specialization).
        attrs={
            (i,): [["tt.divisibility", 16]]
            for i, (_, kind) in enumerate(ARGS)
            if kind is None or kind.startswith("*")
        },
    )
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    return compiled.asm["ptx"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="260,272", help="fp8 row strides in bytes")
    parser.add_argument("--bf16", action="store_true", help="also a bfloat16 cache (256)")
    args = parser.parse_args()
    cases = [(f"fp8, {r}-byte rows", int(r), True) for r in args.rows.split(",")]
    if args.bf16:
        cases.append(("bf16, 512-byte rows", 256, False))
    print("cache                 async copies by bytes (static count in the PTX)")
    for label, row, fp8 in cases:
        sizes = Counter(int(n, 0) for n in COPY.findall(kernel_ptx(row, fp8)))
        print(f"{label:21} " + ", ".join(f"{n} x {b} B" for b, n in sorted(sizes.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
