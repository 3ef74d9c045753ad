"""Asynchronous GRPO trainer (`prime-trainer`); see trainer/README.md.

Import submodules directly (`trainer.grpo`, `trainer.loss`, ...): the package itself imports nothing,
so `prime-trainer --help` stays free of torch.
"""
