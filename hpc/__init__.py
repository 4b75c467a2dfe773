"""hpc: a Slurm-native toolkit for training and evaluating LLM agents that write fast kernels.

Data flow: task -> candidate -> compile -> verify -> profile -> reward -> HDF5 -> analysis.
"""

__version__ = "0.1.0"
