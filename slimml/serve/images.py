"""Images in a JSON request: data URLs (``"data:image/png;base64,..."``, as OpenAI's vision messages
send them), decoded in the replica, never fetched and never read from a path.

Each image's size is read from its header and held to one budget of pixels a request (a small
compressed file can hold a huge image), so a request's decoded images stay within about
``MAX_REQUEST_PIXELS`` x 4 bytes whatever it sends.
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any

from slimml.errors import FeedError, RequestError
from slimml.runtime.tasks.limits import shown

MAX_REQUEST_PIXELS = 1 << 26  # 67 million: a dozen 12-megapixel photos, 268 MB as RGBA
_DATA_URL = re.compile(r"data:image/[\w.+-]+(?:;[\w=.+-]+)*;base64,", re.IGNORECASE)


def is_image(item: Any) -> bool:
    """Whether a request's item is an image (a data URL of one) rather than a text."""
    return isinstance(item, str) and item[:11].lower() == "data:image/"


def request_images(items: Any, field: str, max_items: int, max_pixels: int = MAX_REQUEST_PIXELS) -> list:
    """``items`` (one data URL or a list of them) as loaded PIL images, in order.

    Raises:
        RequestError: not data URLs of images (a web address or a path: nothing is fetched or
            read here), bad base64, a file Pillow cannot read, more than ``max_items``, or more
            than ``max_pixels`` pixels in all.
    """
    from slimml.runtime.tasks.inputs.image import image_from_bytes
    from slimml.serve.protocol import at_most

    items = [items] if isinstance(items, str) else items
    if not isinstance(items, list) or not items:
        raise RequestError(f'"{field}" must be an image or a list of images, each a data URL '
                           '("data:image/png;base64,...").', param=field)
    at_most(len(items), max_items, f'"{field}" has {len(items)} images', field)
    images, left = [], max_pixels
    for i, item in enumerate(items):
        where = f"{field}[{i}]"
        if not isinstance(item, str):
            raise RequestError(f'"{where}" is a JSON {type(item).__name__}; send each image as a data URL '
                               '("data:image/png;base64,...").', param=where)
        head = _DATA_URL.match(item)
        if head is None:
            fetched = item[:8].lower().startswith(("http://", "https:/"))
            what = "a web address: this server fetches nothing" if fetched else f"not an image data URL ({shown(item, 24)})"
            raise RequestError(f'"{where}" is {what}; send the image inline, as "data:image/png;base64," followed by '
                               "the file's base64.", param=where)
        try:
            data = base64.b64decode(item[head.end():], validate=True)
        except (binascii.Error, ValueError):
            raise RequestError(f'"{where}" is not valid base64 after its "data:image/...;base64," prefix.', param=where) from None
        try:
            image = image_from_bytes(data, i, left)
        except FeedError as e:
            if "pixels it may have here" in str(e):  # the budget left: the request's images hold too many
                raise RequestError(f'"{where}": {e} (the images of one request may hold {max_pixels:,} pixels in all)',
                                   413, param=where) from None
            raise RequestError(f'"{where}": {e}', param=where) from None
        left -= image.width * image.height
        images.append(image)
    return images


def image_classify_request(data: dict[str, Any], max_items: int, zero_shot: bool,
                           max_chars: int | None = None) -> tuple[list, int | None, list[str] | None]:
    """``(images, top_k, labels)`` of a classify request to an image model: ``input`` (data URLs),
    ``top_k``, and for a zero-shot (CLIP) model the candidate ``labels`` (texts, each once)."""
    from slimml.serve.protocol import at_most, checked_texts, classify_top_k

    labels = data.get("labels")
    if zero_shot:
        if not isinstance(labels, list) or not labels or not all(isinstance(t, str) and t.strip() for t in labels):
            raise RequestError('a zero-shot classify request needs "labels": the candidate texts to score each image '
                               'against, e.g. ["a photo of a cat", "a photo of a dog"].', param="labels")
        at_most(len(labels), max_items, f'"labels" has {len(labels)} texts', "labels")
        twice = next((t for i, t in enumerate(labels) if t in labels[:i]), None)
        if twice is not None:
            raise RequestError(f'"labels" names {shown(twice)} twice; give each candidate once.', param="labels")
        labels = checked_texts(labels, '"labels"', max_chars, param="labels")
    else:
        for key in ("labels", "candidate_labels"):
            if data.get(key) is not None:
                raise RequestError(f'"{key}" names candidate labels for zero-shot classification; this classifier '
                                   f'scores its own labels: leave "{key}" out.', param=key)
    if "input" not in data:
        raise RequestError('a classify request needs "input": an image or a list of images, each a data URL '
                           '("data:image/png;base64,...").', param="input")
    top_k = classify_top_k(data)
    return data["input"], top_k, labels if zero_shot else None
