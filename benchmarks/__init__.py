"""loom's benchmarks, each run as a module from the repository root (no ``sys.path`` edits):
``OMP_NUM_THREADS=1 python -m benchmarks.vs_torch_native``. They import each other as
``benchmarks.x`` and the test helpers as ``testkit``; neither is installed with loom. Recorded
results: benchmarks/results/ (benchmarks/results/README.md)."""
