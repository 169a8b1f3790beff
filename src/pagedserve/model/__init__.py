"""Model definition, weight loading, tokenizer and chat template."""
