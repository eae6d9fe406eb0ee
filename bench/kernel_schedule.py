"""How the Triton kernels compile for a GPU, on any machine: registers, spills, shared memory, software pipeline.

    python -m bench.kernel_schedule [--arch 90] [--head-dim 64] [--all-configs] [--check]

Triton compiles for a CUDA target without a GPU (its wheel ships ptxas), so this reads what the compiler made of
each kernel, SWA (rows in order) and SA (rows gathered through pi) side by side, for the pinned config or every
autotune config (`--all-configs`). Per loop it reports the tiles in flight: how many tiles' async copies the loop
leaves outstanding while it computes the current one (the `num` of the `ttg.async_wait` at the top of the loop
divided by the async-copy groups it commits per step). 0 means each step waits for the loads it just issued and
pays their whole latency; flash-attention style loops keep >= 1. It also counts the SASS instructions of each
loop's step, a proxy for issue time when the loads are hidden. `--check` exits 1 when an SA loop keeps fewer tiles
in flight than the same SWA loop, when SA's steps over a band (w=256, 64-slot tiles) take over 1.6x SWA's
instructions, or when a kernel spills registers (tests/test_bench.py runs it). None of it is speed:
bench/attention.py on a GPU measures that.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass

KERNELS = {"fwd": "_fwd_kernel", "dq": "_dq_kernel", "dkdv": "_dkdv_kernel"}
FP32_POINTERS = ("LSE", "DELTA")
# SA's extra work per step: pi's causal compare on every tile, the mask's pi tile, the gathers' row addresses.
# 1.2-1.5x with Triton 3.7 and 1.3-1.55x with 3.6 at the 64 x 64 configs; the SA steps of 7d8a8b0, which loaded
# the mask's pi carried in the MMA layout, take 1.68x (fwd) and 1.82x (dq) the current SWA's.
MAX_SA_INSTRUCTIONS = 1.6


@dataclass
class Loop:
    groups: int = 0  # async-copy commit groups issued per step (what ttg.async_wait counts)
    wait_num: int = -1  # commit groups the first wait of a step leaves outstanding
    sync_loads: int = 0  # plain (blocking) loads per step
    innermost: bool = True

    @property
    def tiles_in_flight(self) -> float:
        return max(self.wait_num, 0) / self.groups if self.groups else 0.0


@dataclass
class Compiled:
    registers: int
    spill_bytes: int
    shared_bytes: int
    loops: list[Loop]
    step_instructions: list[int]  # SASS instructions in each innermost loop's body, in program order

    def per_band(self, block_m: int, block_n: int) -> int | None:
        """SASS instructions of the steps one 64-slot tile takes over a w=256 band of 64-slot tiles: five steps,
        split as one edge tile on each side and three interior ones (None for other tile shapes)."""
        s = self.step_instructions
        if (block_m, block_n) != (64, 64) or len(s) not in (1, 3):
            return None
        return s[0] + 3 * s[1] + s[2] if len(s) == 3 else 5 * s[0]


def tile_loops(ttgir: str) -> list[Loop]:
    """The innermost scf.for loops of a TTGIR module (the tile loops), in program order, pipelined or not."""
    done, open_loops, depth = [], [], 0
    for line in ttgir.splitlines():
        s = line.strip()
        if "scf.for" in s:
            if open_loops:
                open_loops[-1][0].innermost = False
            open_loops.append((Loop(), depth))
        elif open_loops:
            loop = open_loops[-1][0]
            if "ttg.async_wait" in s and loop.wait_num < 0:
                loop.wait_num = int(re.search(r"num = (\d+)", s).group(1))
            elif "ttg.async_commit_group" in s:
                loop.groups += 1
            elif re.search(r"= tt\.load ", s):
                loop.sync_loads += 1
        depth += s.count("{") - s.count("}")  # attribute dicts open and close on one line; regions do not
        while open_loops and depth <= open_loops[-1][1]:
            loop = open_loops.pop()[0]
            if loop.innermost:
                done.append(loop)
    return done


def sass_loop_sizes(sass: str) -> list[int]:
    """Instruction count of each innermost loop in a cuobjdump -sass listing (loop: a branch to an earlier address)."""
    addrs = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            addrs.append((int(m.group(1), 16), m.group(2)))
    index = {a: i for i, (a, _) in enumerate(addrs)}
    loops = []
    for i, (a, text) in enumerate(addrs):
        m = re.search(r"BRA 0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) in index:
            loops.append((index[int(m.group(1), 16)], i))
    inner = [(lo, hi) for lo, hi in loops if not any(lo <= a and b <= hi and (a, b) != (lo, hi) for a, b in loops)]
    return [hi - lo + 1 for lo, hi in sorted(inner)]


def _signature(jit, constexprs: dict, dtype: str):
    """Argument types of a launch with contiguous [B, H, n, D] rows and n a multiple of 16 (what the JIT's
    specialisation sees at the benchmark's shapes): 16-divisible pointers, strides and n; pi in int32, as the
    model's sampler draws it."""
    sig, attrs = {}, {}
    for i, name in enumerate(jit.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        if name.isupper():
            sig[name] = "*i32" if name == "PERM" else "*fp32" if name in FP32_POINTERS else f"*{dtype}"
        else:
            sig[name] = "fp32" if "scale" in name else "i32"
        if name.isupper() or name == "n" or (name.startswith("s") and name != "spb"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def compile_kernel(kernel: str, block_m: int, block_n: int, num_warps: int, num_stages: int, has_perm: bool,
                   split: bool, head_dim: int = 64, arch: int = 90, dtype: str = "bf16",
                   specialized: dict | None = None) -> Compiled:
    """Compile one kernel for sm_`arch`; `specialized` fixes arguments as constants, as Triton's JIT does with an
    integer argument equal to 1 (e.g. a row stride of 1 at head dim 1)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import kernels.triton_band as tb

    jit = getattr(tb, KERNELS[kernel])
    constexprs = dict(GROUP=1, HEAD_DIM=head_dim, BLOCK_D=tb._pow2(max(16, head_dim)), BLOCK_M=block_m,
                      BLOCK_N=block_n, HAS_PERM=has_perm, UPCAST=False, SPLIT=split)
    constexprs.update(specialized or {})
    constexprs = {k: v for k, v in constexprs.items() if k in jit.arg_names}  # older kernels (A/B) lack some
    sig, attrs = _signature(jit, constexprs, dtype)
    binary = triton.compile(ASTSource(jit, sig, constexprs, attrs), target=GPUTarget("cuda", arch, 32),
                            options=dict(num_warps=num_warps, num_stages=num_stages))
    usage, sass = _cuobjdump(binary.asm["cubin"], "--dump-resource-usage", "-sass")
    return Compiled(int(re.search(r"REG:(\d+)", usage).group(1)), int(re.search(r"LOCAL:(\d+)", usage).group(1)),
                    binary.metadata.shared, tile_loops(binary.asm["ttgir"]), sass_loop_sizes(sass))


def cuobjdump_path() -> str | None:
    """The cuobjdump that Triton's CUDA backend ships (with ptxas), else one on PATH, else None."""
    try:
        import triton
    except ImportError:
        return None
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return tool if os.path.exists(tool) else shutil.which("cuobjdump")  # else a CUDA toolkit's


def _cuobjdump(cubin: bytes, *flags: str) -> list[str]:
    """cuobjdump's output per flag (registers and local memory, i.e. spills; SASS), with the one Triton ships."""
    import tempfile

    tool = cuobjdump_path()
    if tool is None:
        raise RuntimeError("bench.kernel_schedule needs Triton's CUDA backend (ptxas, cuobjdump): pip install triton")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return [subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout
                for flag in flags]


def _configs(kernel: str, all_configs: bool, head_dim: int) -> list[tuple[int, int, int, int]]:
    import kernels.triton_band as tb

    if not all_configs:  # the pinned config (SA_TRITON_AUTOTUNE=0: GPU tests, bench/gpu_session.sh's A/B stage)
        c = tb._fixed_gpu_config(2 * tb._pow2(max(16, head_dim)))
        return [(c["BLOCK_M"], c["BLOCK_N"], c["num_warps"], c["num_stages"])]
    table = {"fwd": tb._FWD_CONFIGS, "dq": tb._DQ_CONFIGS, "dkdv": tb._DKDV_CONFIGS}[kernel]
    return [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in table]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability x 10 (90: H100/H200)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--kernels", nargs="+", choices=list(KERNELS), default=list(KERNELS))
    p.add_argument("--all-configs", action="store_true", help="every autotune config, not only the pinned one")
    p.add_argument("--check", action="store_true", help="exit 1 if an SA loop pipelines less than SWA, or spills")
    args = p.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU target; nothing is launched
    import kernels.triton_band as tb

    split = getattr(tb, "_SPLIT", False)
    problems = []
    import triton

    print(f"Triton {triton.__version__}, sm_{args.arch}, bf16, head dim {args.head_dim}, split={split}; tiles in "
          "flight per loop (copy groups left outstanding / groups per step)")
    print("| kernel | tile (M x N) | warps | stages | variant | registers | spill bytes | shared KiB "
          "| tiles in flight | blocking loads per step | SASS instructions per step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for kernel in args.kernels:
        for bm, bn, warps, stages in _configs(kernel, args.all_configs, args.head_dim):
            swa, sa = (compile_kernel(kernel, bm, bn, warps, stages, has_perm, split, args.head_dim, args.arch)
                       for has_perm in (False, True))
            for name, c in (("SWA", swa), ("SA", sa)):
                flight = " / ".join(f"{loop.tiles_in_flight:g}" for loop in c.loops) or "-"
                loads = " / ".join(str(loop.sync_loads) for loop in c.loops) or "-"
                steps = " / ".join(map(str, c.step_instructions)) or "-"
                band = c.per_band(bm, bn)
                steps += f" ({band} per band)" if band else ""
                print(f"| {kernel} | {bm} x {bn} | {warps} | {stages} | {name} | {c.registers} | {c.spill_bytes} "
                      f"| {c.shared_bytes / 1024:.0f} | {flight} | {loads} | {steps} |")
                if c.spill_bytes:
                    problems.append(f"{kernel} {bm}x{bn} w{warps} s{stages} {name}: spills {c.spill_bytes} bytes")
            depth = lambda c: min((loop.tiles_in_flight for loop in c.loops), default=0.0)  # noqa: E731
            if depth(sa) < depth(swa):
                problems.append(f"{kernel} {bm}x{bn} w{warps} s{stages}: SA keeps {depth(sa):g} tiles in flight, "
                                f"SWA {depth(swa):g}")
            if len(sa.loops) != len(swa.loops) or len(sa.step_instructions) != len(sa.loops):
                problems.append(f"{kernel} {bm}x{bn} w{warps} s{stages}: loops differ (TTGIR SA {len(sa.loops)}, "
                                f"SWA {len(swa.loops)}; SASS SA {len(sa.step_instructions)})")
            sa_band, swa_band = sa.per_band(bm, bn), swa.per_band(bm, bn)
            if (bm, bn) == (64, 64) and not (sa_band and swa_band):
                problems.append(f"{kernel} 64x64 w{warps} s{stages}: unexpected loop structure in the SASS")
            elif sa_band and swa_band and sa_band > MAX_SA_INSTRUCTIONS * swa_band:
                problems.append(f"{kernel} {bm}x{bn} w{warps} s{stages}: SA's steps over a band take {sa_band} "
                                f"instructions, SWA's {swa_band}")
    for line in problems:
        print("problem:", line)
    return 1 if args.check and problems else 0


if __name__ == "__main__":
    sys.exit(main())
