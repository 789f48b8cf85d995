import pytest
import torch

from vlmprobe.estimate.tracker import LiveBytesTracker
from vlmprobe.sizes import segment_bytes_in_message


def test_counts_new_storages_until_they_die_and_keeps_the_peak():
    with LiveBytesTracker() as t:
        a = torch.empty(1000)  # 4000 B -> a 4096 B block
        b = torch.empty(10)  # 40 B -> 512
        assert t.current == 4096 + 512
        del b
        assert t.current == 4096 and t.peak == 4608
        t.reset_peak()
        assert t.peak == 4096
        del a
        assert t.current == 0


def test_views_in_place_ops_and_preexisting_tensors_allocate_nothing():
    existing = torch.zeros(1000)
    with LiveBytesTracker() as t:
        existing.add_(1)
        view = existing.view(10, 100).t()
        view.mul_(2)
        assert t.current == 0
        fresh = existing * 2
        assert t.current == 4096
    assert fresh.shape == existing.shape


def test_autograd_saved_tensors_live_until_backward():
    x = torch.randn(256, requires_grad=True)  # before the tracker: not counted
    with LiveBytesTracker() as t:
        y = x.exp()  # saved for backward: 1024 B
        loss = y.sum()  # 4 B -> 512
        assert t.current == 1024 + 512
        loss.backward()  # x.grad (1024) appears; the graph's saved `y` is still referenced by `y`
        del y, loss
        assert t.current == 1024  # only x.grad is left


def test_capacity_raises_out_of_memory_when_a_new_segment_does_not_fit():
    with LiveBytesTracker(capacity=3 * 2**20) as t:
        keep = torch.empty(1024)  # 4096 B from a new 2 MiB small-pool segment
        with pytest.raises(torch.OutOfMemoryError) as err:
            torch.empty(2**19)  # 2 MiB: a large-pool request needs a new 20 MiB segment, over 3 MiB
        assert t.current == 4096
    assert segment_bytes_in_message(str(err.value)) == 20 * 2**20
    assert keep.numel() == 1024


def test_segment_bytes_in_message_reads_cuda_out_of_memory_messages():
    message = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 23.69 GiB"
    assert segment_bytes_in_message(message) == 2 * 2**30
    assert segment_bytes_in_message("something else") is None


def test_host_storages_are_counted_apart_from_the_device_and_ops_over_them_stay_on_the_host():
    from vlmprobe.distributed.host_memory import placed  # what the offload code paths set (no DeepSpeed needed)

    with LiveBytesTracker() as t:
        device = torch.empty(1000)  # 4000 B -> 4096 on the device
        t.track_host()
        with placed("host"):
            host = torch.empty(1000)  # 4000 B on the host: plain bytes, no block rounding
        assert (t.current, t.host_current) == (4096, 4000) and t.on_host(host) and not t.on_host(device)
        moment = torch.zeros_like(host) * 2  # AdamW's update over an offloaded partition: host, with its temporary
        assert (t.current, t.host_current, t.host_peak) == (4096, 8000, 12000) and t.on_host(moment)
        mixed = host + device  # a device op (CUDA would refuse mixed operands; the device is the default)
        assert (t.current, t.host_current) == (8192, 8000) and not t.on_host(mixed)
        del host, moment
        assert (t.current, t.host_current, t.host_peak) == (8192, 0, 12000)
    assert not LiveBytesTracker().host_tracked  # off unless a point offloads


@pytest.mark.parametrize("name", ["estimate", "cpu"])
def test_a_tensor_held_by_a_reference_cycle_lives_to_the_end_of_the_session_whatever_python_allocates(name):
    # With Python's collector on, the young cycle would go at the next generation-0 collection, which the
    # 100,000 lists below set off many times over: the figures would depend on how much Python happens to
    # allocate in between (it moved a DeepSpeed rank's optimizer peak by 80,384 B)
    from vlmprobe import backends

    with backends.get(name).session(None) as meter:
        cycle = {"tensor": torch.empty(2**20, dtype=torch.uint8)}
        cycle["self"] = cycle
        held = meter.current()
        del cycle
        garbage = [[i] for i in range(100_000)]
        assert meter.current() == held == 2**20 and len(garbage) == 100_000


HOPPER_WORKSPACE = 32 * 2**20  # a segment of its own: it moves no other block, so the figures differ by it exactly


def test_each_thread_makes_one_cublas_workspace_at_its_first_matrix_multiply_and_keeps_it():
    """The forward's first multiply makes one workspace; the backward's first op (the loss's, elementwise) runs
    before the second, which its first multiply makes; later steps make none. Hand count: the same program run
    with and without workspaces differs by 0, 1, then 2 of them at those moments."""
    linear = torch.nn.Linear(64, 64)  # before the tracker: not counted
    x = torch.randn(8, 64)

    def program(t: LiveBytesTracker) -> list[int]:
        linear.zero_grad(set_to_none=True)  # gradients made by this run's tracker
        seen = [t.current]
        y = x.exp()  # elementwise, no cuBLAS
        seen.append(t.current)
        out = linear(y)  # addmm: the forward thread's first multiply
        seen.append(t.current)
        out.register_hook(lambda grad: seen.append(t.current))  # the backward before any multiply of its own
        out.square().sum().backward()  # mm for the weight's gradient: the backward thread's first
        seen.append(t.current)
        linear.zero_grad(set_to_none=True)
        linear(y).sum().backward()  # a second step: no new workspace
        seen.append(t.current)
        return seen

    with LiveBytesTracker() as bare:
        without = program(bare)
    with LiveBytesTracker(blas_workspaces=(HOPPER_WORKSPACE,)) as charged:
        with_workspaces = program(charged)
    extra = [(w - b) // HOPPER_WORKSPACE for w, b in zip(with_workspaces, without)]
    assert [(w - b) % HOPPER_WORKSPACE for w, b in zip(with_workspaces, without)] == [0] * 6
    assert extra == [0, 0, 1, 1, 2, 2]


def test_a_matrix_multiply_on_the_host_makes_no_workspace():
    from vlmprobe.distributed.host_memory import placed

    with LiveBytesTracker(blas_workspaces=(HOPPER_WORKSPACE,)) as t:
        t.track_host()
        with placed("host"):
            a = torch.randn(16, 16)
            product = a @ a  # offloaded work (the CPU optimizer's): no cuBLAS
        assert t.current == 0 and t.on_host(product)
        with placed("device"):
            product = a @ a
        assert t.current == 1024 + HOPPER_WORKSPACE
