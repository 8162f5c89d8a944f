"""Fencing tokens for leases: a lease names an owner, its token lets the resource refuse stale owners.

Take a lease with :class:`LeaseManager` (or :class:`AsyncLeaseManager`), pass ``lease`` into every write
on the protected rows through a :class:`Fence`, and treat :class:`LostOwnership` as the end of that lease.
This package is domain-free: it knows scopes, tokens and tables, nothing else.
"""

from fencing.errors import (
    BackendUnavailable,
    FencingError,
    InvalidLeaseRequest,
    LeaseBusy,
    LeaseLost,
    LostOwnership,
    SchemaMissing,
    ScopeMismatch,
    StaleToken,
    TokenOverflow,
)
from fencing.fence import Fence, FenceOutcome, FenceResult, fence_columns
from fencing.lease import Lease, LeaseEvent, LeaseInfo
from fencing.manager import AsyncLeaseManager, LeaseManager

__all__ = [
    "AsyncLeaseManager",
    "BackendUnavailable",
    "Fence",
    "FenceOutcome",
    "FenceResult",
    "FencingError",
    "InvalidLeaseRequest",
    "Lease",
    "LeaseBusy",
    "LeaseEvent",
    "LeaseInfo",
    "LeaseLost",
    "LeaseManager",
    "LostOwnership",
    "SchemaMissing",
    "ScopeMismatch",
    "StaleToken",
    "TokenOverflow",
    "fence_columns",
]
