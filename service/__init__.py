"""The HTTP front door: an asyncio service over the reservation client (``reservations serve``).

``POST /reservations`` with an ``Idempotency-Key`` reserves (201), refuses with a problem document (409
not enough stock, 422 key reused, 400 malformed, 429 too many of the caller's requests in flight, 503
unavailable or overloaded, 504 expired) or says the outcome is not known yet (202 with its Location).
:func:`create_app` builds the app; its ``caller`` dependency scopes keys per caller. docs/architecture.md
walks the whole path.
"""

from service.app import Caller, create_app

__all__ = ["Caller", "create_app"]
