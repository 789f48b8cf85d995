"""Model families: each module builds one real VLM architecture with random weights and
knows its own inputs (image tokens, synthetic batch, loss). Configs in conf/model/ name the
family class as `_target_` with every hyperparameter written out."""

from vlmprobe.models.base import DataShape, ModelSpec

__all__ = ["DataShape", "ModelSpec"]
