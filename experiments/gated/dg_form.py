"""Which form of the gate's gradient survives fp16 and bf16 (issue 53, item 2), on the CPU.

    python3 experiments/gated/dg_form.py > experiments/gated/dg_form.txt

For one random problem per gate range and dtype (B = 1, S = 2048, H = 4, DK = DV = 64, a
final-state gradient), the relative L2 against the fp64 reference (``refs.gated_backward``)
of the gate's gradient ``dg`` computed three ways:
  fla rounded   fla's form, ``dg_t = sum_{s >= t} q_s . dq_s - k_s . dk_s`` (+ the final
                state's term at the last token), from the reference's dq and dk rounded to
                the dtype (what a backward whose passes write dq and dk in it would have);
  fla fp32      the same form from dq and dk in fp32 (exact but for fp32's rounding);
  ours          ``kernel.ops.gated_backward`` (the four sums of ``refs.gated_backward``).
"""

import torch

import refs
from kernel.ops.gated_backward import gated_backward
from refs.gated_backward import gated_chunked_backward


def main() -> None:
    torch.manual_seed(0)
    b, s, h, d = 1, 2048, 4, 64
    print("gates per token | dtype | fla rounded | fla fp32 | ours | median |dg|")
    for lo, hi in ((-1e-4, -0.1), (-0.1, -2.0), (-1e-4, -20.0)):
        for dtype in (torch.float16, torch.bfloat16):
            q, k, v, do = (torch.randn(b, s, h, d).to(dtype) for _ in range(4))
            g = lo + (hi - lo) * torch.rand(b, s, h)
            dht = torch.randn(b, h, d, d)
            dq, dk, _, dg, _, _ = gated_chunked_backward(q, k, v, g, 64, do, scale=d**-0.5, dht=dht)
            _, final = refs.gated_chunked(q, k, v, g, 64, scale=d**-0.5, output_final_state=True)

            def fla_form(dq_, dk_):
                term = (q.double() * dq_.double()).sum(-1) - (k.double() * dk_.double()).sum(-1)
                term[:, -1] += (final * dht.double()).sum((-1, -2))
                return term.flip(1).cumsum(1).flip(1)

            rounded = fla_form(dq.to(dtype), dk.to(dtype))
            fp32 = fla_form(dq.float(), dk.float())
            ours = gated_backward(
                q, k, v, g, do, scale=d**-0.5, initial_state=None, dht=dht, cu_seqlens=None
            )[3]
            errs = [refs.rel_l2(x.double(), dg) for x in (rounded, fp32, ours)]
            print(
                f"{lo:g} to {hi:g} | {str(dtype)[6:]} | "
                + " | ".join(f"{e:.1e}" for e in errs)
                + f" | {dg.abs().median():.1e}"
            )


if __name__ == "__main__":
    main()
