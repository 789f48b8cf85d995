"""Everything that makes an estimate: predict the CUDA peak of a point without a GPU by running the real step
on fake tensors.

At the top: tracker.py (live tensor storages charged through the allocator model), allocator.py (the model of CUDA's
caching allocator), fast_fake.py (FakeTensorMode made cheaper per op, same answers) and fake_patches.py (where
libraries read data of fake tensors, the answer a real run gets). cuda_rules/ holds what CUDA does that the CPU would
not; replay/ the replays that give the same figures faster. What the estimate models, what it leaves out, and how
its figures were found: docs/estimate.md.
"""
