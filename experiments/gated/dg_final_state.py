"""The gate's gradient of ``backward_by_passes`` with a final state's gradient, from passes that
round as the kernel does (reference C with ``rounded=``: the state, the masked scores and the
weighted keys in the inputs' dtype), against fp64: its dHT part summed forwards (the op's), and
summed backwards against ``<dHT, HT>`` (its form before 8d94afd), on the CPU.

    python3 experiments/gated/dg_final_state.py > experiments/gated/dg_final_state.txt
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from test_gated_backward import GATES, SHAPES, _case, _reference_pass  # noqa: E402

import refs  # noqa: E402
from kernel.ops.gated_backward import backward_by_passes  # noqa: E402
from refs.gated_backward import gated_chunked_backward  # noqa: E402


def summed_backwards(q, k, v, g, do, h0, dht, cu, scale, dtype) -> torch.Tensor:
    """The earlier form: sum_{s >= t} (q . dq - k . dk) + <dHT, HT>, dk from the state dHT
    enters, HT the rounded forward's."""
    run = _reference_pass(scale, dtype)
    r = v.shape[2] // q.shape[2]
    qh, kh = q.repeat_interleave(r, 2), k.repeat_interleave(r, 2)
    dq, _ = run(do, v, kh, g, h0.transpose(-1, -2).contiguous(), False, cu, False, True)
    dk, _ = run(v, do, qh, g, (dht / scale).transpose(-1, -2).contiguous(), False, cu, True, True)
    _, final = run(q, k, v, g, h0, True, cu, False, True)
    step = ((qh.float() * dq).sum(-1) - (kh.float() * dk).sum(-1)).double()
    after = step.flip(1).cumsum(1).flip(1)
    ends = (dht.double() * final.double()).sum((-1, -2))  # [N, H]
    if cu is None:
        return after + ends[:, None]
    seq = torch.searchsorted(cu[1:], torch.arange(q.shape[1]), right=True)
    return after - torch.nn.functional.pad(after, (0, 0, 0, 1))[:, cu[1:][seq]] + ends[seq][None]


def main() -> None:
    print("dtype | shape | gates per token | summed forwards (the op's) | summed backwards (before)")
    for dtype in (torch.float16, torch.bfloat16):
        for shape in (SHAPES[0], SHAPES[3]):
            for gate in GATES:
                q, k, v, g, do, h0, dht, cu = _case(*shape, gate, dtype, seed=sum(shape[:6]) + 5)
                scale = q.shape[-1] ** -0.5
                want = gated_chunked_backward(
                    q, k, v, g, 64, do, scale=scale, initial_state=h0, dht=dht, cu_seqlens=cu
                )[3]
                ours = backward_by_passes(
                    _reference_pass(scale, dtype), q, k, v, g, do, scale=scale, initial_state=h0, dht=dht,
                    cu_seqlens=cu,
                )[3]  # fmt: skip
                before = summed_backwards(q, k, v, g, do, h0, dht, cu, scale, dtype)
                errs = (refs.rel_l2(x.double(), want) for x in (ours, before))
                print(f"{str(dtype)[6:]} | {shape} | {gate} | " + " | ".join(f"{e:.2e}" for e in errs))


if __name__ == "__main__":
    main()
