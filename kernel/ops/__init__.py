"""What a model and a deployment call: ``decay_attention`` (with its backward), the
dispatch table, the best-config file, and the rule that picks the config serving a call.
It builds on ``kernel``, which never imports it."""

from kernel.ops.attention import decay_attention
from kernel.ops.decode import decay_decode
from kernel.ops.deploy import ExportError, load_config, load_kernel
from kernel.ops.dispatch import Dispatch, load_dispatch
from kernel.ops.serve import use_table

__all__ = [
    "Dispatch",
    "ExportError",
    "decay_attention",
    "decay_decode",
    "load_config",
    "load_dispatch",
    "load_kernel",
    "use_table",
]
