"""Shared by every test module: this (pytest's) process computes with one intra-op thread.

Every gloo rank the tests spawn already does (tests/dist_harness.py), and the single-process references
they are compared with run here. On the 2-core CI machine, under the load of those ranks, two OpenMP
threads of a tiny model wait on each other at every kernel: a forward and backward of
tests/measured_cases.py's GPT took 0.3-1 s with two threads and 3 ms with one. What the tests check
(losses and parameters against one process, measured tables, plans) does not depend on the count.
"""

from __future__ import annotations

import torch

torch.set_num_threads(1)
