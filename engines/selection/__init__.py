"""Per-request engine selection: the pool's probed health and circuits, the order to try, and concurrency slots.

What a request asks of the engines behind its model (:mod:`engines.selection.pool` is the facade); the
routing table it reads is published by the rollout control plane (:mod:`engines.rollout.routing`).
"""
