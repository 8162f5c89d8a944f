"""The process harness the operator's tools, the tests and the bench share: private redis-servers and
Sentinel or Cluster topologies, celery workers and beat, a uvicorn front door, migrated PostgreSQL
schemas, hosts of their own (network namespaces) and their links, the delay proxy; and what the tests
share (the stores they run on, the command line run in-process, worker clusters, scripted plans).

It sits on the tools' floor beside ``admin``: it imports the library (fencing, reservations, tasks) and
nothing above it, and the library and the HTTP service never import it.
"""
