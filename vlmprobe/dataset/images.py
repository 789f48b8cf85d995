"""An image's size from its file's header, without decoding its pixels.

Rule: PIL.Image.open reads the format's header (PNG IHDR, JPEG SOF, ...) and defers the pixel data until load();
`.size` is known after open (Pillow 13.0, PIL/Image.py: `_im` stays None until load). Sizes are (height, width) as
stored: EXIF orientation is not applied (transformers' load_image applies it, LLaMA-Factory's loader does not, so
a rotated JPEG's sides may be swapped in one trainer and not another: a known limit). Paths are resolved as
LLaMA-Factory resolves its media (src/llamafactory/data/converter.py, _find_medias): joined to the media folder
where that file exists, else taken as given.
"""

from __future__ import annotations

import io
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from vlmprobe.errors import ConfigError

__all__ = ["image_size", "resolve_media"]


def resolve_media(reference: str, folder: Path | None) -> Path:
    """The file a dataset's image path names: `folder`/path where that file exists, else the path as given."""
    path = Path(reference)
    if folder is not None and not path.is_absolute() and (folder / path).is_file():
        return folder / path
    return path


def image_size(reference, folder: Path | None, where: str) -> tuple[int, int]:
    """(height, width) of one image: a path (str), a {"path", "bytes"} record as `datasets` stores its Image
    feature, or raw bytes. `where` names the sample in the one-line refusal of a missing or unreadable file."""
    if isinstance(reference, dict):
        if reference.get("bytes"):
            reference = bytes(reference["bytes"])
        elif reference.get("path"):
            reference = reference["path"]
        else:
            raise ConfigError(f"{where}: image {reference!r} is not allowed: give a path or bytes")
    if isinstance(reference, (bytes, bytearray)):
        source, named = io.BytesIO(reference), f"the image bytes of {where}"
    elif isinstance(reference, str) and reference:
        source = resolve_media(reference, folder)
        named = f"image {reference!r} of {where}"
        if not source.is_file():
            looked = f" (looked in {folder} and as given)" if folder is not None else ""
            raise ConfigError(f"{named} is not allowed: no such file{looked}")
    else:
        raise ConfigError(f"{where}: image {reference!r} is not allowed: give a path, bytes or a {{path, bytes}} record")
    try:
        with Image.open(source) as image:
            width, height = image.size
    except (UnidentifiedImageError, OSError) as exc:
        raise ConfigError(f"{named} is not allowed: it cannot be read as an image ({exc})") from None
    return height, width
