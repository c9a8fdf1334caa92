"""ptxas's figures from TileLang's own nvcc run (kernel.probe's ``_compile_logged``) against
those of a ptxas run of the probe's own (``_ptxas``, what the probe ran for every kernel
before): every kernel family, four architectures, a split's three kernels and a kernel that
spills. Run from the repository root, ``PYTHONPATH=.`` and ``TILELANG_CACHE_DIR`` an empty
folder; it prints one line per kernel and the count of those whose figures differ
(``ptxas_figures.txt``)."""

from kernel.arch import target
from kernel.config import Call, KernelConfig, Problem, dkdv_call, model_call
from kernel.decode import DecodeConfig, DecodeProblem, decode_step
from kernel.probe import _compile_logged, _ptxas, parse_ptxas
from kernel.variants import prim_funcs

SMALL = Problem(1, 2, 256, 64, 64)
SUBSET = [KernelConfig(32, 32, 1, 128), KernelConfig(64, 64, 2, 128), KernelConfig(64, 32, 1, 128, "regs")]
FP16 = Problem(2, 4, 300, 128, 128)
DECODE = [
    (DecodeProblem(4, 128, 128), DecodeConfig(32, 128)),
    (DecodeProblem(4, 256, 256), DecodeConfig(64, 256)),
]


def jobs():
    for arch in ("sm_90a", "sm_80", "sm_100a", "sm_120"):
        for c in SUBSET:
            yield (
                f"{arch} {c.label}",
                arch,
                lambda c=c, a=arch: prim_funcs(SMALL, c, model_call(SMALL), arch=a),
            )
    for arch in ("sm_90a", "sm_80"):
        split = KernelConfig(64, 128, 2, 256, segments=4)
        yield (
            f"{arch} split {split.label}",
            arch,
            lambda a=arch: prim_funcs(FP16, split, Call(0.1, True, True), arch=a),
        )
        fused = KernelConfig(64, 128, 1, 256)
        yield (
            f"{arch} dkdv {fused.label}",
            arch,
            lambda a=arch: prim_funcs(FP16, fused, dkdv_call(FP16), arch=a),
        )
        for p, c in DECODE:
            yield f"{arch} decode dk{p.dk} {c}", arch, lambda p=p, c=c: [decode_step(p, c)]


def main() -> None:
    differ = 0
    for name, arch, make in jobs():
        try:
            compiled = _compile_logged(make(), target(arch))
        except Exception as exc:  # TileLang's layout failures: no kernel to compare
            print(f"{name}: does not compile ({type(exc).__name__})")
            continue
        for i, (kernel, log) in enumerate(compiled):
            ok, own = _ptxas(kernel.get_kernel_source(), arch)
            theirs, ours = (parse_ptxas(log) if log else None), (parse_ptxas(own) if ok else None)
            differ += theirs != ours
            print(
                f"{name} kernel {i}: {'same' if theirs == ours else 'DIFFERENT'} {theirs} {ours}", flush=True
            )
    print(f"{differ} kernels differ")


if __name__ == "__main__":
    main()
