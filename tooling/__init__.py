"""Tooling around the trainer, out of the algorithm core: the saved-tree inspector (``treegrpo
trees``: an HTML page or text) and the preparation of packaged pretrained models (``treegrpo
model prepare``: GGUF to a ``save_pretrained`` directory)."""
