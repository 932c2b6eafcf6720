"""Whether slimml's image preprocessing (``runtime/tasks/inputs/image.py``, numpy and Pillow) makes
the pixels the source's own transformers image processor makes, before its config is shipped.

An image processor slimml does not reproduce (another resize rule, a channel flip, a pad) would
otherwise feed the model other pixels than it was trained on, silently: its config is then left
out of the artifact, so ``classify(images)`` refuses and ``run(pixel_values=...)`` takes pixels
made by transformers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

# landscape, square and portrait, none of them the model's size: every resize and crop rule shows
SHAPES = ((480, 640), (300, 300), (457, 123))
TOLERANCE = 1e-4  # after normalisation; the two agree to ~1e-6 where they follow the same steps


def preprocessing_gap(folder: Path, config: Path) -> str | None:
    """Why the shipped ``config`` would not reproduce ``folder``'s image processor (one line; also
    where transformers cannot run that processor here, so nothing shows slimml's reading right),
    or None where it does on three images of different shapes."""
    from slimml.errors import SlimmlError
    from slimml.runtime.tasks.inputs.image import ImageProcessor

    rng = np.random.default_rng(0)
    images = [_smooth(rng, h, w) for h, w in SHAPES]
    try:
        from transformers import AutoImageProcessor

        theirs = AutoImageProcessor.from_pretrained(str(folder), use_fast=False)
        want = [np.asarray(theirs(im, return_tensors="np")["pixel_values"][0], dtype=np.float32) for im in images]
    except Exception as e:  # a processor this transformers lacks or cannot run (a fast-only one without torchvision)
        why = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        return f"transformers could not run the folder's image processor here to check slimml's reading of it ({why})"
    kind = type(theirs).__name__
    try:
        mine = ImageProcessor.from_file(config)
        got = [mine.one(im) for im in images]
    except SlimmlError as e:
        return f"slimml does not read {kind}'s config ({str(e).splitlines()[0]})"
    for (h, w), a, b in zip(SHAPES, got, want):
        if a.shape != b.shape:
            return f"{kind} makes a {w}x{h} image {b.shape[2]}x{b.shape[1]} pixels, slimml's reading of its config {a.shape[2]}x{a.shape[1]}"
        gap = float(np.abs(a - b).max())
        if gap > TOLERANCE:
            return f"slimml's pixels differ from {kind}'s by up to {gap:.3g} on a {w}x{h} image"
    return None


def _smooth(rng: np.random.Generator, height: int, width: int):
    """A PIL RGB image of smooth gradients and a little noise (resizing filters agree on it as on photos)."""
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x / width, y / height, (x + y) / (width + height)], axis=-1) * 200
    return Image.fromarray(np.clip(base + rng.normal(0, 8, base.shape), 0, 255).astype(np.uint8), "RGB")
