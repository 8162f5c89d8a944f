"""Celery tasks that take a SKU's lease and carry its fencing token into every stock change."""
