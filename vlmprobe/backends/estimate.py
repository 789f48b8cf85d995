"""estimate: predict the CUDA peak of a point without a GPU by running the real step on fake tensors.

The machinery, and the list of modelling decisions and of what is not modelled, is in vlmprobe.estimate.
"""

from vlmprobe.estimate.tracked import TrackedBackend

BACKEND = TrackedBackend("estimate", fake=True)
