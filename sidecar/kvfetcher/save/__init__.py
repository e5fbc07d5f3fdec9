"""save: queue new prefixes and write them to the store (encode + put), off the model's path."""
