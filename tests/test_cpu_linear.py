import pytest
import torch

from specchat.core.cpu_linear import FEW_ROWS, FewRowLinear, use_few_row_linear


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 2, 3, FEW_ROWS, FEW_ROWS + 1, 40])
def test_every_row_count_computes_what_nn_linear_does(rows, bias):
    torch.manual_seed(rows)
    reference = torch.nn.Linear(96, 80, bias=bias)
    few = FewRowLinear(96, 80, bias=bias)
    few.load_state_dict(reference.state_dict())
    x = torch.randn(1, rows, 96)  # [batch, tokens, features], as a decoder layer passes it
    out = few(x)
    assert out.shape == (1, rows, 80)
    torch.testing.assert_close(out, reference(x), rtol=1e-5, atol=1e-5)


def test_only_plain_fp32_cpu_linears_are_switched():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4).to(torch.float64), torch.nn.ReLU())
    assert use_few_row_linear(model) == 1
    assert type(model[0]) is FewRowLinear and type(model[1]) is torch.nn.Linear
