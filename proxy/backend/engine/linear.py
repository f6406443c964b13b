"""`y = x @ weight.T + bias` with the faster CPU kernel for the number of rows.

PyTorch's CPU `F.linear` runs MKL's sgemm. On the AMD EPYC machines this project is
measured on, oneDNN (which PyTorch ships as `torch.ops.mkldnn`) with a weight packed
once in its blocked layout runs the same fp32 product about 2x faster from 8 rows up
(MKL reaches ~90 GFLOP/s on one core there). Measured on the shipped `pycoder` shapes, one
thread, microseconds per call (MKL / packed oneDNN):

    rows    [.,192]x[192,1152]   [.,576]x[576,192]   [.,192]x[192,4096]
      1        12.2 / 20.0          6.2 / 14.3         48.7 / 44.2
      8        49.9 / 28.4         24.2 / 18.1        164.9 / 69.3
     33       155.0 / 70.2         77.0 / 42.7        534.6 / 213.7

A verified tree is 9-33 rows, a prefill hundreds; one decoding step is 1 row, where
MKL is faster. So `Linear` keeps both: MKL for one row, oneDNN from two. Both are fp32
products of the same weights and differ in rounding only -- and where: a row of the
packed oneDNN product has the same bits whatever the number of rows beside it (checked
for 1-40 rows), while MKL's one-row kernel rounds differently from its many-row one.
So the one boundary stays where MKL had it (one row against more): a request whose
trees the adaptive policy sizes differently from run to run (2 rows in one run, 12 in
the next) gets the same logprobs, bit for bit, as before. (A first version switched at
8 rows: the same greedy request, non-streamed then streamed, differed in the seventh
digit of one logprob.) The packed copy costs the
weight's memory once more; it is made only for fp32 weights on the CPU, where oneDNN
is built in. Elsewhere (CUDA, bf16) `Linear` is `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MIN_PACKED_ROWS = 2  # one row: MKL (faster there); more: oneDNN (see above)
_PACK_ROWS_HINT = 32  # oneDNN picks its blocking for this row count (any count works)


def _packs(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
    )


class Linear:
    """weight [out, in], bias [out] or None, both kept as given (shared, not copied)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight
        self.bias = bias
        self._packed = None
        if _packs(weight):
            with torch.inference_mode():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(
                    weight.detach(), _PACK_ROWS_HINT
                )

    @classmethod
    def of(cls, module: torch.nn.Linear) -> "Linear":
        return cls(module.weight, module.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out]."""
        if self._packed is not None and x.numel() >= MIN_PACKED_ROWS * x.shape[-1]:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class PackedLinear(torch.nn.Module):
    """An `nn.Linear`'s own parameters (same names, not copied) run through `Linear`.
    For inference: the packed copy does not follow later changes to the weights."""

    def __init__(self, module: torch.nn.Linear):
        super().__init__()
        self.weight = module.weight
        self.bias = module.bias
        self._linear = Linear.of(module)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x)


def pack_linears(model: torch.nn.Module) -> None:
    """Replace every `nn.Linear` inside `model` by a `PackedLinear` of it, in place."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(parent, name, PackedLinear(child))
