"""HTTP server: ``python -m iron_batch.server`` (see :mod:`iron_batch.server.cli`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from iron_batch.engine import Engine
    from iron_batch.server.admission import ServerLimits

__all__ = ["create_app"]


def create_app(
    engine: Engine,
    *,
    api_key: str | list[str] | None = None,
    max_waiting_requests: int | None = None,
    served_model_name: str | None = None,
    limits: ServerLimits | None = None,
) -> Starlette:
    # Imported on call so that `import iron_batch.server` stays cheap.
    from iron_batch.server.app import create_app as _create_app

    return _create_app(
        engine,
        api_key=api_key,
        max_waiting_requests=max_waiting_requests,
        served_model_name=served_model_name,
        limits=limits,
    )
