"""CUDA's autocast cast policy, applied on the CPU, so a CPU step saves what a GPU step saves.

The planner predicts GPU memory, but the harness runs on the CPU, and the two
autocast backends disagree: CUDA runs layer_norm, pow, softmax, exp, rsqrt,
sum and a few dozen others in fp32 (and so saves fp32 inputs or outputs for
backward), while CPU autocast leaves them in bf16. With this mode active
those ops get their inputs in fp32, above autograd, exactly where CUDA's
autocast dispatch key casts them. Matmuls, SDPA and everything else keep
CPU autocast's behaviour, which for them is CUDA's.

The op lists are CUDA's, from PyTorch's aten/src/ATen/autocast_mode.h
(AT_FORALL_FP32 and AT_FORALL_FP32_SET_OPT_DTYPE), by Python-level name.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

# Ops CUDA autocast always runs in fp32.
_FP32 = frozenset(
    {
        "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
        "sinh", "tan", "pow", "__pow__", "__rpow__", "float_power", "softplus", "layer_norm", "native_layer_norm",
        "group_norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss",
        "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
        "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
        "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    }
)  # fmt: skip
# Ops CUDA autocast runs in fp32 unless the caller gave an explicit dtype.
_FP32_UNLESS_DTYPE = frozenset({"prod", "softmax", "log_softmax", "cumprod", "cumsum", "sum"})
_LOWER = (torch.bfloat16, torch.float16)


class CudaAutocastOnCpu(TorchFunctionMode):
    """While CPU autocast is on, run CUDA's fp32-policy ops in fp32."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        upcast = name in _FP32 or (name in _FP32_UNLESS_DTYPE and kwargs.get("dtype") is None)
        if upcast and torch.is_autocast_enabled("cpu"):
            args, kwargs = tree_map(_to_fp32, (args, kwargs))
        return func(*args, **kwargs)


def _to_fp32(x: Any) -> Any:
    return x.float() if isinstance(x, torch.Tensor) and x.dtype in _LOWER else x


class CudaDropoutOnCpu(TorchFunctionMode):
    """Dropout as CUDA runs it: one fused kernel that keeps a bool mask for backward.

    On the CPU, aten's dropout multiplies by a noise tensor of the input's dtype and keeps that
    (4 bytes an element in fp32, where CUDA's native_dropout keeps 1). native_dropout has a CPU
    kernel too; routing dropout to it makes a CPU step save what a GPU step saves.
    """

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "dropout" and func is torch.nn.functional.dropout:
            x = args[0] if args else kwargs["input"]
            p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
            training = args[2] if len(args) > 2 else kwargs.get("training", True)
            inplace = args[3] if len(args) > 3 else kwargs.get("inplace", False)
            if training and 0 < p < 1 and not inplace and isinstance(x, torch.Tensor):
                return torch.native_dropout(x, p, True)[0]
        return func(*args, **kwargs)
