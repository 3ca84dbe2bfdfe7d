"""The HTTP front (FastAPI): routes, templates, tokenisation, detokenisation, SSE. Never imports
torch: it talks to the scheduler process over ZMQ (engine_client)."""
