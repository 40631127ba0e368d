"""IBM WMLA Elastic Distributed Training compatibility: the ``fabric-model run`` runtime.

``runtime.py`` is the command; ``modules/`` holds the sources of the modules IBM's runtime
made importable (``callbacks``, ``emetrics``, ``elog``, ``edtcallback``, ``pyedt``), zipped
into ``$FABRIC_HOME/libs/fabric.zip`` at run time. See docs/ibm-migration.md.
"""
