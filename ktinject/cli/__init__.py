"""The command-line programs: ``ktinject chat|serve|eval|info|bench|calibrate`` (``main.py``), each in its module,
and the options they share (``options.py``). The top of the import graph: nothing in the library imports it.
"""
