"""KV-cache events, what a KV-aware router mirrors a manager's prefix cache from.

* ``schema``: the event types, their batches and a manager's ``EventQueue``;
* ``router``: ``RouterIndex``, a router's index of the events (``match``);
* ``wire``: the events on the wire in vLLM's format (the ``events`` extra).

The device manager's side (its event buffer) is in ``gpukv.device``.
Importing the package imports none of them.
"""
