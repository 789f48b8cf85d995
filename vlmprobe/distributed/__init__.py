"""Sharded multi-GPU training, per rank: the `dist` config group (none, ddp, fsdp2, zero1-3).

| module              | job                                                                                     |
|---------------------|-----------------------------------------------------------------------------------------|
| base.py             | the engine base: the single-GPU path (dist=none) and what every engine answers          |
| torch_engines.py    | torch's engines: DDP, FSDP2                                                             |
| deepspeed_engine.py | DeepSpeed ZeRO-1/2/3                                                                    |
| engines.py          | the one place that picks a point's engine from its `dist.name`                          |
| host_memory.py      | the host buffers of offloading, told apart where the device is the CPU                  |
| options.py          | validate a `dist` config and a user's DeepSpeed JSON before anything runs               |
| process_group.py    | the process group one rank runs in, fake (estimate) or real (gloo / nccl), and the mesh |
Ranks and torchrun live in vlmprobe/run/ranks.py, vlmprobe/run/torchrun.py and vlmprobe/point/rank.py."""
