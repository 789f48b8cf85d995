"""Contiguous copies CUDA kernels make of their inputs inside an op (vlmprobe.estimate.kernel_copies), charged by the
tracker for the op's duration, against hand counts."""

import torch

from vlmprobe.estimate.tracker import LiveBytesTracker

ROWS, WIDTH = 32, 64  # a layer norm over 64 features of 32 rows: 8192 B of fp32


def test_a_layer_norm_of_a_transposed_input_holds_a_copy_of_it_while_it_runs():
    x = torch.randn(WIDTH, ROWS).t()  # made before the tracker; its rows are not contiguous
    with LiveBytesTracker() as t:
        y = torch.nn.functional.layer_norm(x, (WIDTH,))
        # during the op: the copy (8192 B), Y (8192 B), the row mean and rstd (128 B each, a 512 B block each);
        # after it only Y (nothing needs the statistics without autograd)
        assert t.peak == 8192 + 8192 + 2 * 512
        assert t.current == 8192
    assert y.is_contiguous()


def test_a_layer_norm_of_a_contiguous_input_copies_nothing():
    x = torch.randn(ROWS, WIDTH)
    with LiveBytesTracker() as t:
        y = torch.nn.functional.layer_norm(x, (WIDTH,))
        assert (t.peak, t.current) == (8192 + 2 * 512, 8192)
    assert y.shape == x.shape


def test_its_backward_copies_the_transposed_input_again():
    x = torch.randn(WIDTH, ROWS, requires_grad=True)
    with LiveBytesTracker() as t:
        y = torch.nn.functional.layer_norm(x.t(), (WIDTH,))
        before = t.current  # Y, mean, rstd
        t.reset_peak()
        y.backward(torch.ones_like(y))  # the ones (8192 B) stay alive to the end of backward
        # ones, dX (8192 B, then x.grad as a transposed view: no copy); during the op the input's copy (8192 B)
        assert t.peak == before + 8192 + 8192 + 8192
        assert x.grad.shape == x.shape
