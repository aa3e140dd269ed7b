"""The reference: the sequential manager on the host, the device manager's
executable spec (``manager``: ``ReferenceManager``; ``pool``: its
``BlockPool``), and its parts, which it composes, cut as the device manager's
are (``gpukv.device``):

* ``state``: ``ReferenceState``, what the manager holds for its parts (the
  pool, requests, digests, rows, stats, policies, event log), typed; each
  part below takes it in its constructor, never the manager;
* ``digests``: ``RequestState`` (a request as the reference holds it) and
  ``Digests`` (its block digests, hashed once and remembered for a request
  that comes back);
* ``rows``: ``ReferenceRows``, the rows a serving loop addresses requests by,
  and each row's counts (as the device manager mirrors them);
* ``admission``: ``ReferenceAdmission``, a step's new requests (lookups,
  admission rounds, deferrals) and ``allocate_slots`` of a new request;
* ``running``: ``ReferenceRunning``, the running requests' blocks and the
  blocks they fill cached (the reference's decode path);
* ``releases``: ``ReferenceReleases``, finished requests' blocks, and the
  blocks behind a sliding window, given back.

Each runs on the state's ``BlockPool`` (its verbs: touch, allocate, free,
cache) and reads no other object's private attributes. None imports the
manager. Importing the package imports none of them.
"""
