"""Processes and transport: communication groups, point-to-point sends, store signals, timeouts,
the communication timeline, host-sync counting, pre-flight checks and teardown at exit."""
