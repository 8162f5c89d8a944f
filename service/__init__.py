"""The HTTP front door: an asyncio service over the reservation client (``reservations serve``).
docs/architecture.md, "The HTTP front door", walks the whole path and every answer."""

from service.app import Caller, create_app

__all__ = ["Caller", "create_app"]
