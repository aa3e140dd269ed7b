"""What runs gpukv on a workload: the command line and what it drives.

* ``cli``: the ``gpukv`` command line;
* ``replay``: a serving loop over a trace, driving a manager; ``report``: its report;
* ``traces``: the workloads (Mooncake traces and step traces; the bundled ones
  are package data, ``gpukv/data/``);
* ``sweep``: hit rate against cache capacity; ``plot``: their figures;
* ``prometheus``: a serving loop's metrics; ``defaults``: the replay's defaults.

Importing the package imports none of them.
"""
