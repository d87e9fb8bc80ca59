"""posttrain: online reinforcement-learning post-training of language models.

The package root imports nothing heavy, so that ``posttrain --help`` and ``--validate-manifest``
stay free of torch. Submodules that need torch import it themselves.
"""

__version__ = "0.1.0"
