"""How the paged attention kernel brings its K and V tiles, read from its sm_90 PTX: no GPU
needed (Triton compiles for a target it is given).

    PYTHONPATH=$PWD python3 scripts/paged_kernel_ptx.py --blocks 16x4,15x3 --bf16

Compiles `paged_decode._split_kernel` at shape:qwen3.5-27b's attention shape (4 KV heads,
group 6, head dim 256, 16-token blocks, a 32-token step's tile as paged_decode.split_tile
picks it for each cache) for an fp8
cache (blocks of value planes then scales, kv_fp8.PackedBlocks) and with --bf16 for a
bfloat16 cache, and counts the global-to-shared asynchronous copies by size.
A value row is 16-byte aligned when a block's bytes are a multiple of 16: with
`--blocks 15x3` (15-token blocks of 3 KV heads: 11,700 bytes) they are only 4-byte
aligned and Triton copies the tiles 4 bytes at a time, as it did for the token-major rows
(256 values and their scale in one 260-byte row: 79 four-byte copies) this layout replaced.

    PYTHONPATH=$PWD python3 scripts/paged_kernel_ptx.py --sass

assembles the kernel for an fp8 cache (dots in float16, the kernel's own, and in bfloat16) and
for a bf16 cache with the ptxas that Triton ships, and prints registers, spilled bytes and
the instruction mix of the main loop (per thread, one tile of keys): the static cost that
the GPU's timing (scripts/gpu_paged_rows.py) then confirms or not.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvshare.engine import kv_fp8, paged_decode

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
HEAD_DIM = 256
GROUP = 6

COPY = re.compile(r"cp\.async\.c[ag]\.shared\.global(?:\.L2::\w+)? \[[^\]]*\], \[[^\]]*\], (\w+)")


def step_tile(fp8: bool) -> paged_decode.SplitTile:
    """The kernel's own tile for a 32-token step of bfloat16 queries at this shape."""
    return paged_decode.split_tile(GROUP, 32, HEAD_DIM, fp8, query_bytes=2)


def kernel_ptx(fp8: bool, block_size: int = 16, kv_heads: int = 4, fp8_dot_f16: bool = True) -> str:
    """The kernel's PTX for sm_90 (head dim 256, group 6, a 32-token step's own tile); an
    fp8 cache's dots in float16 (the kernel's own) or in the query's bfloat16."""
    tile = step_tile(fp8)
    kv_type = "*u8" if fp8 else "*bf16"
    signature = {name: kind or kv_type for name, kind in ARGS}
    value_bytes, block_bytes = kv_fp8.plane_bytes(block_size, kv_heads, HEAD_DIM) if fp8 else (0, 0)
    constants = {
        "GROUP": GROUP,
        "ROWS": tile.rows,
        "HEAD_DIM": HEAD_DIM,
        "NUM_KV_HEADS": kv_heads,
        "BLOCK_SIZE": block_size,
        "TILE": tile.keys,
        "VARLEN": True,
        "BLOCK_BYTES": block_bytes,
        "VALUE_BYTES": value_bytes,
        "KV_FP8": fp8,
        "FP8_F16": fp8_dot_f16,
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
    compiled = triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": tile.warps}
    )
    return compiled.asm["ptx"]


LOOP_OPS = ("HGMMA", "LDGSTS", "LDS", "LDSM", "STS", "F2FP", "PRMT", "BAR", "STL", "LDL")
SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)([^;]*);")


def nvidia_tool(name: str) -> Path:
    """A CUDA tool that Triton ships (ptxas, cuobjdump)."""
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name


def assemble(ptx: str, cubin: Path) -> str:
    """ptxas -v of `ptx` into `cubin` with Triton's own ptxas; a PTX version newer than it
    takes is lowered to the one it names (the kernel uses nothing newer)."""
    ptxas = nvidia_tool("ptxas")
    for _ in range(2):
        source = cubin.with_suffix(".ptx")
        source.write_text(ptx)
        cmd = [str(ptxas), "-v", "--gpu-name", "sm_90a", str(source), "-o", str(cubin)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        newest = re.search(
            r"Unsupported \.version [\d.]+; current version is '([\d.]+)'", done.stderr
        )
        if done.returncode == 0 or newest is None:
            break
        ptx = re.sub(r"^\.version [\d.]+", f".version {newest.group(1)}", ptx, flags=re.M)
    if done.returncode:
        raise RuntimeError(done.stderr[-1000:])
    return done.stderr + done.stdout


def loop_mix(cubin: Path) -> tuple[int, Counter]:
    """Instructions of the kernel's longest backward branch's body (the key loop), by opcode."""
    sass = subprocess.run(
        [str(nvidia_tool("cuobjdump")), "-sass", str(cubin)], capture_output=True, text=True
    )
    code = [(int(a, 16), op, rest) for a, op, rest in SASS_LINE.findall(sass.stdout)]
    loops = [
        (int(target.group(1), 16), at)
        for at, op, rest in code
        if op == "BRA" and (target := re.search(r"0x([0-9a-f]+)", rest))
        if int(target.group(1), 16) < at
    ]
    start, end = max(loops, key=lambda loop: loop[1] - loop[0])
    body = [op for at, op, _ in code if start <= at <= end]
    return len(body), Counter(body)


def sass_table() -> None:
    print(f"{'cache, dots':16} {'regs':>4} {'spill B':>7} {'loop':>5}  " + " ".join(LOOP_OPS))
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        for fp8, dots in [(False, "bfloat16"), (True, "float16"), (True, "bfloat16")]:
            log = assemble(kernel_ptx(fp8, fp8_dot_f16=dots == "float16"), cubin)
            regs = int(re.search(r"Used (\d+) registers", log).group(1))
            spilled = int(re.search(r"(\d+) bytes spill stores", log).group(1))
            total, ops = loop_mix(cubin)
            label = f"fp8, {dots}" if fp8 else "bf16"
            print(
                f"{label:16} {regs:4d} {spilled:7d} {total:5d}  "
                + " ".join(f"{ops[op]:{len(op)}d}" for op in LOOP_OPS)
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--blocks", default="16x4", help="fp8 caches: BLOCK_SIZExKV_HEADS,... (head dim 256)"
    )
    parser.add_argument("--bf16", action="store_true", help="also a bfloat16 cache (16x4)")
    parser.add_argument(
        "--sass",
        action="store_true",
        help="registers, spills and key-loop mix, bf16 and fp8 caches",
    )
    args = parser.parse_args()
    if args.sass:
        sass_table()
        return 0
    cases = []
    for blocks in args.blocks.split(","):
        block_size, kv_heads = (int(n) for n in blocks.split("x"))
        cases.append((f"fp8, {blocks} blocks", True, block_size, kv_heads))
    if args.bf16:
        cases.append(("bf16, 16x4 blocks", False, 16, 4))
    # A thread's static count includes the pipeline's prologue: bytes a key of the tile
    # (count x size x threads / keys) compare caches whose tiles differ.
    print("cache                 async copies by bytes (static count in the PTX), per key")
    for label, fp8, block_size, kv_heads in cases:
        ptx = kernel_ptx(fp8, block_size, kv_heads)
        tile = step_tile(fp8)
        sizes = Counter(int(n, 0) for n in COPY.findall(ptx))
        per_key = sizes[16] * 16 * 32 * tile.warps // tile.keys
        print(
            f"{label:21} "
            + ", ".join(f"{n} x {b} B" for b, n in sorted(sizes.items()))
            + f"; {per_key} B a key in 16-byte copies"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
