"""The building blocks every model family is made of: linear projections (dense or
quantized, loaded whole or as a tensor-parallel part), norms, rotary embeddings, the
gated MLP, embeddings and the LM head, and the one-call CPU decode stack.

Importing this package imports neither torch nor anything above the model layer.
"""

#: ``--quantization`` modes (see ``layers/quant.py``), named here so that argument parsing
#: does not import torch.
QUANTIZATION_MODES = ("gguf", "int8", "int4")

#: ``--kv-cache-dtype`` values (see ``attention/kv_int8.py``), named here for the same
#: reason: ``auto`` keeps K/V in the model's dtype (bf16 on CPU), ``int8`` stores int8
#: values with a float32 scale per token and head.
KV_CACHE_DTYPES = ("auto", "int8")

#: ``--recurrent-state-dtype`` values (see ``layers/gated_delta.py``): how a model with
#: recurrent-state layers keeps each sequence's delta-rule matrices between steps.
STATE_DTYPES = ("float32", "bfloat16")
