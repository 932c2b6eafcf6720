"""Images in a JSON request: data URLs (``"data:image/png;base64,..."``, as OpenAI's vision messages
send them), decoded in the replica, never fetched and never read from a path.

Each image's header is read first (JPEG, PNG, BMP, GIF or WebP only: no format that would run
another program, such as EPS through Ghostscript); a request's images may declare at most
``MAX_REQUEST_PIXELS`` pixels in all, and a replica decodes at most ``MAX_REPLICA_PIXELS`` at once
(held until the model is done with them): past it a request gets 503 and retries. Six concurrent
requests of one 64-megapixel PNG each (186 KB a body) took a replica from 0.2 to 2.96 GB before
the replica's budget.
"""

from __future__ import annotations

import base64
import binascii
import re
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

from slimml.errors import FeedError, RequestError, TooLargeError
from slimml.runtime.tasks.limits import shown

MAX_REQUEST_PIXELS = 1 << 25  # 33.5 million: an 8K frame, or a hundred 512x512 images
MAX_REPLICA_PIXELS = 1 << 26  # decoded at once in a replica (~270 MB as RGBA, a copy or two while preprocessed)
_DATA_URL = re.compile(r"data:image/[\w.+-]+(?:;[\w=.+-]+)*;base64,", re.IGNORECASE)
_URL_HEAD = re.compile(r"data:image/[\w.+-]+(?:;[\w=.+-]+)*,", re.IGNORECASE)  # a media type, its parameters, a comma


def is_image(item: Any) -> bool:
    """Whether a request's item is an image (a data URL of one) rather than a text: one with a data
    URL's shape (``data:image/TYPE``, its parameters, a comma) is an image, even one that is not base64
    (:func:`open_images` says what is wrong with it); a text about data URLs ("data:image/png is ...",
    "data:image/png; see RFC 2397") is a text."""
    return isinstance(item, str) and _URL_HEAD.match(item) is not None


@dataclass
class OpenedImages:
    """A request's images with their headers read and checked, not yet decoded: :meth:`decode`
    them while holding ``pixels`` of the replica's budget (:func:`decoding`)."""

    opened: list
    field: str

    @property
    def pixels(self) -> int:
        return sum(im.width * im.height for im in self.opened)

    def decode(self) -> list:
        from slimml.runtime.tasks.inputs.image import decode_image

        out = []
        for i, im in enumerate(self.opened):
            try:
                out.append(decode_image(im, i))
            except FeedError as e:
                raise RequestError(f'"{self.field}[{i}]": {e}', param=f"{self.field}[{i}]") from None
        return out


def open_images(items: Any, field: str, max_items: int, max_pixels: int = MAX_REQUEST_PIXELS) -> OpenedImages:
    """``items`` (one data URL or a list of them) opened: each a data URL of an image slimml reads,
    their headers within ``max_pixels`` pixels in all.

    Raises:
        RequestError: not data URLs of images (a web address or a path: nothing is fetched or
            read here), bad base64, a file of another format, more than ``max_items``, or more
            than ``max_pixels`` pixels in all (413).
    """
    from slimml.runtime.tasks.inputs.image import open_image_bytes
    from slimml.serve.protocol import at_most

    items = [items] if isinstance(items, str) else items
    if not isinstance(items, list) or not items:
        raise RequestError(f'"{field}" must be an image or a list of images, each a data URL '
                           '("data:image/png;base64,...").', param=field)
    at_most(len(items), max_items, f'"{field}" has {len(items)} images', field)
    opened, left = [], max_pixels
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
            raise RequestError(f'"{where}" is not valid base64 after its "data:image/...;base64," prefix; encode the '
                               "whole file in standard base64 (base64.b64encode), no line breaks.", param=where) from None
        try:
            im = open_image_bytes(data, i, left)
        except TooLargeError as e:  # past the budget left: the request's images hold too many pixels
            raise RequestError(f'"{where}": {e} (the images of one request may hold {max_pixels:,} pixels in all)',
                               413, param=where) from None
        except FeedError as e:
            raise RequestError(f'"{where}": {e}', param=where) from None
        left -= im.width * im.height
        opened.append(im)
    return OpenedImages(opened, field)


class _Budget:
    """Pixels a replica decodes at once, across its requests."""

    def __init__(self, total: int):
        self.total, self.used, self.lock = total, 0, threading.Lock()

    @contextmanager
    def hold(self, pixels: int) -> Iterator[None]:
        with self.lock:
            if self.used and self.used + pixels > self.total:
                raise RequestError(f"this replica is decoding other requests' images ({self.used:,} pixels of its "
                                   f"{self.total:,}); retry shortly, or send smaller images.", 503)
            self.used += pixels
        try:
            yield
        finally:
            with self.lock:
                self.used -= pixels


_replica = _Budget(MAX_REPLICA_PIXELS)


def decoding(opened: OpenedImages):
    """Hold ``opened``'s pixels of the replica's budget (503 past it) while they are decoded and used."""
    return _replica.hold(opened.pixels)


def image_classify_request(data: dict[str, Any], max_items: int, zero_shot: bool,
                           max_chars: int | None = None) -> tuple[list, int | None, list[str] | None]:
    """``(images, top_k, labels)`` of a classify request to an image model: ``input`` (data URLs),
    ``top_k``, and for a zero-shot (CLIP) model the candidate ``labels`` (texts, each once)."""
    from slimml.serve.protocol import at_most, checked_texts, classify_top_k, refuse_candidate_labels

    labels = data.get("labels")
    if zero_shot:
        if data.get("candidate_labels") is not None:
            raise RequestError('"candidate_labels" is the Hugging Face pipeline\'s name; this route\'s field is "labels": '
                               'send the candidate texts as "labels".', param="candidate_labels")
        if labels is None:
            raise RequestError('a zero-shot classify request needs "labels": the candidate texts to score each image '
                               'against, e.g. ["a photo of a cat", "a photo of a dog"].', param="labels")
        if not isinstance(labels, list) or not labels:
            raise RequestError(f'"labels" must be a non-empty list of texts, got {shown(labels)}.', param="labels")
        empty = next((i for i, t in enumerate(labels) if not isinstance(t, str) or not t.strip()), None)
        if empty is not None:
            raise RequestError(f'"labels"[{empty}] is {shown(labels[empty])}; each label is a text with words in it.',
                               param=f"labels[{empty}]")
        at_most(len(labels), max_items, f'"labels" has {len(labels)} texts', "labels")
        twice = next((t for i, t in enumerate(labels) if t in labels[:i]), None)
        if twice is not None:
            raise RequestError(f'"labels" names {shown(twice)} twice; give each candidate once.', param="labels")
        labels = checked_texts(labels, '"labels"', max_chars, param="labels")
    else:
        refuse_candidate_labels(data)
    if "input" not in data:
        raise RequestError('a classify request needs "input": an image or a list of images, each a data URL '
                           '("data:image/png;base64,...").', param="input")
    top_k = classify_top_k(data)
    return data["input"], top_k, labels if zero_shot else None
