"""The one dispatcher: every device-specific op the model calls goes through here.

CUDA tensors take the Triton kernels once they land (issue 5); CPU tensors take the
plain-torch reference twins, which are also the kernels' test oracles.
"""
from __future__ import annotations

from .attention_ref import paged_attention_ref as paged_attention  # noqa: F401
from .reference import rms_norm_ref as rms_norm  # noqa: F401
from .reference import silu_mul_ref as silu_mul  # noqa: F401
from .reference import w4_linear_ref as w4_linear  # noqa: F401
from .reference import write_kv_ref as write_kv  # noqa: F401
