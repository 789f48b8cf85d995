"""cpu: the estimate's program on real CPU tensors. Its peaks are tracker counts: a check of the fake
bookkeeping and a way for CI to run the whole path, never presented as GPU figures."""

from vlmprobe.estimate.tracked import TrackedBackend

BACKEND = TrackedBackend("cpu", fake=False)
