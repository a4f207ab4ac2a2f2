"""Images through `dflash2-mlx serve`, with the real `openai` and `anthropic` clients against a
server process on loopback (a tiny Qwen2-VL target, `vision_fixtures`): each API's image part
gives the same greedy text as `Pipeline.generate` with that image; a tool result's image is
read; a three-turn conversation that resends its image reads most of each later prompt from
the prefix cache, and a changed image misses; the limits answer 4xx naming themselves."""

from __future__ import annotations

import base64
import io

import pytest

pytest.importorskip("mlx_vlm", reason="images need mlx-vlm (the `vision` extra)")

import vision_fixtures as vf  # noqa: E402
from fixtures import Server  # noqa: E402

pytestmark = pytest.mark.server
T0 = {"temperature": 0}


def png(seed: int, size=(64, 64)) -> str:
    buf = io.BytesIO()
    vf.test_image(seed, size).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    folder = vf.write_vlm(tmp_path_factory.mktemp("vlm") / "qwen2_vl", "qwen2_vl", seed=0)
    server = Server("--model", folder, "--max-images", 3, "--max-image-pixels", 300_000)
    yield folder, server
    server.stop()


@pytest.fixture(scope="module")
def reference(vlm):
    from dflash2_mlx.pair import load

    folder, _ = vlm
    pipe = load(str(folder), None)

    def ref(text: str, seed: int, n: int = 12) -> str:
        return pipe.generate(text, images=[io.BytesIO(base64.b64decode(png(seed))).read()],
                             max_tokens=n, block_size=1).text
    return ref


def test_every_api_takes_an_image(vlm, reference):
    import anthropic
    import openai

    folder, server = vlm
    oa = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    an = anthropic.Anthropic(base_url=server.url, api_key="x")
    data = png(1)
    want = reference("Describe this image.", 1)
    chat = oa.chat.completions.create(model="qwen2_vl", max_tokens=12, temperature=0, messages=[
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
            {"type": "text", "text": "Describe this image."}]}])
    assert chat.choices[0].message.content == want
    msg = an.messages.create(model="qwen2_vl", max_tokens=12, extra_body=T0, messages=[
        {"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": data}},
            {"type": "text", "text": "Describe this image."}]}])
    assert msg.content[0].text == want
    resp = oa.responses.create(model="qwen2_vl", max_output_tokens=12, temperature=0, input=[
        {"role": "user", "content": [
            {"type": "input_image", "image_url": f"data:image/png;base64,{data}"},
            {"type": "input_text", "text": "Describe this image."}]}])
    assert resp.output_text == want
    # Claude Code's Read of a PNG: an image inside a tool_result; another image differs
    def read_png(seed: int) -> str:
        return an.messages.create(model="qwen2_vl", max_tokens=12, extra_body=T0, messages=[
            {"role": "user", "content": "Look at shot.png"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Read",
                                               "input": {"file_path": "shot.png"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": [{"type": "image", "source": {
                                              "type": "base64", "media_type": "image/png",
                                              "data": png(seed)}}]}]}]).content[0].text
    assert read_png(1) != read_png(2)


def test_a_resent_image_is_read_from_the_prefix_cache(vlm):
    import anthropic

    folder, server = vlm
    an = anthropic.Anthropic(base_url=server.url, api_key="x")
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": png(3)}}
    turns = [{"role": "user", "content": [image, {"type": "text", "text": "What is this?"}]}]
    system = "You are a coding agent. Read files, run commands, fix bugs. " * 12  # an agent's
    hits = []
    for follow in ("Say more.", "And the colours?", None):
        msg = an.messages.create(model="qwen2_vl", max_tokens=8, extra_body=T0,
                                 system=system, messages=turns)
        hits.append((msg.usage.cache_read_input_tokens or 0, msg.usage.input_tokens +
                     (msg.usage.cache_read_input_tokens or 0)))
        if follow:
            turns += [{"role": "assistant", "content": msg.content[0].text or "ok"},
                      {"role": "user", "content": follow}]
    for (read, total), (_, before) in zip(hits[1:], hits):
        assert read >= before and read >= 0.9 * total, hits     # every earlier prompt row
    # the same conversation with another image misses past the image's first row
    turns[0] = {"role": "user", "content": [{**image, "source": {**image["source"],
                                                                 "data": png(4)}},
                                            {"type": "text", "text": "What is this?"}]}
    msg = an.messages.create(model="qwen2_vl", max_tokens=8, extra_body=T0, system=system,
                             messages=turns)
    # it stops at the image's first row
    from dflash2_mlx.pair import load

    _, media = load(str(folder), None).encode_images(
        [{"role": "system", "content": system},
         {"role": "user", "content": [{"type": "image"},
                                      {"type": "text", "text": "What is this?"}]}],
        [base64.b64decode(png(4))])
    assert msg.usage.cache_read_input_tokens == int(media.image_rows.argmax()), hits


def test_limits_and_bad_images(vlm):
    import httpx

    _, server = vlm

    def post(content) -> httpx.Response:
        return httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "model": "qwen2_vl", "max_tokens": 2,
            "messages": [{"role": "user", "content": content}]})

    def image(url: str) -> dict:
        return {"type": "image_url", "image_url": {"url": url}}

    r = post([image(f"data:image/png;base64,{png(1)}")] * 4 + [{"type": "text", "text": "x"}])
    assert r.status_code == 413 and "max_images 3" in r.text
    r = post([image(f"data:image/png;base64,{png(1, (600, 600))}")])
    assert r.status_code == 413 and "max_image_pixels 300000" in r.text
    r = post([image("data:image/png;base64," + base64.b64encode(b"not a png").decode())])
    assert r.status_code == 400 and "not a readable image" in r.text
    r = post([image("data:image/png;base64,%%%")])
    assert r.status_code == 400 and "not valid base64" in r.text
    r = post([image("https://example.com/a.png")])
    assert r.status_code == 400 and "--fetch-images" in r.text
    # Anthropic's URL source, refused the same way; in its own error shape
    r = httpx.post(server.url + "/v1/messages", timeout=60, json={
        "model": "qwen2_vl", "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://x/a.png"}}]}]})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert "messages.0.content.0.source" in r.text


def test_image_urls_are_fetched_when_switched_on(vlm, tmp_path, reference):
    """`serve --fetch-images` fetches an http image URL (here from a loopback file server):
    the answer is the one the same image inline gets; a URL that fails is a 400 naming it."""
    import functools
    import http.server
    import threading

    import httpx

    folder, _ = vlm
    (tmp_path / "a.png").write_bytes(base64.b64decode(png(1)))
    files = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(
        http.server.SimpleHTTPRequestHandler, directory=str(tmp_path)))
    threading.Thread(target=files.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{files.server_address[1]}"
    server = Server("--model", folder, "--fetch-images")
    try:
        def ask(url: str) -> httpx.Response:
            return httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
                "model": "qwen2_vl", "max_tokens": 12, "temperature": 0,
                "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": "Describe this image."}]}]})

        r = ask(base + "/a.png")
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == reference("Describe this image.",
                                                                          1)
        r = ask(base + "/missing.png")
        assert r.status_code == 400 and "could not fetch the image" in r.text
        assert r.json()["error"]["param"] == "messages.0.content.0"
    finally:
        server.stop()
        files.shutdown()


def test_an_image_conversation_outlives_a_restart_on_disk(vlm, tmp_path):
    """The prefix cache's disk tier keeps an image request's state (its rows' key ids
    included): after a restart the same request reads all but its last prompt token from disk
    and answers the same."""
    import httpx

    folder, _ = vlm
    body = {"model": "qwen2_vl", "max_tokens": 8, "temperature": 0, "messages": [
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png(5)}"}},
            {"type": "text", "text": "Describe this image."}]}]}
    answers = []
    for _ in range(2):
        server = Server("--model", folder, "--prompt-cache-dir", tmp_path / "disk")
        try:
            r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
        finally:
            assert server.stop() == 0
        answers.append((r["choices"][0]["message"]["content"], r["usage"]))
    (first, u1), (again, u2) = answers
    assert u1["prompt_tokens_details"]["cached_tokens"] == 0
    assert u2["prompt_tokens_details"]["cached_tokens"] == u2["prompt_tokens"] - 1
    assert again == first
