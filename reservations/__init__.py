"""Inventory reservations fenced by per-SKU leases (the domain over :mod:`fencing`)."""
