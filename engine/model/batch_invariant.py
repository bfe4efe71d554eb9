"""Half-precision steps that compute a session's rows the same whatever else shares the step, so a
session's tokens do not depend on its batch (and a moved session continues as it would have)."""

from __future__ import annotations

import torch

NARROW_FP16 = 32  # inner widths at or below which a float16 CPU product goes row by row (linear)


def batch_invariant(dtype: torch.dtype) -> bool:
    """Whether a session's rows are computed the same whatever else shares the step (half precision,
    where one rounding flips tokens; float32 keeps the faster batched paths). Then attention runs per
    session over exactly its context (the batched decode pads every context to the step's longest,
    and another padding rounds a row differently), and `linear` never multiplies a lone row."""
    return dtype in (torch.bfloat16, torch.float16)


def pack_cpu_weight(w: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked copy of a float32 CPU weight for `linear`'s `packed` (None where it does not
    apply): MKL multiplies few rows by a wide weight (qkv_proj: 16 x 512 @ 512 x 4096) at a fraction of
    the memory bandwidth on this 2-core AMD EPYC, oneDNN's kernel over its own layout does not
    (1.27 ms against 1.73 for w @ x.T, 2.7 for x @ w.T). A second copy of the weight: only for the widest."""
    if w.dtype != torch.float32 or w.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:  # private ops: a torch release without them serves through the plain path
        return torch.ops.mkldnn._reorder_linear_weight(w.detach(), 16)  # 16: the decode batch it is tuned for
    except (AttributeError, RuntimeError):
        return None


def linear(x: torch.Tensor, w: torch.Tensor, packed: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (`packed`: w's `pack_cpu_weight`). A CPU GEMM of one row takes another kernel than of two or more (which agree with each
    other row for row) and accumulates in another order, so in half precision a lone row goes in twice."""
    if x.shape[0] == 1 and batch_invariant(x.dtype):
        return (x.expand(2, -1).contiguous() @ w.T)[:1]
    if x.dtype == torch.float16 and x.device.type == "cpu" and w.shape[1] <= NARROW_FP16:
        # the CPU's float16 GEMM rounds a row by the row count when the inner width is this narrow (the tiny
        # models' 32-wide expert down projection: row 0 of 2..8 rows differed in 30 of 350 draws): row by row
        return torch.cat([linear(x[i : i + 1], w) for i in range(x.shape[0])])
    if packed is not None and x.dtype == torch.float32:
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    if 1 < x.shape[0] <= 128 and x.dtype == torch.float32 and x.device.type == "cpu":
        # a decode step's few rows: MKL's sgemm of x @ w.T on this AMD CPU runs at a fraction of the
        # memory bandwidth, its transpose w @ x.T does not (builtin:bench, 16 rows: qkv 1.7 ms against
        # 2.7, o_proj 0.64 against 0.95); the copy back to row-major is tiny next to the weight
        return (w @ x.T).T.contiguous()
    return x @ w.T
