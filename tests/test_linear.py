"""`proxy.backend.engine.linear`: the CPU kernel choice behind the engine's and the DFlash drafter's
matmuls. Both kernels must give F.linear's product (to fp32 rounding) on either side
of the row threshold, and packing a module must leave its parameters as they were."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from proxy.backend.engine.linear import MIN_PACKED_ROWS, Linear, PackedLinear, pack_linears

ONEDNN = torch.backends.mkldnn.is_available()


@pytest.mark.parametrize("rows", [1, MIN_PACKED_ROWS, 7, 8, 33, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_equals_f_linear(rows, with_bias):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=generator)
    bias = torch.randn(96, generator=generator) if with_bias else None
    x = torch.randn(rows, 40, generator=generator)
    linear = Linear(weight, bias)
    with torch.inference_mode():
        out = linear(x)
        torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=0, atol=1e-5)
        # a leading batch dimension (the drafter's [1, Q, H]) counts rows the same way
        torch.testing.assert_close(linear(x[None])[0], out, rtol=0, atol=1e-5)


def test_packed_copy_only_for_fp32_cpu_weights():
    # the project's CPU torch ships oneDNN; a build without it runs F.linear throughout
    assert (Linear(torch.randn(8, 8))._packed is not None) == ONEDNN
    assert Linear(torch.randn(8, 8, dtype=torch.bfloat16))._packed is None


def test_pack_linears_keeps_parameters_and_outputs():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.SiLU(), torch.nn.Linear(32, 8, bias=False)
    )
    x = torch.randn(12, 16)
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with torch.inference_mode():
        expected = model(x)
    pack_linears(model)
    assert isinstance(model[0], PackedLinear) and isinstance(model[2], PackedLinear)
    assert list(model.state_dict()) == list(state)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    with torch.inference_mode():
        torch.testing.assert_close(model(x), expected, rtol=0, atol=1e-5)


def test_a_row_has_the_same_bits_whatever_the_rows_beside_it():
    """From MIN_PACKED_ROWS rows up, a tree's row does not depend on the tree's size: the
    adaptive policy may verify 2 nodes in one run and 12 in the next."""
    generator = torch.Generator().manual_seed(1)
    linear = Linear(torch.randn(320, 192, generator=generator))
    x = torch.randn(40, 192, generator=generator)
    with torch.inference_mode():
        first = linear(x[:MIN_PACKED_ROWS])[0]
        for rows in range(MIN_PACKED_ROWS, 41):
            assert torch.equal(linear(x[:rows])[0], first), rows
