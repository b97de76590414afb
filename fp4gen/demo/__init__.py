"""A small GPT trained on bytes that exist on every machine, to compare recipes side by side."""
