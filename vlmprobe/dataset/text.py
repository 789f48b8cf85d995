"""How many tokens a sample's text takes: the model's own tokenizer where there is one on this machine, else a
stated estimate.

Rule: a tokenizer is a `tokenizers.Tokenizer` or a transformers tokenizer object, a tokenizer.json file (or a
folder holding one), or a Hub name whose tokenizer.json is already in the local Hugging Face cache (found with
huggingface_hub's try_to_load_from_cache, 2.5: nothing is downloaded). Each text is encoded without special
tokens and the counts added up. Without one the count is ceil(characters / 4): an assumption (the common rule of
thumb for English text under BPE tokenizers, not a measurement here), named in every sample's `text_from`.
Limits: the chat template's own tokens (role markers, the system prompt a template adds) are not counted either
way; the image placeholders (<image>, <video>) are removed before counting (their tokens are the family's image
tokens, counted apart).
"""

from __future__ import annotations

import math
from pathlib import Path

from tokenizers import Tokenizer

from vlmprobe.errors import ConfigError
from vlmprobe.hub import HUB_NAME
from vlmprobe.models.hf import cached_hub_file

__all__ = ["CHARS_PER_TOKEN", "ESTIMATE", "PLACEHOLDERS", "TextCounter"]

CHARS_PER_TOKEN = 4
ESTIMATE = f"estimate: characters / {CHARS_PER_TOKEN}"
PLACEHOLDERS = ("<image>", "<video>")  # LLaMA-Factory's IMAGE_PLACEHOLDER / VIDEO_PLACEHOLDER, ms-swift's tags


class TextCounter:
    """Counts the tokens of a sample's texts; `source` names how (the tokenizer, or the estimate)."""

    def __init__(self, tokenizer=None, cache_dir: str | Path | None = None):
        self.tokenizer, self.source = None, ESTIMATE
        if tokenizer is None:
            return
        if not isinstance(tokenizer, (str, Path)) and hasattr(tokenizer, "encode"):
            self.tokenizer, self.source = tokenizer, f"tokenizer {type(tokenizer).__name__}"
            return
        if not isinstance(tokenizer, (str, Path)):
            raise ConfigError(f"tokenizer={tokenizer!r} is not allowed: give a tokenizer.json file, a folder holding "
                              f"one, a Hub name in the local cache, or a tokenizer object")
        path = Path(tokenizer)
        if path.is_dir():
            path = path / "tokenizer.json"
        if path.is_file():
            self.tokenizer, self.source = Tokenizer.from_file(str(path)), f"tokenizer {path}"
        elif HUB_NAME.match(str(tokenizer)):
            cached = cached_hub_file(str(tokenizer), "tokenizer.json", cache_dir)
            if cached is not None:
                self.tokenizer, self.source = Tokenizer.from_file(str(cached)), f"tokenizer {tokenizer} (local cache)"
            else:
                self.source = f"{ESTIMATE} ({tokenizer}'s tokenizer.json is not in the local Hugging Face cache)"
        else:
            raise ConfigError(f"tokenizer={str(tokenizer)!r} is not allowed: no tokenizer.json there, and it is not "
                              f"a Hub name (ORG/NAME)")

    def count(self, texts: list[str]) -> int:
        """Tokens of these texts, the image placeholders removed."""
        cleaned = []
        for text in texts:
            for placeholder in PLACEHOLDERS:
                text = text.replace(placeholder, "")
            cleaned.append(text)
        if self.tokenizer is None:
            return math.ceil(sum(len(text) for text in cleaned) / CHARS_PER_TOKEN)
        total = 0
        for text in cleaned:
            encoded = self.tokenizer.encode(text, add_special_tokens=False)
            total += len(getattr(encoded, "ids", encoded))
        return total
