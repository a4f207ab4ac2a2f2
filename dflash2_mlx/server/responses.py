"""`POST /v1/responses`: the OpenAI Responses API, over the same `Service` as chat completions.

A request's `instructions` and `input` items become the chat messages `/v1/chat/completions`
would get for the same conversation, so the prompt ids, and with them the greedy text, are the
same; the pieces `TextStream` cuts out become output items (`reasoning` with
`reasoning_text`, `message` with `output_text`, `function_call`), streamed as the API's typed
events. Stateless: nothing is stored, so `previous_response_id`, `store: true` and stored
items are refused, as is every field this server does not know. Built-in tools it cannot run
(web search, ...) are left out of the prompt and named in the `x-dflash2-ignored-tools` header;
namespace tools are flattened into function tools and their calls answered with the `namespace`
field, as Codex routes them; custom (freeform) tools become functions of one string, `input`.
docs/server.md lists every field.

`responses_input`: the request and its conversion; `responses_output`: the output items and the
Response object; here: the route and its event stream.
"""

from __future__ import annotations

import itertools
from typing import Annotated, Any, AsyncIterator

from fastapi import APIRouter, Body, Request
from fastapi.responses import JSONResponse

from ..model.sampling import Sampling
from .errors import APIError
from .http import PING, Authorized, JSONRoute, ServiceDep, event_stream, sse
from .responses_input import chat_messages, chat_tools, hosted_tools, parse_request
from .responses_output import Output, response_head, response_object, response_status
from .scheduler import GenerationRequest, Job
from .service import Service
from .text_stream import TextStream
from .thinking import effort_switch

router = APIRouter(route_class=JSONRoute, dependencies=[Authorized])

# --------------------------------------------------------------------------- the route

@router.post("/v1/responses")
async def create_response(body: Annotated[dict[str, Any], Body()], request: Request,
                          service: ServiceDep):
    """The body comes as a JSON object: `parse_request` checks it (so that it can name the
    field with a hint)."""
    hosted = hosted_tools(body)
    req = parse_request(body)
    service.check_model(req.model)
    sampling = Sampling(1.0 if req.temperature is None else req.temperature,
                        1.0 if req.top_p is None else req.top_p, req.top_k)
    tools, names = chat_tools(req)
    effort = req.reasoning.effort if req.reasoning is not None else None
    prompt, media = service.render_chat(chat_messages(req), tools, param="input",
                                 thinking=effort_switch(effort))
    head = response_head(req, service.config.model_id)
    try:
        limit = service.max_tokens(req.max_output_tokens, len(prompt), "max_output_tokens",
                                   prompt_param="input")
    except APIError as e:
        if not req.stream or e.code != "context_length_exceeded":
            raise
        # a stream reports it as Codex reads it: response.failed with the error's code
        return event_stream(_failed(head, e))
    job = service.submit(GenerationRequest(prompt, limit, sampling, req.seed,
                                           service.checkpoint(prompt), media))
    text = service.tool_stream([], tools, prompt)
    headers = service.headers(limit, hosted)
    sealed = "reasoning.encrypted_content" in (req.include or [])
    if req.stream:
        return event_stream(_events(service, job, text, head, Output(names, sealed)), headers)
    out, final = Output(names, sealed), None
    async for pieces, final in service.run(job, text, request):
        out.feed(pieces)
    if final is None:
        return JSONResponse({}, 499)      # the client left; nobody reads this
    status = response_status(final, text)
    out.finish(status)
    return JSONResponse(response_object(head, status, out.items, final, text=text),
                        headers=headers)


async def _failed(head: dict, e: APIError) -> AsyncIterator[str]:
    """A stream that fails before it starts: response.created, then response.failed."""
    yield sse({"type": "response.created", "sequence_number": 0,
               "response": response_object(head, "in_progress", [])}, "response.created")
    yield sse({"type": "response.failed", "sequence_number": 1, "response": response_object(
        head, "failed", [], error={"code": e.code, "message": e.message})}, "response.failed")


async def _events(service: Service, job: Job, text: TextStream, head: dict,
                  out: Output) -> AsyncIterator[str]:
    """The typed event stream: response.created, response.in_progress, the events of each
    output item, then response.completed (or .incomplete; an error: error, response.failed)."""
    numbers = itertools.count()

    def typed(event: dict) -> str:
        return sse({**event, "sequence_number": next(numbers)}, event["type"])

    yield typed({"type": "response.created", "response": response_object(head, "in_progress", [])})
    yield typed({"type": "response.in_progress",
                 "response": response_object(head, "in_progress", [])})
    try:
        async for pieces, final in service.run(job, text):
            if not pieces and final is None:
                yield PING
            for event in out.feed(pieces):
                yield typed(event)
            if final is not None:
                status = response_status(final, text)
                for event in out.finish(status):
                    yield typed(event)
                yield typed({"type": f"response.{status}",
                             "response": response_object(head, status, out.items, final,
                                                   text=text)})
    except APIError as e:
        yield typed({"type": "error", "code": e.code or e.kind, "message": e.message,
                     "param": e.param})
        yield typed({"type": "response.failed", "response": response_object(
            head, "failed", out.items, error={"code": "server_error", "message": e.message})})
