"""What the machine offers and how to use it: CPU kernel choices, huge pages, the heap,
OpenMP, CUDA facts, and the tuning switches. Imports nothing of iron_batch but ``_core``."""
