"""moesim: a discrete-event simulator of distributed Mixture-of-Experts training.

Importing :mod:`sim` stays light: it never imports torch or deepspeed (a test checks it).
"""

__version__ = "0.1.0"
