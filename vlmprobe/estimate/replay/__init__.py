"""Replays that keep the estimate fast with the same figures: later steps from the first one's allocation log
(steps.py), a tower's middle blocks from its first and last (blocks.py), a built model kept for later points
(built_models.py), all played back through playback.py; and a recorded CUDA snapshot replayed through the
allocator model (snapshot.py, a check)."""
