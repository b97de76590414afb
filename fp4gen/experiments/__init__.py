"""Experiments over recipes: ``fp4gen sweep`` trains every recipe with several seeds on the same
data order and compares the final losses with BF16's, paired over seeds, with a confidence
interval (docs/experiments.md)."""
