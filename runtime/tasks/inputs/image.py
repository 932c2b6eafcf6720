"""Images in, pixel tensors out: the Hugging Face image processor's steps in numpy and Pillow.

The steps and their order are those of transformers' (slow, PIL-based) image processors such as
``ViTImageProcessor`` and ``CLIPImageProcessor``: convert to RGB, resize, centre-crop, rescale,
normalise, channels first (``ConvNextImageProcessor``, ResNet's too: its ``crop_pct`` below 384
pixels, a square from 384 up). ``convert`` compares them with the source's own processor and ships
the config only where they agree. They read the ``preprocessor_config.json`` shipped in the artifact,
so the runtime needs neither torch nor transformers; the outputs match transformers' to 1e-5.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from slimml.errors import ArtifactError, FeedError, TooLargeError
from slimml.runtime.artifact.files import read_config

PREPROCESSOR_FILE = "preprocessor_config.json"
_RESAMPLE_NAMES = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}


def _pillow():
    try:
        from PIL import Image
    except ImportError:
        raise FeedError("reading images needs Pillow: pip install 'slimml[vision]' (or pip install pillow).") from None
    return Image


class ImageProcessor:
    """Turns images (paths, PIL images or HxWxC uint8 arrays) into a float32 (N, C, H, W) batch."""

    def __init__(self, config: dict[str, Any], where: str = PREPROCESSOR_FILE):
        self.where = where
        self.do_convert_rgb = config.get("do_convert_rgb", True) is not False
        self.do_resize = bool(config.get("do_resize", True))
        self.do_center_crop = bool(config.get("do_center_crop", False))
        kind = str(config.get("image_processor_type") or config.get("feature_extractor_type") or "")
        convnext = kind.startswith("ConvNext")  # ConvNeXt's and ResNet's (ConvNextFeatureExtractor in older configs)
        # an int size is a square, except before a centre crop (CLIP's old configs) or ConvNeXt's: the shortest edge
        self.size = (_size(config.get("size"), where, square=not (self.do_center_crop or convnext))
                     if self.do_resize else None)
        self.resample = int(config.get("resample", 2))
        if self.resample not in _RESAMPLE_NAMES:
            raise ArtifactError(f"{where}: resample {self.resample} is not a Pillow filter (0-5); fix it and convert again.")
        crop = _size(config.get("crop_size"), where) if self.do_center_crop else None
        if crop is not None and "shortest_edge" in crop:
            crop = {"height": crop["shortest_edge"], "width": crop["shortest_edge"]}
        self.crop_size = crop
        if convnext and self.size and "shortest_edge" in self.size:  # crop_pct, and a square from 384 up
            edge = int(self.size["shortest_edge"])
            if edge < 384:  # the shortest edge to edge / crop_pct, then the centre edge x edge
                self.size = {"shortest_edge": int(edge / float(config.get("crop_pct") or 224 / 256))}
                self.crop_size = {"height": edge, "width": edge}
            else:  # warped to a square, not cropped
                self.size = {"height": edge, "width": edge}
        self.do_rescale = bool(config.get("do_rescale", True))
        self.rescale_factor = float(config.get("rescale_factor", 1 / 255))
        self.do_normalize = bool(config.get("do_normalize", True))
        self.mean = config.get("image_mean", [0.5, 0.5, 0.5])
        self.std = config.get("image_std", [0.5, 0.5, 0.5])

    @classmethod
    def from_file(cls, path: Path) -> ImageProcessor:
        return cls(read_config(path, "image preprocessor config"), path.name)

    @property
    def output_size(self) -> tuple[int, int] | None:
        """(height, width) of every processed image, when the config fixes it."""
        box = self.crop_size or (self.size if self.size and "height" in self.size else None)
        return (int(box["height"]), int(box["width"])) if box else None

    def __call__(self, images) -> np.ndarray:
        if isinstance(images, (str, os.PathLike, np.ndarray)) or hasattr(images, "getbands"):
            images = [images]
        if not isinstance(images, (list, tuple)) or not images:
            raise FeedError("give images as a list of file paths, PIL images or HxWx3 uint8 arrays (at least one).")
        arrays = [self.one(read_image(im, i)) for i, im in enumerate(images)]
        shapes = {a.shape for a in arrays}
        if len(shapes) > 1:
            raise FeedError(
                f"the processed images have different sizes {sorted(shapes)}: the preprocessor config resizes "
                "without a crop to a fixed size; resize the images to one size first."
            )
        return np.stack(arrays)

    def one(self, image) -> np.ndarray:
        """One PIL image -> float32 (C, H, W)."""
        if self.do_convert_rgb and image.mode != "RGB":
            image = image.convert("RGB")
        if self.do_resize:
            height, width = self._resize_to(image.height, image.width)
            image = image.resize((width, height), resample=self.resample)
        array = np.asarray(image)
        if array.ndim == 2:
            array = array[:, :, None]
        array = array.transpose(2, 0, 1)  # channels first, as transformers crops
        if self.crop_size is not None:
            array = _center_crop(array, int(self.crop_size["height"]), int(self.crop_size["width"]))
        if self.do_rescale:
            array = (array.astype(np.float64) * self.rescale_factor).astype(np.float32)
        elif not np.issubdtype(array.dtype, np.floating):
            array = array.astype(np.float32)
        if self.do_normalize:
            channels = array.shape[0]
            mean = np.array(_per_channel(self.mean, channels, "image_mean", self.where), dtype=array.dtype)
            std = np.array(_per_channel(self.std, channels, "image_std", self.where), dtype=array.dtype)
            array = (array - mean[:, None, None]) / std[:, None, None]
        return np.ascontiguousarray(array, dtype=np.float32)

    def _resize_to(self, height: int, width: int) -> tuple[int, int]:
        size = self.size
        if "height" in size:
            return int(size["height"]), int(size["width"])
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = int(size["shortest_edge"]), int(int(size["shortest_edge"]) * long / short)
        limit = size.get("longest_edge")
        if limit is not None and new_long > limit:
            new_short, new_long = int(limit * new_short / new_long), int(limit)
        if new_short * new_long > MAX_RESIZED_PIXELS:  # a 1x1000 strip at a shortest edge of 224: 224x224,000
            raise FeedError(f"an image of {width}x{height} pixels (width x height) would be resized to {new_short}x{new_long} (its shortest "
                            f"edge to {new_short}); crop it nearer to square first.")
        return (new_long, new_short) if width <= height else (new_short, new_long)


MAX_RESIZED_PIXELS = 1 << 24  # 4096x4096: above any model's input, far below a strip's resize


def read_image(image, index: int = 0):
    """A path, PIL image or uint8 array as a loaded PIL image; anything else (an image of no pixels
    too) is one clear FeedError."""
    im = _read_image(image, index)
    if not im.width or not im.height:  # a blank input was made of it, and classified
        raise FeedError(f"image {index} is {im.width}x{im.height} pixels; give an image with pixels.")
    return im


UPLOAD_FORMATS = ("JPEG", "PNG", "BMP", "GIF", "WEBP")  # what bytes from elsewhere may be; not EPS (Ghostscript), TIFF...


def open_image_bytes(data: bytes, index: int = 0, max_pixels: int = MAX_RESIZED_PIXELS):
    """An image file's bytes (an upload) opened, its header read but no pixel decoded: a JPEG, PNG,
    BMP, GIF or WebP of at most ``max_pixels`` pixels (a small compressed file can declare a huge
    image), else one FeedError (TooLargeError for too many pixels). Decode it with :func:`decode_image`."""
    import io

    Image = _pillow()
    try:
        im = Image.open(io.BytesIO(data), formats=list(UPLOAD_FORMATS))
    except Image.DecompressionBombError as e:  # past twice Pillow's own limit: refused by Pillow at open
        found = re.search(r"\((\d+) pixels\)", str(e))
        raise _too_big(index, f"{int(found.group(1)):,} pixels" if found else "more pixels than Pillow opens",
                       max_pixels) from None
    except Exception as e:  # PIL.UnidentifiedImageError (its text shows the buffer's address), a cut header
        reason = "not one of these formats" if type(e).__name__ == "UnidentifiedImageError" else (
            str(e).splitlines()[0] if str(e) else type(e).__name__)
        raise FeedError(f"image {index} is not an image slimml reads ({reason}); send a JPEG, PNG, BMP, GIF or WebP "
                        "file.") from None
    if im.width * im.height > max_pixels:
        raise _too_big(index, f"{im.width}x{im.height} pixels", max_pixels)
    return im


def _too_big(index: int, size: str, max_pixels: int) -> TooLargeError:
    return TooLargeError(f"image {index} is {size}, more than the {max_pixels:,} pixels it may have here; send it "
                         "smaller (the model reads it resized anyway).")


def decode_image(im, index: int = 0):
    """An image :func:`open_image_bytes` opened, its pixels decoded (no copy kept of the file's)."""
    try:
        im.load()
    except Exception as e:  # a truncated or damaged file
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise FeedError(f"image {index} could not be decoded ({reason}); send the whole file.") from None
    return read_image(im, index)


def _read_image(image, index: int):
    Image = _pillow()
    if hasattr(image, "getbands"):
        return image
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim not in (2, 3) or (image.ndim == 3 and image.shape[2] not in (1, 3, 4)):
            raise FeedError(
                f"image {index} is an array of shape {image.shape} and dtype {image.dtype}; give HxWx3 (or HxW) uint8 "
                "pixels, a PIL image, or a file path."
            )
        return Image.fromarray(image[:, :, 0] if image.ndim == 3 and image.shape[2] == 1 else image)
    if isinstance(image, (str, os.PathLike)):
        if not str(image).strip():  # Path("") is ".": it was "`.` is a folder"
            raise FeedError(f"image {index} is an empty text; give an image file's path, a PIL image or an HxWx3 uint8 array.")
        path = Path(image)
        if path.is_dir():
            raise FeedError(f"{path} is a folder; give an image file in it.")
        if not path.is_file():
            raise FeedError(f"image file {path} does not exist; check the path.")
        try:
            with Image.open(path) as im:
                im.load()
                return im.copy()
        except Exception as e:  # PIL.UnidentifiedImageError, a truncated file, a decompression bomb
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise FeedError(f"{path} is not an image Pillow can read ({reason}); give a JPEG, PNG, BMP, GIF or WebP file.") from None
    raise FeedError(f"image {index} is a {type(image).__name__}; give a file path, a PIL image or an HxWx3 uint8 array.")


def _center_crop(array: np.ndarray, crop_h: int, crop_w: int) -> np.ndarray:
    """transformers' ``center_crop`` on (C, H, W): zero-pads an image smaller than the crop."""
    h, w = array.shape[-2:]
    top, left = (h - crop_h) // 2, (w - crop_w) // 2
    if top >= 0 and left >= 0 and top + crop_h <= h and left + crop_w <= w:
        return array[..., top:top + crop_h, left:left + crop_w]
    new_h, new_w = max(crop_h, h), max(crop_w, w)
    padded = np.zeros(array.shape[:-2] + (new_h, new_w), dtype=array.dtype)
    top_pad, left_pad = math.ceil((new_h - h) / 2), math.ceil((new_w - w) / 2)
    padded[..., top_pad:top_pad + h, left_pad:left_pad + w] = array
    top, left = top + top_pad, left + left_pad
    return padded[..., max(0, top):min(new_h, top + crop_h), max(0, left):min(new_w, left + crop_w)]


def _size(size: Any, where: str, square: bool = True) -> dict[str, int]:
    if isinstance(size, int):
        return {"height": size, "width": size} if square else {"shortest_edge": size}
    if isinstance(size, (list, tuple)) and len(size) == 2:
        return {"height": int(size[0]), "width": int(size[1])}
    if isinstance(size, dict) and ("height" in size and "width" in size or "shortest_edge" in size):
        return dict(size)
    raise ArtifactError(
        f"{where}: size {size!r} is not one slimml reads (height and width, or shortest_edge); "
        "preprocess the images yourself and call run() with pixel_values."
    )


def _per_channel(value: Any, channels: int, key: str, where: str) -> list[float]:
    values = list(value) if isinstance(value, (list, tuple)) else [float(value)] * channels
    if len(values) != channels:
        raise ArtifactError(f"{where}: {key} has {len(values)} values for {channels} channels; fix it and convert again.")
    return values
