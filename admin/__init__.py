"""The operator's floor: the admin CLI, the demo, the fault-injection run and the process harness they share.

It sits above `tasks`: it starts workers and redis-servers, reads the domain and publishes tasks, and
nothing below it imports or starts anything from here.
"""
