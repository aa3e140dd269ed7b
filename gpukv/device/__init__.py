"""The device manager's parts (``gpukv.manager.DeviceManager`` composes them).

Each has one job and a file of its name:

* ``decode``: ``DecodePath``, a running batch's plan -> stage -> launch ->
  finish (the batched ``decode``, and a step's running requests);
* ``admission``: ``Admission``, a step's new requests in rounds (and the
  lookups that change nothing);
* ``releases``: ``Releases``, finished requests' blocks given back;
* ``events``: ``DeviceEvents``, the KV-cache events (device buffer, host queue);
* ``reads``: ``DeviceReads``, every read that waits on the device.

They run on the pool (``gpukv.pool.DevicePool``: its verbs) and the request
rows (``gpukv.rows.DeviceRows``), plan with ``gpukv.admission`` and
``gpukv.outputs``, upload through ``gpukv.staging``, and launch
``gpukv.kernels``; none imports the manager (each holds the manager it
belongs to, for what the parts share: its staging, its one ``_read``, and
the verbs the decode and the admission both launch).
"""
