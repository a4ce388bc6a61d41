"""``spec-cache serve``: an OpenAI-compatible HTTP server on the speculative engine, with the prefix cache.

Modules, one concern each:

- ``protocol``    request parsing (typed ``APIError``s with their statuses) and the OpenAI response shapes;
- ``detokenizer`` streaming detokenization (never splits a character) and stop strings;
- ``scheduler``   the thread that owns the generator / engine session / cache (continuous batching);
- ``app``         the Starlette app: its route groups assembled, ``/health``, ``/metrics``, lifespan (drain, then
                  ``cache.close()``), ``LoadingApp``;
- ``jobs``        a request to a scheduler job and back (body limits, tokenizing off the loop, SSE, disconnects);
- ``openai_routes`` OpenAI's chat / completions / models handlers (``anthropic``, ``cache_routes``: the others);
- ``auth``        API keys (constant-time) and the tenant each key / ``cache_salt`` maps to;
- ``metrics``     the Prometheus registry behind ``/metrics`` (per-tenant series shown only to their tenant);
- ``guard``       header / body deadlines and the connection cap, in uvicorn's h11 protocol;
- ``limits``      the descriptor limit (mlx-lm's import-time setrlimit made harmless), the connection budget,
                  the store's default byte budget;
- ``logs``        rate-limited logging (one line per cause per interval);
- ``cli``         ``add_arguments(parser)`` / ``main(args)``: ``spec-cache serve``,
                  ``python -m spec_cache.apps.server``.

Only ``cli`` is imported here (MLX-free); the rest loads when the server starts.
"""

from spec_cache.apps.server.cli import add_arguments, main

__all__ = ["add_arguments", "main"]
