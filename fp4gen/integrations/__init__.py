"""Hooks that run fp4gen recipes inside other training frameworks.

``fp4gen.integrations.hf_trainer``: a Hugging Face transformers ``TrainerCallback``. Each
module imports its framework, so importing this package loads none of them.
"""
