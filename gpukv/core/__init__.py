"""The contract both managers share (the device's and the reference's).

* ``requests``: what a caller hands a manager and what a step returns (request
  and result types, their argument checks, block arithmetic);
* ``protocol``: ``BlockManager``, the API both managers offer;
* ``manager_base``: what both managers' request-level API does the same way;
* ``failstop``: a refused call changes nothing, a fault stops every later call;
* ``running_batch``: ``RunningBatch``, a step's running requests as arrays;
* ``hashing``: the block-hash scheme, host side;
* ``windows``: what an attention type asks of its KV-cache group;
* ``limits``: the one table of limits every integer is checked against;
* ``metrics``: prefix-cache statistics.

Importing the package imports none of them.
"""
