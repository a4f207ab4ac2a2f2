"""Images in requests: each API's image part into one internal part, its bytes decoded under
the server's limits, and a chat's image parts into what the chat template renders.

Internal part: `{"type": "image", "source": ImageSource}` beside `{"type": "text", "text": ...}`
in a message's `content` list (the routes make them: OpenAI `image_url`, Anthropic `image`
blocks, in user turns and inside `tool_result`, Responses `input_image`). `Service.render_chat`
takes them out in order (`take_images`), the template sees `{"type": "image"}` placeholders.
"""

from __future__ import annotations

import base64
import binascii
import re
import urllib.error
import urllib.request
from dataclasses import dataclass

from ..model.vision import ImageError, ImageLimits
from .errors import APIError

DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*?);base64,",
                      re.I)
FETCH_TIMEOUT = 20.0


@dataclass(frozen=True)
class ImageSource:
    """An image as a request gave it: base64 `data`, or a `url` (an http(s) URL, or a data
    URL); `where`: the request field, for errors."""

    where: str
    data: str | None = None
    url: str | None = None


def image_part(where: str, *, data: str | None = None, url: str | None = None) -> dict:
    return {"type": "image", "source": ImageSource(where, data, url)}


def anthropic_image(source, where: str) -> dict:
    """An Anthropic image block's `source` (base64 data or a URL) as an internal part."""
    if source.type == "base64":
        return image_part(f"{where}.source", data=source.data)
    return image_part(f"{where}.source", url=source.url)


def content_of(parts: list[dict]) -> str | list[dict]:
    """A message's content from internal parts: one string where there is no image."""
    if not any(p["type"] == "image" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def parts_of(content, where: str) -> str | list[dict]:
    """A content field of any API (None, a string, or a list of its text and image parts:
    OpenAI's `text` / `image_url`, Anthropic's `text` / `image`, Responses' `input_text` /
    `output_text` / `input_image`) -> `content_of` its internal parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for j, p in enumerate(content):
        if p.type == "image_url":
            parts.append(image_part(f"{where}.{j}", url=p.url))
        elif p.type == "input_image":
            if p.image_url is None:
                raise APIError(400, f"{where}.{j}: an input_image needs image_url (uploaded "
                               "files are not stored here)", param=f"{where}.{j}")
            parts.append(image_part(f"{where}.{j}", url=p.image_url))
        elif p.type == "image":
            parts.append(anthropic_image(p.source, f"{where}.{j}"))
        else:
            parts.append({"type": "text", "text": p.text})
    return content_of(parts)


def tool_images_after(messages: list[dict]) -> list[dict]:
    """Tool turns' images moved into a user turn right after the run of tool turns that holds
    them (chat templates render a tool turn's content as text); other turns' images stay."""
    out, pending = [], []
    for m in messages + [None]:
        if m is not None and m["role"] == "tool" and isinstance(m.get("content"), list):
            pending += [p for p in m["content"] if p["type"] == "image"]
            m = {**m, "content": "".join(p["text"] for p in m["content"]
                                         if p["type"] == "text")}
        if pending and (m is None or m["role"] != "tool"):
            out.append({"role": "user", "content": pending})
            pending = []
        if m is not None:
            out.append(m)
    return out


def has_images(messages: list[dict]) -> bool:
    return any(isinstance(m.get("content"), list) and
               any(p.get("type") == "image" for p in m["content"]) for m in messages)


def take_images(messages: list[dict]) -> tuple[list[dict], list[ImageSource]]:
    """Messages whose image parts are the template's `{"type": "image"}` placeholders, and
    the sources in order."""
    sources, out = [], []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for p in content:
                if p.get("type") == "image":
                    sources.append(p["source"])
                    parts.append({"type": "image"})
                else:
                    parts.append(p)
            m = {**m, "content": parts}
        out.append(m)
    return out, sources


def image_bytes(source: ImageSource, limits: ImageLimits, fetch: bool) -> bytes:
    """The encoded image: base64 (bare or in a data URL) decoded, an http(s) URL fetched
    where `fetch` allows; APIError 400 / 413 naming the field and the limit."""
    data = source.data
    if source.url is not None:
        m = DATA_URL.match(source.url)
        if m:
            data = source.url[m.end():]
        elif source.url.lower().startswith(("http://", "https://")):
            if not fetch:
                raise APIError(400, f"{source.where}: image URLs are not fetched by this "
                               "server; send the image inline (base64 or a data: URL), or "
                               "start it with --fetch-images", param=source.where)
            return _fetch(source, limits)
        else:
            raise APIError(400, f"{source.where}: expected a data: URL (base64) or an http(s) "
                           f"URL, got {source.url[:40]!r}", param=source.where)
    if data is None:
        raise APIError(400, f"{source.where}: the image has no data", param=source.where)
    if len(data) * 3 // 4 > limits.image_bytes + 2:
        raise APIError(413, f"{source.where}: about {len(data) * 3 // 4} bytes, more than "
                       f"max_image_bytes {limits.image_bytes}", param=source.where)
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, f"{source.where}: the image data is not valid base64",
                       param=source.where) from None


def _fetch(source: ImageSource, limits: ImageLimits) -> bytes:
    try:
        with urllib.request.urlopen(source.url, timeout=FETCH_TIMEOUT) as r:   # noqa: S310
            body = r.read(limits.image_bytes + 1)
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise APIError(400, f"{source.where}: could not fetch the image ({e})",
                       param=source.where) from None
    if len(body) > limits.image_bytes:
        raise APIError(413, f"{source.where}: more than max_image_bytes {limits.image_bytes}",
                       param=source.where)
    return body


def decode_images(sources: list[ImageSource], limits: ImageLimits, fetch: bool) -> list:
    """The sources as PIL images, each checked (`model.vision.open_image`); errors name the
    field."""
    from ..model.vision import open_image

    if len(sources) > limits.images:
        raise APIError(413, f"{len(sources)} images, more than max_images {limits.images}")
    out = []
    for s in sources:
        try:
            out.append(open_image(image_bytes(s, limits, fetch), limits, s.where))
        except ImageError as e:
            raise APIError(e.status, str(e), param=s.where) from None
    return out
