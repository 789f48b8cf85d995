"""Everything that makes an estimate: predict the CUDA peak of a point without a GPU by running the real step
on fake tensors.

Modules:
- tracked.py: the cpu and estimate backends (session: autocast policy, SDPA choice, fake mode, tracker)
- tracker.py: live tensor storages charged through the allocator model
- allocator.py: the CUDA caching allocator model (blocks, segments, reserved, OOM)
- autocast_policy.py: CUDA's autocast op lists applied on CPU
- sdpa_choice.py: the SDPA kernel CUDA would pick, and what it keeps for backward
- device_profile.py: the target GPU (conf/device/): capacity, dtypes, kernels, workspaces, context
- fake_patches.py: where libraries read data of fake tensors, the answer a real run gets

Modelling decisions (each one is what CUDA would do, applied on fake CPU tensors):
- Fake CPU tensors under FakeTensorMode: fake CUDA tensors abort a CPU-only build, so shapes, dtypes and
  aliasing come from torch's own meta kernels on 'cpu'; the result is reported as the estimate for CUDA.
- Allocation accounting: every new storage an op returns is charged its size rounded up to 512 bytes (the
  CUDA caching allocator's block size) until it dies (vlmprobe.estimate.tracker); the model, batch, saved
  activations, gradients, optimizer state and every transient are counted alike.
- Optimizer: the implementation CUDA picks by default (foreach for AdamW), see step.make_optimizer.
- Autocast: CUDA's op lists (vlmprobe.estimate.autocast_policy) instead of the CPU's, so each activation has the
  dtype it has on CUDA.
- Attention: torch's CPU SDPA kernel is a flash kernel that keeps output + logsumexp for backward, as
  CUDA's flash and memory-efficient kernels do (O(seq) state); where CUDA would fall back to the math
  kernel (e.g. fp32 with grouped KV heads), the math kernel runs here too (vlmprobe.estimate.sdpa_choice).
- Masks: the models pass no attention mask for unpadded batches, so transformers materialises none (it
  would for fake tensors, taking them for tracing).

Not modelled (the error budget against a CUDA measurement): the CUDA context and NVML-only memory, cuBLAS /
cuBLASLt workspaces, the caching allocator's block splitting and fragmentation (reserved - allocated; an
allocated block can exceed the request when a cached block is reused unsplit), and kernel-internal
workspaces that differ between CUDA and CPU kernels. With a target card (device=), its profile adds the
cuBLAS workspaces and the CUDA context to the allocator model's peak reserved as predicted_device_bytes
(vlmprobe.estimate.device_profile), and its capacity, dtypes and SDPA kernels apply.
"""
