"""The device manager (``manager``: ``DeviceManager``) and its parts, which it composes.

Each part has one job and a file of its name:

* ``decode``: ``DecodePath``, a running batch's plan -> stage -> launch ->
  finish (the batched ``decode``, and a step's running requests);
* ``admission``: ``Admission``, a step's new requests in rounds (and the
  lookups that change nothing);
* ``releases``: ``Releases``, finished requests' blocks given back;
* ``events``: ``DeviceEvents``, the KV-cache events (device buffer, host queue);
* ``reads``: ``DeviceReads``, every read that waits on the device.

They run on the pool (``gpukv.device.pool.DevicePool``: its verbs) and the request
rows (``gpukv.device.rows.DeviceRows``), plan with ``gpukv.device.admission_plan`` and
``gpukv.device.outputs``, upload through ``gpukv.device.staging``, and launch
``gpukv.kernels``; none imports or holds the manager: each takes what it
uses through its constructor (``gpukv.device.state``: the shared state, the
manager's calls under public names, and the verbs the decode and the
admission both launch).

The device-only helpers beside them: ``pool`` (the device-resident block
pool), ``rows`` (request rows), ``admission_plan`` (an admission's host plan
and buffers), ``outputs`` (a step's outputs), ``staging`` (uploads),
``event_buffer`` (the KV-cache event buffer), ``graphs`` (CUDA-graph
replay), ``calls``, ``launches``. Importing the package imports none of them.
"""
