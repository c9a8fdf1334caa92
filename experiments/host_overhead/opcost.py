"""The host's cost of torch's custom-op machinery, apart from any kernel (CPU only).

``decay_attention`` is the custom op ``decay_tuner::decay_attention`` with its autograd rule
registered by ``torch.library.register_autograd``, and its backward is a second custom op.
Here two toy ops of the same signatures return empty tensors at once, so what is timed is
torch's dispatch: the forward without autograd, the forward plus backward through
``register_autograd``, the same two ops under a plain ``torch.autograd.Function``, and that
Function calling the ops' implementations without their dispatch.

    python3 experiments/host_overhead/opcost.py   # prints JSON: microseconds per call
"""

import json
import time

import torch


@torch.library.custom_op("toy::forward", mutates_args=())
def forward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor | None,
    alpha: float,
    scale: float,
    h0: torch.Tensor | None,
    final: bool,
    cu: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(v), torch.empty(0)


@torch.library.custom_op("toy::backward", mutates_args=())
def backward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    decay: torch.Tensor | None,
    alpha: float,
    scale: float,
    h0: torch.Tensor | None,
    dht: torch.Tensor | None,
    cu: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty(0)


def setup(ctx, inputs, output):
    q, k, v, decay, alpha, scale, *_ = inputs
    ctx.save_for_backward(q, k, v, decay)
    ctx.alpha, ctx.scale = alpha, scale


def gradients(ctx, do, dfinal):
    q, k, v, decay = ctx.saved_tensors
    dq, dk, dv, _ = backward_op(q, k, v, do, decay, ctx.alpha, ctx.scale, None, None, None)
    return dq, dk, dv, None, None, None, None, None, None


torch.library.register_autograd("toy::forward", gradients, setup_context=setup)


class Plain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, decay, alpha, scale, h0, final, cu):
        setup(ctx, (q, k, v, decay, alpha, scale), None)
        return forward_op(q, k, v, decay, alpha, scale, h0, final, cu)

    @staticmethod
    def backward(ctx, do, dfinal):
        return gradients(ctx, do, dfinal)


class Direct(torch.autograd.Function):
    """The ops' Python implementations called directly: what ``decay_attention`` runs
    eagerly (``kernel.attention._Eager``)."""

    @staticmethod
    def forward(ctx, q, k, v, decay, alpha, scale, h0, final, cu):
        setup(ctx, (q, k, v, decay, alpha, scale), None)
        return forward_op._init_fn(q, k, v, decay, alpha, scale, h0, final, cu)

    @staticmethod
    def backward(ctx, do, dfinal):
        q, k, v, decay = ctx.saved_tensors
        dq, dk, dv, _ = backward_op._init_fn(q, k, v, do, decay, ctx.alpha, ctx.scale, None, None, None)
        return dq, dk, dv, None, None, None, None, None, None


def per_call_us(fn, calls: int = 2000) -> float:
    for _ in range(100):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    q, k, v = (torch.randn(2, 8, 2, 4, requires_grad=True) for _ in range(3))
    decay, do = torch.ones(2), torch.randn(2, 8, 2, 4)
    args = (decay, 1.0, 0.5, None, False, None)

    def no_grad():
        with torch.no_grad():
            return forward_op(q, k, v, *args)

    def custom_op():
        return torch.autograd.grad(forward_op(q, k, v, *args)[0], (q, k, v), do)

    def function():
        return torch.autograd.grad(Plain.apply(q, k, v, *args)[0], (q, k, v), do)

    cases = {"forward, no autograd": no_grad, "forward + backward, register_autograd": custom_op}
    cases["forward + backward, autograd.Function"] = function
    cases["forward + backward, autograd.Function, the implementations called directly"] = lambda: (
        torch.autograd.grad(Direct.apply(q, k, v, *args)[0], (q, k, v), do)
    )
    print(json.dumps({name: [round(per_call_us(fn), 1) for _ in range(3)] for name, fn in cases.items()}))


if __name__ == "__main__":
    main()
