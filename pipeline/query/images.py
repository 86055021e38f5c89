"""The query image: an uploaded picture decoded to bounded, upright RGB before it is embedded."""

from __future__ import annotations

import io

import numpy as np
from numpy.typing import NDArray
from PIL import Image, ImageOps, UnidentifiedImageError

from storage.errors import InvalidInput, LimitExceeded

#: Image formats a query may use. Pillow's other plugins stay off: some hand the file to outside
#: programs (EPS runs Ghostscript) and rarely used decoders are where parser bugs live.
QUERY_IMAGE_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP")


def decode_query_image(data: bytes, max_bytes: int, max_pixels: int, max_side: int | None = None) -> NDArray[np.uint8]:
    """Decode a query image to upright RGB (turned by its EXIF orientation, as viewers show it: phone
    photos are stored sideways); its size is checked from the header before any pixel is decoded.
    With ``max_side`` it is scaled down to that longest side (a JPEG is decoded at a reduced size
    already), so what goes to the Encoder is small whatever was sent. CPU-bound: call it on a thread.

    Raises:
        LimitExceeded: over the byte or pixel limit (a small file can declare a huge picture).
        InvalidInput: not an image in one of ``QUERY_IMAGE_FORMATS``.
    """
    if len(data) > max_bytes:
        raise LimitExceeded(f"image exceeds max bytes {max_bytes}")
    try:
        image = Image.open(io.BytesIO(data), formats=QUERY_IMAGE_FORMATS)
        # Image.open reads only the header: the pixel count is known before decoding.
        if image.width * image.height > max_pixels:
            raise LimitExceeded(f"image exceeds max pixels {max_pixels} ({image.width}x{image.height})")
        if max_side is not None:
            image.draft("RGB", (max_side, max_side))  # JPEG: decode at 1/2, 1/4 or 1/8 size
        upright = ImageOps.exif_transpose(image)
        if max_side is not None and max(upright.size) > max_side:
            upright.thumbnail((max_side, max_side), Image.Resampling.BICUBIC)
        rgb = np.asarray(upright.convert("RGB"), dtype=np.uint8)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise LimitExceeded(f"image exceeds max pixels {max_pixels}") from exc
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError) as exc:
        raise InvalidInput(f"not a readable image ({', '.join(QUERY_IMAGE_FORMATS)}): {type(exc).__name__}") from exc
    return rgb
