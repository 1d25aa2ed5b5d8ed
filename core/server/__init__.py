"""`specpilot serve`: an OpenAI-compatible HTTP server over the engine's online scheduler.

protocol.py checks request bodies, engine_loop.py runs the scheduler on its own thread, text.py turns tokens
into streamed text, app.py holds the FastAPI routes, metrics.py the Prometheus metrics, main.py the command.
"""
