"""`dflash2-mlx serve`: OpenAI- and Anthropic-compatible HTTP APIs over `Pipeline.stream`.

The HTTP layer only: requests are checked and rendered into prompt ids, then handed to a
`Scheduler`, which owns the model on its own thread and batches the running generations
(continuous batching; one at a time where the target cannot be batched). What the
client sees (stop strings, tool calls) is cut out of the streamed text by `TextStream`.

  OpenAI     GET /v1/models, POST /v1/chat/completions, POST /v1/completions, GET /health,
             POST /v1/responses (the Responses API)
  Anthropic  POST /v1/messages

Modules: `config` (ServerConfig), `errors` (APIError, error shapes, handlers), `schemas`
(request models), `scheduler` (Scheduler, Job), `text_stream` (TextStream, Piece), `service`
(Service: checks, rendering, submit, run), `http` (dependencies, JSON body, body limit, SSE),
`openai_routes`, `anthropic_routes`, `responses` (the routers), `app` (create_app, serve).
Needs the `serve` extra (FastAPI, uvicorn).
"""

from .app import create_app, serve
from .config import ServerConfig, model_id_for
from .errors import APIError, error_body, validation_error
from .scheduler import GenerationRequest, Job, QueueFull, Scheduler
from .schemas import ChatRequest, CompletionRequest, MessagesRequest
from .service import Service
from .text_stream import Piece, TextStream

__all__ = ["create_app", "serve", "ServerConfig", "model_id_for", "APIError", "error_body",
           "validation_error", "GenerationRequest", "Job", "QueueFull", "Scheduler",
           "ChatRequest", "CompletionRequest", "MessagesRequest", "Service", "Piece",
           "TextStream"]
