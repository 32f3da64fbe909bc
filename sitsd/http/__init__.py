"""The OpenAI-compatible HTTP front end: FastAPI on uvicorn, in the daemon's process and event
loop, on the same engine (and the same request validation) as gRPC.

    server      uvicorn on the daemon's loop; `start_http` builds and starts it
    app         routes, API keys, errors in OpenAI's shape
    handlers    /v1/completions and /v1/chat/completions, streamed (SSE) or whole
    protocol    the request and response bodies (pydantic)
    prompts     prompts and chat messages -> token ids
    sampling    bodies -> `SamplingParams`; refusals of what is not supported
    generation  the n choices of a request in the engine, aborted together
    responses   engine deltas -> bodies and chunks
    sse         Server-Sent Events; work cancelled when the client disconnects
    errors      every failure -> status + OpenAI error JSON
    telemetry   server spans, request counters and failure logs
    structured  grammar checks before a request is added

The Admin operations stay on gRPC.
"""
