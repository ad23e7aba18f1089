"""Parallelism: the mesh, autograd-aware collectives, parallel layers, schedules."""
