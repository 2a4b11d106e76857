"""Serving layer (chapter 9): the OpenAI-compatible HTTP server over the engine.

- ``server``: the FastAPI app (completions, chat, models, health, metrics; SSE streaming).
- ``async_engine``: runs the engine's step loop in a thread and streams tokens to asyncio.
- ``api_schema``: the request and response bodies of the OpenAI API subset we serve.
- ``server_metrics``: Prometheus counters and histograms (TTFT, ITL, queue, tokens).
- ``options``: the server's knobs and their defaults (``python -m tinyserve serve``'s flags).
- ``routing``: routers that spread requests over replicas, and their simulation.
- ``local_servers``: our server on a free port, in a thread or as processes (tests, chapters).
"""
