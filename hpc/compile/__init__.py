"""Compiling candidate kernels: torch-free sources with g++/nvcc, cached by content."""
