"""Adapters that serve real models through a ``PrefixCache`` (each imports its framework lazily).

``radixkv.integrations.transformers``: a Hugging Face causal LM (extra ``hf``).
``radixkv.integrations.paged``: the reference paged engine loop, continuous batching in miniature
on a Hugging Face Llama-family model whose KV lives in the pool pages (extra ``hf``).
``radixkv.integrations.vllm``: ``RadixKVConnector``, a KV connector for vLLM.
"""
