"""OpenAI-compatible HTTP gateway: FastAPI in front of the router's gRPC `tandem.v1.Generation` API.

torch-free by construction: it tokenizes with `tokenizers` and renders chat templates with jinja2.
"""
