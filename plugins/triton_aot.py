"""Ahead-of-time compilation of every Triton kernel specialization the registry's models use, for CUDA
targets, on a machine without a GPU: ``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))``
runs the whole pipeline down to the cubin (ptxas ships with Triton). Each cubin's resource usage comes
from ``cuobjdump --dump-resource-usage`` (Triton's ``backends/nvidia/bin``): registers, shared memory,
and the stack frame, which in Triton code only spilled registers occupy. A spill or a failed compile is
what tests/kernels/test_triton_aot.py fails on; build_scripts/triton_aot_report.py writes the table.

It does not replace running on a GPU; it catches what can be caught without one.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from itertools import product

import triton

TARGETS = (80, 90, 100)  # A100, H100, B200 (Triton 3.9's NVIDIA backend compiles all three)
Q_DTYPE = "*fp16"  # activations on CUDA (the q/k/v the runtime hands the kernels)


@dataclass(frozen=True)
class Spec:
    """One kernel specialization: which jit function, its argument types, constexprs and launch warps."""

    kernel: str  # "module:function"
    label: str
    signature: dict[str, str] = field(hash=False)
    constexprs: dict[str, object] = field(hash=False)
    num_warps: int = 4
    num_stages: int = 3  # Triton's launch default
    per_target: dict[int, tuple[int, int]] = field(default_factory=dict, hash=False)  # cc -> (warps, stages)
    target_constexprs: dict[int, dict[str, object]] = field(default_factory=dict, hash=False)  # cc -> overrides

    def launch(self, cc: int) -> tuple[int, int]:
        """Warps and stages the runtime launches this specialization with on ``sm_<cc>``."""
        return self.per_target.get(cc, (self.num_warps, self.num_stages))

    def constants(self, cc: int) -> dict[str, object]:
        """The constexprs on ``sm_<cc>`` (a target's tiling may take more slots a loop step)."""
        return {**self.constexprs, **self.target_constexprs.get(cc, {})}


@dataclass(frozen=True)
class Usage:
    label: str
    cc: int
    registers: int
    shared: int
    stack: int
    local: int
    error: str = ""

    @property
    def spills(self) -> bool:
        return self.stack > 0 or self.local > 0


def model_geometries(archs) -> list[tuple[int, int]]:
    """(G query heads per KV head, head_dim) of the model architectures ``archs`` (the registry's, from the
    caller: plugins know no model), one per distinct (next power of two of G, head_dim): the kernels pad G to
    a power of two, so the largest G of each padded size stands for the others (same tiles, same registers)."""
    best: dict[tuple[int, int], int] = {}
    for a in archs:
        G, D = a.num_attention_heads // a.num_key_value_heads, a.head_dim
        key = (triton.next_power_of_2(G), D)
        best[key] = max(best.get(key, 0), G)
    return sorted(((G, D) for (_, D), G in best.items()), key=lambda t: (t[1], t[0]))


def _sig(fn, types: dict[str, str]) -> dict[str, str]:
    return {n: types.get(n, "constexpr") for n in fn.arg_names}


# ThinKV's preset page-format sets (R4E4T2, R4aE4aT2a, R4oE4oT2o, R8E4T2), attended in one launch a layer
FORMAT_SETS = (("nvfp4", "ternary"), ("int4", "int2"), ("nvfp4o", "ternaryo"), ("fp8", "nvfp4", "ternary"))


def attention_specs(geometries: list[tuple[int, int]], B: int = 8, P: int = 64, opt_in: bool = False) -> list[Spec]:
    """Each format x geometry x with/without logits at the default precision, and ThinKV's format sets
    (``FORMAT_SETS``) in one launch at the real models' head sizes (D >= 64); ``opt_in`` adds the other
    precisions' single-format variants (in the report, not in the spill test, docs/kernels.md)."""
    from plugins.formats import FORMATS
    from plugins.paged_attention.triton_kernel import PRECISIONS, MAX_FORMATS, _paged_attn_kernel, packed_rows, tiling

    sets = [(name,) for name in FORMATS] + [s for s in FORMAT_SETS]
    precisions = PRECISIONS if opt_in else PRECISIONS[:1]
    specs = []
    for G, D in geometries:
        for names, precision, logits in product(sets, precisions, (False, True)):
            if (len(names) > 1 and (D < 64 or precision != PRECISIONS[0])) or (names == ("fp32",) and
                                                                                 precision != PRECISIONS[0]):
                continue
            fmts = [FORMATS[n] for n in names]
            cfgs = {cc: tiling(B, G, D, P, fmts[0].code, cc, precision, not logits, len(fmts))
                    for cc in TARGETS}
            types = dict(q_ptr=Q_DTYPE, out_ptr="*fp32", lse_ptr="*fp32", logits_ptr="*fp32", part_out="*fp32",
                         part_lse="*fp32", count_ptr="*i32", sm_scale="fp32", S="i32", LC="i32")
            for i, x in enumerate("abc"):
                fmt = fmts[i] if i < len(fmts) else fmts[0]
                slot = [_ptr(f.dtype) for f in fmt.slot_fields(1, D)]
                group = [_ptr(f.dtype) for f in fmt.group_fields(1, D)]
                f = slot + [slot[0]] * (4 - len(slot))
                g = group + [slot[0]] * (2 - len(group))
                types.update({f"{x}_f{j}": f[j] for j in range(4)} | {f"{x}_g{j}": g[j] for j in range(2)})
                types.update({f"{x}_kgrp": "*i32", f"{x}_bits": "*i32", f"{x}_bt": "*i32", f"{x}_P": "i32",
                              f"{x}_pps": "i32", f"{x}_qk": "fp32", f"{x}_sk": "fp32", f"{x}_ov": "fp32",
                              f"{x}_S": "i32", f"{x}_col": "i32"})
            codes = [f.code for f in fmts] + [fmts[0].code] * (MAX_FORMATS - len(fmts))
            const = dict(NF=len(fmts), FMT_A=codes[0], FMT_B=codes[1], FMT_C=codes[2], H=8, G=G, D=D, B=B,
                         GP=triton.next_power_of_2(G), DP=triton.next_power_of_2(D), PAGES=cfgs[90].pages,
                         RETURN_LOGITS=logits, PRECISION=cfgs[90].precision, PACKED=packed_rows(D), BF16_AS_F32=False)
            label = f"paged_attention {'+'.join(names)} G={G} D={D}{' logits' if logits else ''}"
            label += "" if precision == PRECISIONS[0] else f" {precision}"
            per_target = {cc: (c.warps, c.stages) for cc, c in cfgs.items()}
            pages = {cc: {"PAGES": c.pages} for cc, c in cfgs.items() if c.pages != cfgs[90].pages}
            specs.append(Spec("plugins.paged_attention.triton_kernel:_paged_attn_kernel", label,
                              _sig(_paged_attn_kernel, types), const, cfgs[90].warps, cfgs[90].stages, per_target,
                              pages))
    return specs


def kv_write_specs(head_dims: list[int], B: int = 8) -> list[Spec]:
    from plugins.formats import FORMATS
    from plugins.kv_write import triton_kernel as kw

    specs = []
    for D in head_dims:
        DP = triton.next_power_of_2(D)
        for name, fmt in FORMATS.items():
            slot = [_ptr(f.dtype) for f in fmt.slot_fields(1, D)]
            group = [_ptr(f.dtype) for f in fmt.group_fields(1, D)]
            io = dict(k_ptr=Q_DTYPE, v_ptr=Q_DTYPE, pages_ptr="*i32", slots_ptr="*i32")
            mod = "plugins.kv_write.triton_kernel:"
            if fmt.code <= 2:
                ty = "*i16" if fmt.code == 2 else slot[0]
                specs.append(Spec(mod + "_write_float_kernel", f"kv_write {name} D={D}",
                                  _sig(kw._write_float_kernel, dict(io, fk=ty, fv=ty)),
                                  dict(H=8, D=D, B=B, DP=DP, BF16=fmt.code == 2)))
            elif fmt.code == 3:
                specs.append(Spec(mod + "_write_fp8_kernel", f"kv_write {name} D={D}",
                                  _sig(kw._write_fp8_kernel, dict(io, fk="*u8", fv="*u8", gk="fp32", gv="fp32")),
                                  dict(H=8, D=D, B=B, DP=DP)))
            else:
                bits, is_int, qmax, tern, key_offset = kw._GROUPED[fmt.code]
                f = slot + [slot[2]] * (4 - len(slot))
                g = group + [group[0]] * (2 - len(group))
                types = dict(io, fk=f[0], fv=f[1], fvs=f[2], fvz=f[3], g0=g[0], g1=g[1], kgrp_ptr="*i32", n="i32",
                             gids_ptr="*i64", gk="fp32", gv="fp32")
                const = dict(H=8, D=D, B=B, NP=fmt.group_size, BLOCK_D=kw._block_d(D), BITS=bits, INT=is_int,
                             QMAX=qmax, TERN=tern, KEY_OFFSET=key_offset)
                specs.append(Spec(mod + "_write_group_kernel", f"kv_write {name} D={D}",
                                  _sig(kw._write_group_kernel, types), const))
    return specs


def kmeans_specs() -> list[Spec]:
    from plugins.kmeans_select.triton_kernel import _assign_kernel

    types = dict(x_ptr="*fp32", c_ptr="*fp32", k_ptr="*i32", a_ptr="*i32", M="i32", F="i32", KMAX="i32")
    return [Spec("plugins.kmeans_select.triton_kernel:_assign_kernel", "kmeans_assign (largest tiles)",
                 _sig(_assign_kernel, types), dict(BLOCK_M=16, BLOCK_K=16, BLOCK_F=64))]


def all_specs(archs, opt_in: bool = False) -> list[Spec]:
    """Every specialization to compile for the model architectures ``archs``."""
    geos = model_geometries(archs)
    return attention_specs(geos, opt_in=opt_in) + kv_write_specs(sorted({d for _, d in geos})) + kmeans_specs()


def _ptr(dtype) -> str:
    import torch

    return {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.uint8: "*u8",
            torch.int32: "*i32"}[dtype]


def _cuobjdump() -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


_RES = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")


def compile_one(spec: Spec, cc: int) -> Usage:
    """Compile one specialization for ``sm_<cc>`` and read its resource usage from the cubin."""
    import importlib

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    mod, name = spec.kernel.split(":")
    fn = getattr(importlib.import_module(mod), name)
    try:
        warps, stages = spec.launch(cc)
        ck = triton.compile(ASTSource(fn, spec.signature, spec.constants(cc)), target=GPUTarget("cuda", cc, 32),
                            options={"num_warps": warps, "num_stages": stages})
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(ck.asm["cubin"])
            f.flush()
            dump = subprocess.run([_cuobjdump(), "--dump-resource-usage", f.name], capture_output=True, text=True,
                                  check=True).stdout
        m = _RES.search(dump)
        if m is None:
            return Usage(spec.label, cc, 0, 0, 0, 0, f"no resource line in cuobjdump output: {dump[:200]!r}")
        reg, stack, shared, local = map(int, m.groups())
        return Usage(spec.label, cc, reg, shared, stack, local)
    except Exception as e:  # noqa: BLE001 - a failed compile is a result to report, not a crash
        return Usage(spec.label, cc, 0, 0, 0, 0, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}")


def _job(args):
    return compile_one(*args)


def _use_cache(cache_dir: str | None) -> None:
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated to silence its warning
    if cache_dir is not None:
        os.environ["TRITON_CACHE_DIR"] = cache_dir


def compile_all(specs: list[Spec], targets=TARGETS, workers: int | None = None,
                cache_dir: str | None = None) -> list[Usage]:
    """Every (spec, target), in parallel processes (each compile is single-threaded). ``cache_dir`` points
    Triton's compile cache elsewhere (a fresh directory: nothing reused from an earlier run)."""
    jobs = [(s, cc) for s in specs for cc in targets]
    workers = workers or max(1, min(len(jobs), os.cpu_count() or 1))
    if workers == 1:
        saved = os.environ.get("TRITON_CACHE_DIR")
        _use_cache(cache_dir)
        try:
            return [_job(j) for j in jobs]
        finally:
            if cache_dir is not None and saved is None:
                os.environ.pop("TRITON_CACHE_DIR", None)
            elif cache_dir is not None:
                os.environ["TRITON_CACHE_DIR"] = saved
    with ProcessPoolExecutor(workers, initializer=_use_cache, initargs=(cache_dir,)) as ex:
        return list(ex.map(_job, jobs))


def report_markdown(usages: list[Usage]) -> str:
    """One row per specialization, registers/shared/stack per target."""
    targets = sorted({u.cc for u in usages})
    by = {(u.label, u.cc): u for u in usages}
    labels = list(dict.fromkeys(u.label for u in usages))
    head = "| kernel | " + " | ".join(f"sm_{cc} regs / smem B / spill B" for cc in targets) + " |"
    lines = [head, "|---|" + "---|" * len(targets)]
    for lab in labels:
        cells = []
        for cc in targets:
            u = by[(lab, cc)]
            cells.append(f"FAILED: {u.error}" if u.error else f"{u.registers} / {u.shared} / {u.stack + u.local}")
        lines.append(f"| {lab} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
