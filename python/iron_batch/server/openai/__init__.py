"""The OpenAI-compatible front end: :mod:`.protocol` (requests), :mod:`.responses` (bodies
and chunks), :mod:`.serving` (the endpoints)."""
