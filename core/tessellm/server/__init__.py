"""The OpenAI-compatible HTTP server (aiohttp) over the AsyncEngine."""
