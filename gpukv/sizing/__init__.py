"""The KV cache's sizing: what a layer's cache looks like and how many blocks fit.

* ``spec``: the KV-cache specs and configs;
* ``config``: ``get_kv_cache_config``, the host controller's side of sizing;
* ``reconcile``: one config agreed across workers (ranks of torch.distributed).

Importing the package imports none of them.
"""
