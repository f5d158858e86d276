"""lzero's benchmarks, a package per topic; run a script from the repository root as
``python -m benchmarks.<topic>.<script>`` (see benchmarks/README.md)."""
