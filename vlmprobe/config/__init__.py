"""What a point is, validated: Hydra composition with one-line refusals (overrides.py), sweep axes to points
(grid.py), each point composed and validated (plan.py, checks.py) and described in the row's words (describe.py)."""
