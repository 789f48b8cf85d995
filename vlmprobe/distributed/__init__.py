"""Sharded multi-GPU training, per rank: the `dist` config group (none, ddp, fsdp2, zero1-3).

| module           | job                                                                              |
|------------------|----------------------------------------------------------------------------------|
| options.py       | validate a `dist` config (and a user's DeepSpeed JSON) before anything runs      |
| engines.py       | the engine interface the measured step drives, and the torch engines (none, ddp, fsdp2) |
| process_group.py | the process group one rank runs in: fake (estimate) or real (gloo / nccl)        |
| launcher.py      | N fresh processes for one point through torchrun, and the side of each rank      |
| ranks.py         | which ranks differ, one rank's simulation per group, rank rows -> the point's row |

A point with dist `none` never reaches this package's process groups or launcher: the single-GPU path is
the worker's as it was.
"""
