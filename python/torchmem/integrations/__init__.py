"""torchmem inside the frameworks people already train with: `torchmem.integrations.lightning` (PyTorch
Lightning, both namespaces), `torchmem.integrations.transformers` (the Hugging Face `Trainer`, and an OOM-aware
`find_executable_batch_size`), `torchmem.integrations.tracking` (Weights & Biases and MLflow runs).

Each submodule imports its framework only when it is used; importing this package imports nothing heavy.
The pytest plugin is `torchmem.pytest_plugin`, the Jupyter extension `%load_ext torchmem`.
"""
