"""Error metrics shared by the reference and kernel tests."""

import torch
from torch import Tensor


def rel_l2(out: Tensor, ref: Tensor) -> float:
    """``||out - ref|| / ||ref||`` over all elements, in float64 on ref's device.

    NaN anywhere in ``out`` gives NaN (an inf gives inf or NaN), so a check written as
    ``not rel_l2(...) <= tol`` also fails on non-finite output.
    """
    if out.shape != ref.shape:
        raise ValueError(f"out: expected shape {tuple(ref.shape)} (as ref), got {tuple(out.shape)}")
    ref = ref.to(torch.float64)
    out = out.to(device=ref.device, dtype=torch.float64)
    return (torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref)).item()
