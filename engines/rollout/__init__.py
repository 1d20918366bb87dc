"""The rollout control plane, off the request path: rules, signals, sentinels, the pure ``decide``, and its I/O.

Telemetry, energy and the WER and accuracy sentinels measure; :mod:`engines.rollout.rollback` decides;
offload and the shared state carry the decision out; the routing table is what the request path reads.
"""
