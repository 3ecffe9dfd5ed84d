"""Adapters that serve real models through a ``PrefixCache`` (each imports its framework lazily).

``radixkv.integrations.transformers``: a Hugging Face causal LM (extra ``hf``).
"""
