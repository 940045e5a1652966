"""The REST API (FastAPI; OpenAPI at /openapi.json)."""
