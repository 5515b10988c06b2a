"""Tensor parallelism over ``torch.distributed``: the model split across ranks (processes on
one host or several), rank 0 scheduling and sampling. See ``backend.py`` for the step
protocol, ``models/partition.py`` for what each rank holds."""
