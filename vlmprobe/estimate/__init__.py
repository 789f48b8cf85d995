"""Everything that makes an estimate: predict the CUDA peak of a point without a GPU by running the real step
on fake tensors.

Modules:
- tracked.py: the cpu and estimate backends (session: autocast policy, SDPA choice, fake mode, tracker)
- tracker.py: live tensor storages charged through the allocator model
- gradient_sums.py: the autograd engine's in-place sum of two gradients of one tensor, as on CUDA
- kernel_copies.py: the contiguous copies CUDA kernels make of their inputs inside an op
- embedding_backward.py: the index and partial-sum buffers of CUDA's embedding backward when it sorts the ids
- reduction_staging.py: the staging buffer CUDA's reduction kernel makes where one reduction spans several blocks
- allocator.py: the CUDA caching allocator model (blocks, segments, reserved, allocator settings, OOM)
- alloc_conf.py: measure.alloc_conf (PYTORCH_ALLOC_CONF syntax) read by torch's parser rules
- snapshot_replay.py: a recorded CUDA snapshot replayed through the allocator model (scripts/check_allocator.py)
- autocast_policy.py: CUDA's autocast op lists applied on CPU
- sdpa_choice.py: the SDPA kernel CUDA would pick, and what it keeps for backward
- attention_scratch.py: what CUDA's fused attention kernels allocate for themselves (cuDNN's seed, offset and
  workspaces; flash's backward accumulators)
- flash_attn_standin.py: model.attn_implementation=flash_attention_2: flash-attn 2's entry points, allocating
  what its CUDA code allocates, behind transformers' own flash path
- device_profile.py: the target GPU (conf/device/): capacity, dtypes, kernels, workspaces, context
- fake_patches.py: where libraries read data of fake tensors, the answer a real run gets
- fast_fake.py: FakeTensorMode made cheaper per op (views answered directly, a cheaper cache key), same answers;
  one such mode a process, entered by every session (session_mode)
- step_replay.py: a plain point's steps after the first: forward and backward replayed from the first step's
  logged allocations into the allocator model, where that log accounts for every block; its optimizer steps
  replayed from an earlier point's of this process with the same parameters, gradients and optimizer settings;
  the same figures
- block_replay.py: within a point's first step, a tower's middle blocks replayed from its first block's forward
  and its last block's backward, where the family says its blocks run one program (nanoVLM's); the same figures
- built_models.py: a point's built model (knobs applied) kept for later points of the process with the same model
  and train config, its build's logged allocations replayed into each one's allocator model and the model put
  back as built; the same figures

Modelling decisions (each one is what CUDA would do, applied on fake CPU tensors):
- Fake CPU tensors under FakeTensorMode: fake CUDA tensors abort a CPU-only build, so shapes, dtypes and
  aliasing come from torch's own meta kernels on 'cpu'; the result is reported as the estimate for CUDA.
- Allocation accounting: every new storage an op returns is allocated from a model of the CUDA caching
  allocator until it dies (vlmprobe.estimate.tracker, vlmprobe.estimate.allocator: 512-byte blocks,
  segments, best fit, splitting, the measure.alloc_conf settings, release and retry before an OOM); the
  model, batch, saved activations, gradients, optimizer state and every transient are counted alike, and
  the rows' allocated, reserved and active figures are that model's.
- Optimizer: the implementation CUDA picks by default (foreach for AdamW), see step.make_optimizer.
- Autocast: CUDA's op lists (vlmprobe.estimate.cuda_rules.autocast_policy) instead of the CPU's, so each activation has the
  dtype it has on CUDA; an emulated op casts its tensors in the order torch's C++ wrappers do (last first).
- Attention: torch's CPU SDPA kernel is a flash kernel that keeps output + logsumexp for backward, as
  CUDA's flash and memory-efficient kernels do (O(seq) state); where CUDA would fall back to the math
  kernel (e.g. fp32 with grouped KV heads), the math kernel runs here too (vlmprobe.estimate.cuda_rules.sdpa_choice).
  Around that kernel, what CUDA's own kernel allocates for itself (vlmprobe.estimate.cuda_rules.attention_scratch): where the
  card runs cuDNN attention first (sm90), its seed, offset and forward and backward workspaces (the workspace sizes
  are a recorded H200 run's); where flash runs, its backward's softmax_d and fp32 dq_accum (torch's source).
  flash_attention_2 runs transformers' flash path with flash-attn 2's tensors (vlmprobe.estimate.cuda_rules.flash_attn_standin).
- Masks: the models pass no attention mask for unpadded batches, so transformers materialises none (it
  would for fake tensors, taking them for tracing).
- cuBLAS workspaces: with a target card (device=), each thread's first matrix multiply (the forward's, the
  backward's) allocates the card's workspace from the allocator model, kept to the end, as torch does on CUDA
  (vlmprobe.estimate.tracker.LiveBytesTracker); without a card, none (its size depends on the architecture).
- Gradient sums: where the backward sums two gradients of one tensor (residuals, tied weights), the engine of a
  real run adds the second into the first in place when it holds the last reference; under a dispatch mode it never
  does, so the tracker charges the sum into the first's block itself (vlmprobe.estimate.cuda_rules.gradient_sums).
- Kernel copies: the contiguous copies of non-contiguous inputs that CUDA's layer norm (forward and backward),
  cuDNN's convolution backward, a whole tensor's max() / min() and advanced indexing with index tensors of
  different strides make while they run (vlmprobe.estimate.cuda_rules.kernel_copies).
- Embedding backward: above 3072 token ids CUDA's embedding backward sorts them and sums each id's rows through
  index and fp32 partial-sum buffers sized from the shapes (vlmprobe.estimate.cuda_rules.embedding_backward).
- Reduction staging: with a target card, the buffer and semaphores CUDA's sum and mean kernels allocate where they
  split each output's inputs across thread blocks (bias and norm-weight gradients over many tokens), from the
  kernel's own launch rules and the card's multiprocessors (vlmprobe.estimate.cuda_rules.reduction_staging).
- Garbage collection: Python's cyclic collector is off during a point (vlmprobe.backends.estimate), so a tensor
  held only by a reference cycle lives to the point's end: the step in which no collection falls, the higher
  case (the cpu backend likewise); with it on, the figures moved with how many Python objects happened to be
  made before a step. The exception is the build's garbage, collected once before training
  (vlmprobe.point.measure.measure): a real run makes enough objects between load and first step for a collection
  to have run (a tied LM head's first weight under zero.Init is the case met).

Not modelled (the error budget against a CUDA measurement): the CUDA context and NVML-only memory, the cuBLAS
workspaces of a point with no target card, what the allocator model leaves out (several streams, private pools,
cudaMallocAsync: see vlmprobe.estimate.allocator; its block rounding is exact for the estimate's own allocation
sequence, not for CUDA's), and the workspaces kernels make for themselves: cuDNN's convolution workspaces and cub's
temporary storage (the embedding backward's sort), which with torch 2.11's cuBLASLt workspace are what recorded H200
runs made beyond the estimate (tests/test_estimate_vs_cuda.py, KERNEL_SCRATCH), and memory-efficient attention's
backward workspace. Per sample, the estimate charges exactly the saved-tensor families
that scripts/check_per_sample.py counts by hand (tests/test_per_sample.py, to the byte); on nanoVLM issue #103
the published run held ~10 MiB (length 128) and ~44 MiB (512) a sample beyond them, which no saved tensor in
PyTorch's CUDA kernels we read accounts for, and which an H100 run of the same step does not hold either (README,
"The bytes per sample"). With a target card (device=), its profile adds the CUDA context to the allocator model's peak
reserved as predicted_device_bytes (vlmprobe.gpu.device_profile), and its capacity, dtypes, SDPA kernels and
cuBLAS workspaces apply.
"""
