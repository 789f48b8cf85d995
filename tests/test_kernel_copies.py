"""Contiguous copies CUDA kernels make of their inputs inside an op (vlmprobe.estimate.cuda_rules.kernel_copies), charged by the
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


def test_the_max_of_positions_expanded_over_the_batch_copies_them_after_its_output():
    positions = torch.arange(512).unsqueeze(0).expand(8, -1)  # nanoVLM's rotary positions: one row, 8 views of it
    with LiveBytesTracker() as t:
        longest = positions.max()
        # the 0-dim int64 output (a 512 B block), then the contiguous copy (8 x 512 x 8 B), freed as max returns
        assert (t.peak, t.current) == (512 + 8 * 512 * 8, 512)
        positions.contiguous().max()  # a contiguous input: only the copy made here and the output
        assert t.peak == 512 + 8 * 512 * 8 + 512
    assert longest.item() == 511


def test_the_copy_max_makes_comes_after_its_output_and_a_layer_norms_before():
    from vlmprobe.estimate.cuda_rules import kernel_copies

    expanded = torch.zeros(1, 512).expand(8, -1)
    assert kernel_copies.copies(torch.ops.aten.max.default, (expanded,)) == ([], [8 * 512 * 4])
    transposed = torch.zeros(WIDTH, ROWS).t()
    assert kernel_copies.copies(torch.ops.aten.native_layer_norm.default,
                                (transposed, [WIDTH], None, None, 1e-5)) == ([8192], [])


def _image_indices(batch: int, count: int):
    """nanoVLM's with_images indices: every sample's row, expanded over its `count` image columns, and the columns."""
    rows = torch.arange(batch).unsqueeze(1).expand(-1, count)
    columns = torch.zeros(batch, 1, dtype=torch.long) + torch.arange(count).unsqueeze(0)
    return rows, columns


def test_two_index_tensors_of_different_strides_are_each_made_contiguous_around_the_indexing():
    from vlmprobe.estimate.cuda_rules import kernel_copies

    rows, columns = _image_indices(8, 49)
    copy = 8 * 49 * 8  # the expanded rows in int64: 3,136 B, what the H200 trace holds at batch 8
    aten = torch.ops.aten
    assert kernel_copies.copies(aten.index_put_.default, (None, [rows, columns], None)) == ([copy], [])
    assert kernel_copies.copies(aten.index.Tensor, (None, [rows, columns])) == ([copy], [])  # before its output
    assert kernel_copies.copies(aten.index_put.default, (None, [rows, columns], None)) == ([], [copy])  # after it
    # strides that match (two contiguous indices), one index, or a boolean mask: nothing copied here
    assert kernel_copies.copies(aten.index.Tensor, (None, [columns, columns])) == ([], [])
    assert kernel_copies.copies(aten.index.Tensor, (None, [rows])) == ([], [])
    assert kernel_copies.copies(aten.index.Tensor, (None, [rows > 0, columns])) == ([], [])
    # an index broadcast by the indexing itself (a (8, 1) column against (1, 49)): both are copied to (8, 49)
    assert kernel_copies.copies(aten.index.Tensor, (None, [rows[:, :1], columns[:1]])) == ([copy, copy], [])


def test_the_image_write_and_its_backward_hold_the_rows_copy_while_they_run():
    rows, columns = _image_indices(2, 3)
    image = torch.randn(2, 3, 4)
    with LiveBytesTracker() as t:
        embeds = torch.zeros(2, 16, 4)
        before = t.current
        embeds[rows, columns] = image
        # during index_put_ only the rows' contiguous copy (2 x 3 int64, a 512 B block), gone after it
        assert (t.peak - before, t.current - before) == (512, 0)
